// Host emulation of the few CUDA constructs the kernels use, so that g++ compiles
// embedding_kernels.cuh unchanged and runs every kernel on CPU tensors (DESIGN §6).
//
// A launch runs every block and every thread of the grid serially. That is faithful
// because each thread's result depends on its indices alone, so any execution order gives
// the same output. What it checks is the real indexing, masking, vector-width and
// reduction code of the kernels. One kernel shares memory within a block
// (tile_rank_kernel: its tile's words, computed once a block): here `__shared__` memory is
// the thread's own and `__syncthreads` does nothing, and block_share (embedding_kernels.cuh)
// gives each emulated thread the whole of the block's cooperative loop -- the values the
// block's threads would have written between them.
#pragma once

#ifdef __CUDACC__
#error "host_emulation.h is for host compilers only"
#endif

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <utility>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__
#define __align__(n) alignas(n)
inline void __syncthreads() {}

struct alignas(16) uint4 {
  unsigned x, y, z, w;
};

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace pyembed::emulation {
inline thread_local dim3 thread_idx, block_idx, block_dim, grid_dim;
}  // namespace pyembed::emulation

#define threadIdx (::pyembed::emulation::thread_idx)
#define blockIdx (::pyembed::emulation::block_idx)
#define blockDim (::pyembed::emulation::block_dim)
#define gridDim (::pyembed::emulation::grid_dim)

// CUDA's sincosf / sincos are glibc's (GNU extensions, declared by <cmath> under g++); the
// SFU's __sincosf is sincosf here: the kernels reduce its argument first, which is what
// the host run checks (a GPU's approximation is checked on a GPU, tests/gpu).
inline void __sincosf(float x, float* s, float* c) { sincosf(x, s, c); }

namespace pyembed::emulation {

struct EmulatedLaunch {
  // What a GPU would be asked to do, for the tests' launch counts.
  inline static int64_t kernel_launches = 0, sorts = 0;

  template <typename Kernel, typename... Args>
  static void run(dim3 grid, dim3 block, Kernel kernel, Args... args) {
    ++kernel_launches;
    grid_dim = grid;
    block_dim = block;
    for (unsigned bz = 0; bz < grid.z; ++bz)
      for (unsigned by = 0; by < grid.y; ++by)
        for (unsigned bx = 0; bx < grid.x; ++bx)
          for (unsigned tz = 0; tz < block.z; ++tz)
            for (unsigned ty = 0; ty < block.y; ++ty)
              for (unsigned tx = 0; tx < block.x; ++tx) {
                block_idx = dim3(bx, by, bz);
                thread_idx = dim3(tx, ty, tz);
                kernel(args...);
              }
  }

  // CudaLaunch's CUB radix sort on `bits` bits, as a stable sort; it checks that every
  // key fits in those bits (the CUB sort would silently drop the higher ones).
  static std::pair<at::Tensor, at::Tensor> sort_pairs(const at::Tensor& keys, const at::Tensor& values,
                                                      int64_t bits) {
    AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_emulated_sort", [&] {
      const index_t* k = keys.data_ptr<index_t>();  // read directly: the tests record ATen ops
      for (int64_t i = 0; i < keys.numel(); ++i) {
        TORCH_CHECK(k[i] >= 0 && static_cast<int64_t>(k[i]) < (int64_t(1) << bits),
                    "pyembed emulation: sort key ", k[i], " outside [0, 2^", bits, ")");
      }
    });
    ++sorts;
    auto [sorted, index] = keys.sort(/*stable=*/true, 0, false);
    return {sorted, values.index_select(0, index)};
  }
};

}  // namespace pyembed::emulation
