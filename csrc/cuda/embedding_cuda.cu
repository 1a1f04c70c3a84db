// CUDA backend registration: the kernels and their orchestration are in
// embedding_kernels.cuh (shared with the host emulation the tests run); this file
// launches them on the current stream of the tensors' device.
#include <ATen/cuda/cub.h>
#include <cub/block/block_radix_sort.cuh>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <torch/library.h>

#include <mutex>
#include <string_view>

#include "embedding_kernels.cuh"
#include "optim_kernels.cuh"

namespace pyembed::cuda {
namespace {

// PYEMBED_CUDA_SORT=block: the sort's inputs and a stable sort of up to kWordSortMax keys in
// one launch (the default before the tile sort; kept while a GPU run compares them): block 0
// sorts the words of embedding_kernels.cuh's sort_word in shared memory, the other
// blocks set the segment bounds' starting values (what sort_inputs_kernel and CUB's
// device-wide radix sort do in eight GPU operations at 8x2048 tokens: a histogram, a
// onesweep pass per 8 bits, four memsets -- ~25 us of GPU time and ~10 us of host time per
// launch on the H200 run of 79bdffb). Keys-only words, because a key / value sort spilled
// 108-260 bytes at 1024 threads (64 registers); memoizing the outer scan spilled too. A
// radix sort is stable, and the words are loaded in the blocked arrangement (thread t
// holds positions 16t..16t+15), so equal keys keep their token order, as CUB's device sort
// keeps it: the same output, bit for bit.
constexpr int kBlockSortThreads = 1024, kBlockSortItems = 16, kBlockSortRadixBits = 5;
static_assert(kBlockSortThreads * kBlockSortItems == kWordSortMax);
constexpr int64_t kBoundsBlocks = 1024;  // at most, after the sorting block: grid-stride beyond
using BlockSort = cub::BlockRadixSort<uint32_t, kBlockSortThreads, kBlockSortItems, cub::NullType,
                                      kBlockSortRadixBits, /*MEMOIZE_OUTER_SCAN=*/false>;
constexpr int kBlockSortSharedBytes = sizeof(BlockSort::TempStorage);  // ~68 KB: above the default 48

template <typename index_t>
__global__ void __launch_bounds__(kBlockSortThreads)
one_block_sort_kernel(const index_t* __restrict__ ids, int n, int64_t num_rows, int64_t skip, int bits,
                      int32_t* __restrict__ sorted, int64_t* __restrict__ order, int64_t* __restrict__ bounds,
                      int64_t num_zeros, int64_t num_bounds) {
  if (blockIdx.x > 0) {  // sort_inputs_kernel's bounds
    const int64_t stride = static_cast<int64_t>(gridDim.x - 1) * blockDim.x;
    for (int64_t r = static_cast<int64_t>(blockIdx.x - 1) * blockDim.x + threadIdx.x; r < num_bounds; r += stride) {
      bounds[r] = first_bound(r, num_zeros);
    }
    return;
  }
  extern __shared__ __align__(16) unsigned char shared[];
  auto& temp = *reinterpret_cast<BlockSort::TempStorage*>(shared);
  uint32_t words[kBlockSortItems];
#pragma unroll
  for (int i = 0; i < kBlockSortItems; ++i) {
    words[i] = sort_word(ids, static_cast<int>(threadIdx.x) * kBlockSortItems + i, n, num_rows, skip);
  }
  // Word i of thread t ends at sorted position 1024 i + t: coalesced stores below.
  BlockSort(temp).SortBlockedToStriped(words, kWordPositionBits, kWordPositionBits + bits);
#pragma unroll
  for (int i = 0; i < kBlockSortItems; ++i) {
    const int r = i * kBlockSortThreads + static_cast<int>(threadIdx.x);
    if (r < n) store_sort_word(words[i], r, sorted, order);
  }
}

// Whether one_block_sort_kernel can run on `device` (PYEMBED_CUDA_SORT=block asks for it:
// embedding_kernels.cuh's requested_key_sort): its shared memory needs the opt-in above
// 48 KB, which sm_80+ allow (sm_75's 64 KB does not), set here once per device.
bool one_block_sort_available(int device) {
  constexpr int kMaxDevices = 64;
  static std::once_flag once[kMaxDevices];
  static bool fits[kMaxDevices] = {};
  if (device < 0 || device >= kMaxDevices) return false;
  std::call_once(once[device], [device] {
    int optin = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    if (optin >= kBlockSortSharedBytes) {
      const c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      for (const void* kernel : {reinterpret_cast<const void*>(one_block_sort_kernel<int32_t>),
                                 reinterpret_cast<const void*>(one_block_sort_kernel<int64_t>)}) {
        C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                            kBlockSortSharedBytes));
      }
      fits[device] = true;
    }
  });
  return fits[device];
}

struct CudaLaunch {
  template <typename Kernel, typename... Args>
  static void run(dim3 grid, dim3 block, Kernel kernel, Args... args) {
    kernel<<<grid, block, 0, c10::cuda::getCurrentCUDAStream()>>>(args...);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }

