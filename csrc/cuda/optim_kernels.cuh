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

// Elements at .. at + VEC - 1 of the table and its state (nullptr: the rule keeps none),
// read, stepped by gradient grad(k) (optim::update) and written back, each rounded once.
// The three update kernels below all end in this. The gradient is taken element by element
// beside the update (a kernel's final scaling and rounding to T in grad): computed in a
// pass of its own before the loads, the bf16 AdamW segment_update_kernel took 70
// registers at sm_90, not 64.
template <int RULE, int VEC, typename T, typename A, typename Grad>
__device__ __forceinline__ void step_pack(T* param, T* state1, T* state2, int64_t at, Grad&& grad,
                                          const optim::Scalars<A>& h) {
  A p[VEC], s1[VEC] = {}, s2[VEC] = {};
  load_pack<VEC>(param + at, p);
  if (state1) load_pack<VEC>(state1 + at, s1);
  if (state2) load_pack<VEC>(state2 + at, s2);
#pragma unroll
  for (int k = 0; k < VEC; ++k) {
    A g = grad(k);
    optim::update<RULE>(p[k], s1[k], s2[k], g, h);
  }
  store_pack<VEC>(param + at, p);
  if (state1) store_pack<VEC>(state1 + at, s1);
  if (state2) store_pack<VEC>(state2 + at, s2);
}

// The slot of table row `row` in rows -- ascending, unused slots (-1) last, as
// touched_rows_op and the sparse backward give them --, -1 if absent: a binary search (the
// branch-free lower bound, as kernels/embedding.py's _slots_of), so an update of every row
// needs no (V,) map from table row to slot built per step (a fill and a launch).
__device__ __forceinline__ int64_t slot_of(const int64_t* rows, int64_t touched, int64_t row) {
  const auto before = [row](int64_t key) { return key >= 0 && key < row; };  // an unused slot sorts last
  int64_t base = 0;
  for (int64_t n = touched; n > 1; n -= n / 2) {  // base + n <= touched throughout
    if (before(rows[base + n / 2])) base += n / 2;
  }
  if (base < touched && before(rows[base])) ++base;
  return base < touched && rows[base] == row ? base : -1;
}

// Updated row i (blockDim.y rows per block), VEC elements from column j per thread
// (blockDim.x threads striding over the row): all_rows: table row i, whose gradient is row
// slot_of(i) of values (-1: none, g = 0); else touched row i, table row rows[i]. A row
// outside the table (-1: an unused slot of touched_rows_op) is skipped: nothing is read
// or written out of bounds. VEC > 1 (16-byte accesses, as the embedding kernels): d a
// multiple of VEC and every tensor 16-byte aligned. Rows on the grid, as the embedding
// kernels: a flat grid-stride loop over (row, column) items paid a 64-bit division per
// item to find its row (the H100 at a4a8951: the AdamW update over a Llama-2 bf16 table
// was instruction-bound, 566 M warp instructions at 62% of DRAM bandwidth).
template <typename T, int RULE, int VEC>
__global__ void optimizer_update_kernel(T* param, T* state1, T* state2, const int64_t* rows, const T* values,
                                        int64_t num_rows, int64_t touched, int64_t dim,
                                        optim::Scalars<acc_type<T>> h, bool all_rows) {
  using A = acc_type<T>;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (i >= (all_rows ? num_rows : touched)) return;
  const int64_t row = all_rows ? i : rows[i];
  const int64_t slot = all_rows ? slot_of(rows, touched, i) : i;
  if (row < 0 || row >= num_rows) return;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A g[VEC] = {};
    if (slot >= 0) load_pack<VEC>(values + slot * dim + j, g);
    step_pack<RULE, VEC>(param, state1, state2, row * dim + j, [&](int k) { return g[k]; }, h);
  }
}

