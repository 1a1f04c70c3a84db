// The optimizer inside the backward on CUDA tensors (pyembed/optim.py): the rules of
// csrc/optim.h, one thread per VEC elements of an updated row (16-byte accesses where the
// rows allow), rows on the grid as the embedding kernels' (row_grid). Compiled by nvcc
// into pyembed._C (embedding_cuda.cu) and by g++ with host_emulation.h into the test
// module, like embedding_kernels.cuh; no shared memory, no synchronisation, no host sync.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "../checks.h"
#include "../optim.h"
#include "embedding_kernels.cuh"

namespace pyembed::cuda {

// Updated row i (blockDim.y rows per block), VEC elements from column j per thread
// (blockDim.x threads striding over the row): all_rows: table row i, whose gradient is row
// row_slot[i] of values (-1: none, g = 0); else touched row i, table row rows[i]. A row
// outside the table (-1: an unused slot of touched_rows_op) is skipped: nothing is read
// or written out of bounds. VEC > 1 (16-byte accesses, as the embedding kernels): d a
// multiple of VEC and every tensor 16-byte aligned. Rows on the grid, as the embedding
// kernels: a flat grid-stride loop over (row, column) items paid a 64-bit division per
// item to find its row (the H100 at a4a8951: the AdamW update over a Llama-2 bf16 table
// was instruction-bound, 566 M warp instructions at 62% of DRAM bandwidth).
template <typename T, int RULE, int VEC>
__global__ void optimizer_update_kernel(T* param, T* state1, T* state2, const int64_t* rows, const int64_t* row_slot,
                                        const T* values, int64_t num_rows, int64_t touched, int64_t dim,
                                        optim::Scalars<acc_type<T>> h, bool all_rows) {
  using A = acc_type<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (i >= (all_rows ? num_rows : touched)) return;
  const int64_t row = all_rows ? i : rows[i];
  const int64_t slot = all_rows ? row_slot[i] : i;
  if (row < 0 || row >= num_rows) return;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    const int64_t at = row * dim + j;
    A p[VEC], s1[VEC] = {}, s2[VEC] = {}, g[VEC] = {};
    load_pack<VEC>(param + at, p);
    if (state1) load_pack<VEC>(state1 + at, s1);
    if (state2) load_pack<VEC>(state2 + at, s2);
    if (slot >= 0) load_pack<VEC>(values + slot * dim + j, g);
#pragma unroll
    for (int k = 0; k < VEC; ++k) optim::update<RULE>(p[k], s1[k], s2[k], g[k], h);
    store_pack<VEC>(param + at, p);
    if (state1) store_pack<VEC>(state1 + at, s1);
    if (state2) store_pack<VEC>(state2 + at, s2);
  }
}

// row_slot[rows[k]] = k for the rows inside the table (the rows are unique: no race).
__global__ void scatter_row_slots_kernel(const int64_t* rows, int64_t* row_slot, int64_t touched, int64_t num_rows) {
  const int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (k < touched && rows[k] >= 0 && rows[k] < num_rows) row_slot[rows[k]] = k;
}

template <class Launch>
void optimizer_update_op(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                         const at::Tensor& rows_in, const at::Tensor& values_in, int64_t rule,
                         c10::ArrayRef<double> hyper, bool all_rows) {
  check_optimizer_update(param, state1, state2, rows_in, values_in, rule, hyper);
  const at::Tensor rows = rows_in.contiguous(), values = values_in.contiguous();
  const int64_t num_rows = param.size(0), touched = rows.numel(), dim = param.size(1);
  at::Tensor row_slot;  // all_rows: each table row's gradient row, -1 if untouched (no host sync)
  if (all_rows) {
    row_slot = at::full({num_rows}, -1, rows.options());
    if (touched > 0) {
      const RowGrid shape = linear_grid(touched);
      Launch::run(shape.grid, shape.block, scatter_row_slots_kernel, rows.data_ptr<int64_t>(),
                  row_slot.data_ptr<int64_t>(), touched, num_rows);
    }
  }
  if ((all_rows ? num_rows : touched) == 0 || dim == 0) return;
  const int rule32 = static_cast<int>(rule);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "pyembed_optimizer_update_cuda", [&] {
    using T = scalar_t;
    const auto h = optim::Scalars<acc_type<T>>::from(rule32, hyper.data());
    auto* p = param.data_ptr<T>();
    auto* s1 = state1.numel() ? state1.data_ptr<T>() : nullptr;
    auto* s2 = state2.numel() ? state2.data_ptr<T>() : nullptr;
    const int64_t* r = rows.data_ptr<int64_t>();
    const int64_t* slots = all_rows ? row_slot.data_ptr<int64_t>() : nullptr;
    const auto* v = values.data_ptr<T>();
    const int vec = vector_width<T>(dim, {p, s1, s2, touched > 0 ? v : nullptr});
    const RowGrid shape = row_grid(all_rows ? num_rows : touched, dim, vec);
    auto launch = [&](auto rule_constant) {
      constexpr int kRule = decltype(rule_constant)::value;
      if (vec > 1) {
        Launch::run(shape.grid, shape.block, optimizer_update_kernel<T, kRule, 16 / sizeof(T)>, p, s1, s2, r, slots,
                    v, num_rows, touched, dim, h, all_rows);
      } else {
        Launch::run(shape.grid, shape.block, optimizer_update_kernel<T, kRule, 1>, p, s1, s2, r, slots, v, num_rows,
                    touched, dim, h, all_rows);
      }
    };
    switch (rule32) {
      case optim::kSGD: return launch(std::integral_constant<int, optim::kSGD>{});
      case optim::kAdam: return launch(std::integral_constant<int, optim::kAdam>{});
      case optim::kAdagrad: return launch(std::integral_constant<int, optim::kAdagrad>{});
      default: return launch(std::integral_constant<int, optim::kSparseAdam>{});
    }
  });
}

}  // namespace pyembed::cuda