  // A stable sort of (keys, values) on the keys' low `bits` bits (keys in [0, 2^bits)):
  // CUB's radix sort, as PyTorch's own embedding backward calls it, on the current stream.
  static std::pair<at::Tensor, at::Tensor> sort_pairs(const at::Tensor& keys, const at::Tensor& values,
                                                      int64_t bits) {
    at::Tensor sorted = at::empty_like(keys), order = at::empty_like(values);
    AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_sort_pairs", [&] {
      at::cuda::cub::radix_sort_pairs<index_t, int64_t>(keys.data_ptr<index_t>(), sorted.data_ptr<index_t>(),
                                                        values.data_ptr<int64_t>(), order.data_ptr<int64_t>(),
                                                        keys.numel(), /*descending=*/false, 0, bits);
    });
    return {sorted, order};
  }

  // sorted_segments' sort inputs and sort in one launch (one_block_sort_kernel), when asked
  // for at 4096 < n <= 16384 keys of at most 18 bits, on a device with the shared memory for it.
  static bool one_block_sort_runs(const at::Tensor& ids) { return one_block_sort_available(ids.get_device()); }

  // sorted (n,) int32 and order (n,) int64 from the ids; bounds (num_bounds) as sort_inputs_kernel sets them.
  static void one_block_sort(const at::Tensor& ids, int64_t num_rows, int64_t skip, int64_t bits, int32_t* sorted,
                             int64_t* order, int64_t* bounds, int64_t num_bounds, int64_t num_zeros) {
    const int64_t bounds_blocks =
        std::min<int64_t>((num_bounds + kBlockSortThreads - 1) / kBlockSortThreads, kBoundsBlocks);
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "pyembed_one_block_sort", [&] {
      one_block_sort_kernel<index_t><<<1 + bounds_blocks, kBlockSortThreads, kBlockSortSharedBytes,
                                       c10::cuda::getCurrentCUDAStream()>>>(
          ids.data_ptr<index_t>(), static_cast<int>(ids.numel()), num_rows, skip, static_cast<int>(bits), sorted,
          order, bounds, num_zeros, num_bounds);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
};

// Every op runs on the device of its tensors (the current device may be another GPU).
at::Tensor embedding_forward_cuda(const at::Tensor& ids, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& pos_weight,
                                  const std::optional<at::Tensor>& position_ids, std::string_view pos_encoding,
                                  double scale, int64_t offset, const std::optional<at::Tensor>& dropout_key,
                                  double dropout_p, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                                  int64_t error_record) {
  const c10::cuda::CUDAGuard guard(weight.device());
  return forward_op<CudaLaunch>(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key,
                                dropout_p, sinusoid_column_offset, sinusoid_dim, error_record);
}

std::tuple<at::Tensor, at::Tensor> embedding_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, const std::optional<at::Tensor>& position_ids, int64_t offset,
    int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return backward_op<CudaLaunch>(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                                 scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key, dropout_p);
}

std::tuple<at::Tensor, at::Tensor> embedding_sparse_backward_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, int64_t num_embeddings, double scale,
    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return sparse_backward_op<CudaLaunch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                        dropout_key, dropout_p);
}

std::tuple<at::Tensor, at::Tensor> embedding_touched_rows_cuda(
    const at::Tensor& grad_out, const at::Tensor& ids, int64_t num_embeddings, double scale,
    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  const c10::cuda::CUDAGuard guard(grad_out.device());
  return touched_rows_op<CudaLaunch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                     dropout_key, dropout_p);
}

void optimizer_update_cuda(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                           const at::Tensor& rows, const at::Tensor& values, int64_t rule, c10::ArrayRef<double> hyper,
                           bool all_rows) {
  const c10::cuda::CUDAGuard guard(param.device());
  optimizer_update_op<CudaLaunch>(param, state1, state2, rows, values, rule, hyper, all_rows);
}

void optimizer_backward_cuda(const at::Tensor& grad_out, const at::Tensor& ids, double scale,
                             std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                             const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                             const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                             c10::ArrayRef<double> hyper, bool all_rows) {
  const c10::cuda::CUDAGuard guard(param.device());
  optimizer_backward_op<CudaLaunch>(grad_out, ids, scale, padding_idx, scale_grad_by_freq, dropout_key, dropout_p,
                                    param, state1, state2, rule, hyper, all_rows);
}

void position_update_cuda(const at::Tensor& grad_out, const at::Tensor& ids, int64_t offset,
                          const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                          const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                          c10::ArrayRef<double> hyper) {
  const c10::cuda::CUDAGuard guard(param.device());
  position_update_op<CudaLaunch>(grad_out, ids, offset, dropout_key, dropout_p, param, state1, state2, rule, hyper);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyembed, CUDA, m) {
  m.impl("optimizer_update", &optimizer_update_cuda);
  m.impl("optimizer_backward", &optimizer_backward_cuda);
  m.impl("position_update", &position_update_cuda);
  m.impl("embedding_touched_rows", &embedding_touched_rows_cuda);
  m.impl("embedding_forward", &embedding_forward_cuda);
  m.impl("embedding_backward", &embedding_backward_cuda);
  m.impl("embedding_sparse_backward", &embedding_sparse_backward_cuda);
}

}  // namespace pyembed::cuda