template <class Launch>
void optimizer_update_op(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                         const at::Tensor& rows_in, const at::Tensor& values_in, int64_t rule,
                         c10::ArrayRef<double> hyper, bool all_rows) {
  check_optimizer_update(param, state1, state2, rows_in, values_in, rule, hyper);
  const at::Tensor rows = rows_in.contiguous(), values = values_in.contiguous();
  const int64_t num_rows = param.size(0), touched = rows.numel(), dim = param.size(1);
  if ((all_rows ? num_rows : touched) == 0 || dim == 0) return;
  const int rule32 = static_cast<int>(rule);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "pyembed_optimizer_update_cuda", [&] {
    using T = scalar_t;
    const auto h = optim::Scalars<acc_type<T>>::from(rule32, hyper.data());
    auto* p = param.data_ptr<T>();
    auto* s1 = state1.numel() ? state1.data_ptr<T>() : nullptr;
    auto* s2 = state2.numel() ? state2.data_ptr<T>() : nullptr;
    const int64_t* r = rows.data_ptr<int64_t>();
    const auto* v = values.data_ptr<T>();
    const int vec = vector_width<T>(dim, {p, s1, s2, touched > 0 ? v : nullptr});
    const RowGrid shape = row_grid(all_rows ? num_rows : touched, dim, vec);
    auto launch = [&](auto rule_constant) {
      constexpr int kRule = decltype(rule_constant)::value;
      if (vec > 1) {
        Launch::run(shape.grid, shape.block, optimizer_update_kernel<T, kRule, 16 / sizeof(T)>, p, s1, s2, r, v,
                    num_rows, touched, dim, h, all_rows);
      } else {
        Launch::run(shape.grid, shape.block, optimizer_update_kernel<T, kRule, 1>, p, s1, s2, r, v, num_rows,
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

// The optimizer inside the backward for a dense token table, its gradient never in memory
// (FBGEMM's fused backward): row r's gradient is its segment's sum, factor * (the dout rows
// of its tokens, in sorted order), read from the dense-by-row segments (sorted_segments,
// by_row) as finish_segments_kernel would write it -- the same sum, rounded to T as the
// gradient would be, bit for bit -- and the rule applied to row r at once. Every row when
// all_rows (g = 0 where untouched: dense semantics), else only the touched ones. Rows on
// the grid as optimizer_update_kernel. Against touched_rows_op + optimizer_update_op: no
// by-slot numbering (its starts, their scan), no (touched, d) values written and read
// back, no row map (a fill and a scatter): 3 launches, not ~9.
template <typename T, typename A, int RULE, int VEC, bool kDropout>
__global__ void segment_update_kernel(Dout<T, kDropout> dout, const int64_t* __restrict__ order,
                                      const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                      const int64_t* __restrict__ end, T* param, T* state1, T* state2,
                                      int64_t num_rows, int64_t dim, A scale, bool divide_by_count,
                                      optim::Scalars<A> h, bool all_rows) {
  dout.start();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= num_rows) return;
  const int64_t b = begin[row], e = end[row];
  if (e == b && !all_rows) return;
  const A factor = divide_by_count && e > b ? scale / static_cast<A>(e - b) : scale;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A g[VEC] = {};  // from +0, as finish_segments sums (sum_rows; sum_pieces for a long segment)
    if (e - b > kChunkRows) {
      add_pieces<VEC>(partials, b, e, j, dim, g);
    } else {
      add_rows<VEC>(dout, order, b, e, j, g);
    }
    // The row and its state after the sum, not in flight beside it: so the bf16 kernel holds
    // 64 registers at sm_90 (four blocks per SM), not 96-104 (two). Most rows (untouched,
    // or one token) have no sum to wait for.
    step_pack<RULE, VEC>(param, state1, state2, row * dim + j, [&](int k) {
      return e > b ? static_cast<A>(static_cast<T>(g[k] * factor)) : g[k];  // the gradient as stored, in T
    }, h);
  }
}

// The learned positions' optimizer inside the backward (p = offset + t), their gradient
// never in memory: row p's gradient is its sum over the batch, from +0 in batch order as
// position_sum_row sums it, rounded to T as the stored gradient would be -- the same bits
// -- and the rule applied to the row at once; every row (g = 0 for the rows the sequence
// does not reach). One launch where embedding_backward's batch_sum_kernel and
// optimizer_update_kernel took two and a (rows, d) buffer between. Rows on the grid as
// optimizer_update_kernel.
template <typename T, typename A, int RULE, int VEC, bool kDropout>
__global__ void position_update_kernel(Dout<T, kDropout> dout, PositionSums<T> pos, T* param, T* state1, T* state2,
                                       int64_t dim, optim::Scalars<A> h) {
  dout.start();
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (row >= pos.rows) return;
  const int64_t t = row - pos.offset;
  const int64_t count = t >= 0 && t < pos.steps ? pos.batch : 0;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A g[VEC] = {};
    for (int64_t b = 0; b < count; ++b) {
      A x[VEC];
      dout.template load<VEC>(b * pos.seq_len + t, j, x);
#pragma unroll
      for (int k = 0; k < VEC; ++k) g[k] += x[k];
    }
    step_pack<RULE, VEC>(param, state1, state2, row * dim + j,
                         [&](int k) { return static_cast<A>(static_cast<T>(g[k])); }, h);  // the gradient as stored
  }
}

// The arguments of an update by the dense gradient an op computes from dout itself
// (position_update_op, optimizer_backward_op): the state as optimizer_update's, a dense
// rule (SparseAdam takes sparse gradients), one device, dout (ids.shape, d) in the table's dtype.
inline void check_update_from_dout(const at::Tensor& grad_out, const at::Tensor& ids,
                                   const std::optional<at::Tensor>& dropout_key, const at::Tensor& param,
                                   const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                                   c10::ArrayRef<double> hyper) {
  check_optimizer_state(param, state1, state2, rule, hyper);
  TORCH_CHECK_VALUE(rule != optim::kSparseAdam, "pyembed: SparseAdam takes sparse gradients, not this op");
  check_same_device(param.device(), {&grad_out, &ids, opt(dropout_key)});
  TORCH_CHECK_VALUE(grad_out.size(-1) == param.size(1) && grad_out.numel() == ids.numel() * param.size(1) &&
                        grad_out.scalar_type() == param.scalar_type(),
                    "pyembed: grad_out must be (ids.shape, d) of the table's dtype");
}

// launch(rule, width) with the dense rule `rule` (SGD, Adam, Adagrad) and the access width
// (16 bytes where vec > 1, else one element) as compile-time constants.
template <typename T, typename F>
void with_dense_rule(int rule, int vec, F&& launch) {
  auto by_width = [&](auto rule_constant) {
    if (vec > 1) {
      launch(rule_constant, std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      launch(rule_constant, std::integral_constant<int, 1>{});
    }
  };
  switch (rule) {
    case optim::kSGD: return by_width(std::integral_constant<int, optim::kSGD>{});
    case optim::kAdam: return by_width(std::integral_constant<int, optim::kAdam>{});
    default: return by_width(std::integral_constant<int, optim::kAdagrad>{});
  }
}

// torch.ops.pyembed.position_update: the learned positions' backward (p = offset + t) as
// their optimizer's update (pyembed/optim.py, step_tables). No device->host sync; not
// SparseAdam (the positions' gradient is dense).
template <class Launch>
void position_update_op(const at::Tensor& grad_out_in, const at::Tensor& ids_in, int64_t offset,
                        const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                        const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                        c10::ArrayRef<double> hyper) {
  check_update_from_dout(grad_out_in, ids_in, dropout_key, param, state1, state2, rule, hyper);
  TORCH_CHECK_VALUE(offset >= 0, "pyembed: offset must be >= 0, got ", offset);
  const int64_t num_rows = param.size(0), dim = param.size(1), num_tokens = ids_in.numel();
  if (num_rows == 0 || dim == 0) return;
  const at::Tensor dout = dout_rows_of(grad_out_in, num_tokens, dim);
  at::Tensor key;  // the forward's dropout, applied to dout as the kernel reads it (Dout)
  const Dropout dropout = dropout_of(dropout_key, dropout_p, key);
  const int rule32 = static_cast<int>(rule);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "pyembed_position_update_cuda", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const PositionSums<T> pos = position_sums<T>(num_rows, ids_in, offset);  // as embedding_backward's (no out)
    const auto h = optim::Scalars<A>::from(rule32, hyper.data());
    auto* p = param.data_ptr<T>();
    auto* s1 = state1.numel() ? state1.data_ptr<T>() : nullptr;
    auto* s2 = state2.numel() ? state2.data_ptr<T>() : nullptr;
    const int vec = vector_width<T>(dim, {p, s1, s2, dout.data_ptr()});
    const RowGrid g = row_grid(num_rows, dim, vec);
    with_dout<T>(dout, dropout, [&](auto dout_rows) {
      constexpr bool kDropout = decltype(dout_rows)::kMasked;
      with_dense_rule<T>(rule32, vec, [&](auto rule_constant, auto v) {
        Launch::run(g.grid, g.block, position_update_kernel<T, A, decltype(rule_constant)::value,
                                                            decltype(v)::value, kDropout>,
                    dout_rows, pos, p, s1, s2, dim, h);
      });
    });
  });
}

// torch.ops.pyembed.optimizer_backward: the token table's backward as its optimizer's
// update (pyembed/optim.py, step_tables), for a dense gradient: the rule's update of
// `param` by the gradient that backward_op would give it (scale, padding_idx,
// scale_grad_by_freq and the forward's dropout as there), without that gradient. No
// device->host sync. Up to kFewTokens tokens, the touched rows' sums and optimizer_update
// (no sort: fewer launches there); SparseAdam (sparse gradients only) is not taken.
template <class Launch>
void optimizer_backward_op(const at::Tensor& grad_out_in, const at::Tensor& ids_in, double scale,
                           std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                           const std::optional<at::Tensor>& dropout_key, double dropout_p, const at::Tensor& param,
                           const at::Tensor& state1, const at::Tensor& state2, int64_t rule,
                           c10::ArrayRef<double> hyper, bool all_rows) {
  check_update_from_dout(grad_out_in, ids_in, dropout_key, param, state1, state2, rule, hyper);
  const int64_t num_rows = param.size(0), dim = param.size(1), num_tokens = ids_in.numel();
  if (num_tokens <= kFewTokens) {
    const auto [rows, values] = touched_rows_op<Launch>(grad_out_in, ids_in, num_rows, scale, padding_idx,
                                                        scale_grad_by_freq, dropout_key, dropout_p);
    optimizer_update_op<Launch>(param, state1, state2, rows, values, rule, hyper, all_rows);
    return;
  }
  if (num_rows == 0 || dim == 0) return;
  const at::Tensor dout = dout_rows_of(grad_out_in, num_tokens, dim);
  at::Tensor key;  // the forward's dropout, applied to dout as the kernels read it (Dout)
  const Dropout dropout = dropout_of(dropout_key, dropout_p, key);
  const int rule32 = static_cast<int>(rule);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, param.scalar_type(), "pyembed_optimizer_backward_cuda", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    const SortedSegments seg = sorted_segments<Launch, T>(dout, ids_in, num_rows, padding_idx.value_or(-1),
                                                          /*by_row=*/true, /*with_solo=*/false, dropout);
    const auto h = optim::Scalars<A>::from(rule32, hyper.data());
    auto* p = param.data_ptr<T>();
    auto* s1 = state1.numel() ? state1.data_ptr<T>() : nullptr;
    auto* s2 = state2.numel() ? state2.data_ptr<T>() : nullptr;
    const int vec = vector_width<T>(dim, {p, s1, s2, dout.data_ptr()});
    const RowGrid g = row_grid(num_rows, dim, vec);
    with_dout<T>(dout, dropout, [&](auto dout_rows) {
      constexpr bool kDropout = decltype(dout_rows)::kMasked;
      with_dense_rule<T>(rule32, vec, [&](auto rule_constant, auto v) {
        Launch::run(g.grid, g.block, segment_update_kernel<T, A, decltype(rule_constant)::value, decltype(v)::value,
                                                           kDropout>,
                    dout_rows, seg.order, static_cast<const A*>(seg.partials), seg.begin, seg.end, p, s1, s2,
                    num_rows, dim, static_cast<A>(scale), scale_grad_by_freq, h, all_rows);
      });
    });
  });
}

}  // namespace pyembed::cuda
