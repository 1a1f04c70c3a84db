// CPU backend: the ops pyembed::embedding_forward / embedding_backward on CPU tensors.
//
// Forward: one pass per output row, out = f32(W[id]) * scale + f32(PE(p)), rounded once
// (kernels.h). Backward: the used (id, token) pairs are sorted by id, cut into segments
// of equal ids, and only those rows are summed (fp32) and written -- the rest of a dense
// gradient is the kernel's zero pages, never written (lazily_zeroed below).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "../autograd.h"
#include "../checks.h"
#include "kernel_api.h"

namespace pyembed {

// The widest build of the row kernels this CPU runs: AVX-512 (F/BW/VL/DQ, as ATen's
// AVX512 capability), else AVX2+FMA+F16C, else the portable one. PYEMBED_CPU_ISA=base or
// =avx2 caps the choice (the tests run every build this machine can).
const cpu::Kernels& cpu::row_kernels() {
  static const Kernels* chosen = [] {
    const char* forced = std::getenv("PYEMBED_CPU_ISA");
    const std::string cap = forced != nullptr ? forced : "";
    if (cap == "base") return &kernels_base();
#if defined(__x86_64__) && defined(__GNUC__)
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                      __builtin_cpu_supports("f16c");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (kernels_avx512() && avx512 && cap != "avx2") return kernels_avx512();
    if (kernels_avx2() && avx2) return kernels_avx2();
#endif
    return &kernels_base();
  }();
  return *chosen;
}

namespace {

using cpu::Segments;

at::Tensor embedding_forward_cpu(const at::Tensor& ids_in, const at::Tensor& weight_in,
                                 const std::optional<at::Tensor>& pos_weight_in,
                                 const std::optional<at::Tensor>& position_ids_in, std::string_view pos_encoding,
                                 double scale, int64_t offset, const std::optional<at::Tensor>& dropout_key,
                                 double dropout_p, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                                 int64_t /*error_record*/) {
  // On the CPU the ranges are checked before the op (synchronously: nothing to wait for),
  // so the in-kernel check's record is not used here.
  const ForwardInputs in = prepare_forward(ids_in, weight_in, pos_weight_in, position_ids_in, pos_encoding,
                                           dropout_key, dropout_p, sinusoid_column_offset, sinusoid_dim);
  if (in.empty()) return in.out;
  const at::Tensor &ids = in.ids, &weight = in.weight, &pos_weight = in.pos_weight, &position_ids = in.position_ids;
  at::Tensor out = in.out;

  cpu::ForwardArgs args{};
  args.ids = ids.data_ptr();
  args.id_type = ids.scalar_type();
  args.weight = weight.data_ptr();
  args.pos_weight = pos_weight.defined() ? pos_weight.data_ptr() : nullptr;
  args.position_ids = position_ids.defined() ? position_ids.data_ptr<int64_t>() : nullptr;
  args.dtype = weight.scalar_type();
  args.mode = in.mode;
  args.scale = scale;
  args.offset = offset;
  args.num_tokens = ids.numel();
  args.seq_len = ids.dim() > 0 ? ids.size(-1) : 1;
  args.num_embeddings = weight.size(0);
  args.num_positions = pos_weight.defined() ? pos_weight.size(0) : 0;
  args.dim = weight.size(1);
  args.sinusoid_column_offset = in.sinusoid_column_offset;
  args.sinusoid_dim = in.sinusoid_dim;
  args.dropout = in.dropout;
  args.out = out.data_ptr();
  cpu::row_kernels().forward(args);
  return out;
}

// Keys outside [0, num_rows) (out-of-range ids under validate=false) and `skip` (the
// padding row) are left out. Tokens are ordered by (key, token index), which fixes the
// summation order from the data alone: the backward is deterministic by construction.
template <typename key_t>
Segments build_segments(const key_t* keys, int64_t num_tokens, int64_t num_rows, int64_t skip) {
  auto used = [&](int64_t k) { return k >= 0 && k < num_rows && k != skip; };
  Segments seg;
  if (num_rows <= 16 * num_tokens + 65536) {
    // Counting sort, O(tokens + rows): ~10x faster than a comparison sort at GPT-2 sizes,
    // and stable (tokens are placed in increasing order within a key).
    std::vector<int64_t> start(num_rows + 1, 0);
    for (int64_t n = 0; n < num_tokens; ++n) {
      const int64_t k = static_cast<int64_t>(keys[n]);
      if (used(k)) ++start[k + 1];
    }
    for (int64_t k = 0; k < num_rows; ++k) {
      if (start[k + 1] > 0) seg.rows.push_back(k), seg.begin.push_back(start[k]);
      start[k + 1] += start[k];
    }
    seg.begin.push_back(start[num_rows]);
    seg.order.resize(start[num_rows]);
    for (int64_t n = 0; n < num_tokens; ++n) {
      const int64_t k = static_cast<int64_t>(keys[n]);
      if (used(k)) seg.order[start[k]++] = n;
    }
    return seg;
  }
  std::vector<std::pair<int64_t, int64_t>> pairs;
  pairs.reserve(num_tokens);
  for (int64_t n = 0; n < num_tokens; ++n) {
    const int64_t k = static_cast<int64_t>(keys[n]);
    if (used(k)) pairs.emplace_back(k, n);
  }
  std::sort(pairs.begin(), pairs.end());  // (key, token): tokens ascend within a key
  seg.order.reserve(pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    if (i == 0 || pairs[i].first != pairs[i - 1].first) {
      seg.rows.push_back(pairs[i].first);
      seg.begin.push_back(static_cast<int64_t>(i));
    }
    seg.order.push_back(pairs[i].second);
  }
  seg.begin.push_back(static_cast<int64_t>(pairs.size()));
  return seg;
}

Segments segments_of(const at::Tensor& keys, int64_t num_rows, int64_t skip) {
  Segments seg;
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_segments", [&] {
    seg = build_segments(keys.data_ptr<index_t>(), keys.numel(), num_rows, skip);
  });
  return seg;
}

// A zero (rows, dim) tensor whose untouched pages are never written: calloc of a large
// block maps the kernel's zero pages, so the rows the backward does not write cost it
// nothing. (at::zeros would write all V x d of a dense gradient.)
at::Tensor lazily_zeroed(int64_t rows, int64_t dim, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(rows * dim) * options.dtype().itemsize();
  if (bytes < (size_t(1) << 20)) return at::zeros({rows, dim}, options);
  void* data = std::calloc(bytes, 1);
  TORCH_CHECK(data != nullptr, "pyembed: could not allocate a ", rows, " x ", dim, " gradient");
  return at::from_blob(data, {rows, dim}, [](void* p) { std::free(p); }, options);
}

// Sums the dout rows of each segment (fp32), times scale (and 1/count), into out: row
// seg.rows[g] when dest_rows (a dense gradient), else row g (sparse values).
void sum_segments(const at::Tensor& dout, const Segments& seg, double scale, bool divide_by_count, bool dest_rows,
                  at::Tensor& out) {
  if (dout.size(-1) == 0) return;
  cpu::SegmentSumArgs sum{};
  sum.dout = dout.data_ptr();
  sum.dtype = dout.scalar_type();
  sum.dim = dout.size(-1);
  sum.segments = &seg;
  sum.scale = scale;
  sum.divide_by_count = divide_by_count;
  sum.dest_rows = dest_rows ? seg.rows.data() : nullptr;
  sum.out = out.data_ptr();
  cpu::row_kernels().segment_sum(sum);
}

std::tuple<at::Tensor, at::Tensor> embedding_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& ids_in, const std::optional<at::Tensor>& position_ids_in,
    int64_t offset, int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool need_weight_grad, bool need_pos_grad, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  check_same_device(grad_out_in.device(), {&ids_in, opt(position_ids_in), opt(dropout_key)});
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  // The forward's dropout: here a mask pass first (it costs little next to the sums); the
  // cuda kernels apply the mask as they read.
  const at::Tensor dout = dropout_key ? dropout_masked(grad_out_in, *dropout_key, dropout_p) : grad_out_in.contiguous();
  const at::Tensor ids = ids_in.contiguous();
  const auto options = dout.options();
  at::Tensor weight_grad = at::empty({0, dim}, options), pos_grad = at::empty({0, dim}, options);
  if (need_weight_grad) {
    weight_grad = lazily_zeroed(num_embeddings, dim, options);
    sum_segments(dout, segments_of(ids, num_embeddings, padding_idx.value_or(-1)), scale, scale_grad_by_freq,
                 /*dest_rows=*/true, weight_grad);
  }
  if (need_pos_grad) {
    pos_grad = at::zeros({num_positions, dim}, options);
    if (position_ids_in) {
      sum_segments(dout, segments_of(position_ids_in->contiguous(), num_positions, -1), 1.0, false,
                   /*dest_rows=*/true, pos_grad);
    } else if (num_tokens > 0 && dim > 0) {
      // p = offset + t: dP[offset + t] = the batch sum of dout[:, t], in batch order.
      const int64_t seq_len = ids.size(-1);
      cpu::BatchSumArgs batch_sum{dout.data_ptr(), dout.scalar_type(), num_tokens / seq_len, seq_len,
                                  std::clamp<int64_t>(num_positions - offset, 0, seq_len), offset, dim,
                                  pos_grad.data_ptr()};
      cpu::row_kernels().batch_sum(batch_sum);
    }
  }
  return {weight_grad, pos_grad};
}

std::tuple<at::Tensor, at::Tensor> embedding_sparse_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& ids_in, int64_t num_embeddings, double scale,
    std::optional<int64_t> padding_idx, bool scale_grad_by_freq, const std::optional<at::Tensor>& dropout_key,
    double dropout_p) {
  check_same_device(grad_out_in.device(), {&ids_in, opt(dropout_key)});
  const at::Tensor dout = dropout_key ? dropout_masked(grad_out_in, *dropout_key, dropout_p) : grad_out_in.contiguous();
  const auto options = dout.options();
  const Segments seg = segments_of(ids_in.contiguous(), num_embeddings, padding_idx.value_or(-1));
  at::Tensor rows = at::tensor(seg.rows, options.dtype(at::kLong));
  at::Tensor values = at::empty({seg.size(), dout.size(-1)}, options);
  sum_segments(dout, seg, scale, scale_grad_by_freq, /*dest_rows=*/false, values);
  return {rows, values};
}

void optimizer_update_cpu(const at::Tensor& param, const at::Tensor& state1, const at::Tensor& state2,
                          const at::Tensor& rows_in, const at::Tensor& values_in, int64_t rule,
                          c10::ArrayRef<double> hyper, bool all_rows) {
  check_optimizer_update(param, state1, state2, rows_in, values_in, rule, hyper);
  const at::Tensor rows = rows_in.contiguous(), values = values_in.contiguous();
  const int64_t* r = rows.data_ptr<int64_t>();
  for (int64_t k = 0; k < rows.numel(); ++k) {  // the kernel's walk relies on it
    TORCH_CHECK_INDEX(r[k] >= 0 && r[k] < param.size(0) && (k == 0 || r[k] > r[k - 1]),
                      "pyembed: optimizer rows must be ascending, unique and in [0, ", param.size(0), ")");
  }
  cpu::OptimizerArgs a{};
  a.param = param.data_ptr();
  a.state1 = state1.numel() ? state1.data_ptr() : nullptr;
  a.state2 = state2.numel() ? state2.data_ptr() : nullptr;
  a.rows = r;
  a.values = values.data_ptr();
  a.dtype = param.scalar_type();
  a.num_rows = param.size(0), a.touched = rows.numel(), a.dim = param.size(1);
  a.rule = static_cast<int>(rule);
  a.hyper = hyper.data();
  a.all_rows = all_rows;
  if (a.dim > 0) cpu::row_kernels().optimizer_update(a);
}

}  // namespace

TORCH_LIBRARY_IMPL(pyembed, CPU, m) {
  m.impl("optimizer_update", &optimizer_update_cpu);
  m.impl("embedding_touched_rows", &embedding_sparse_backward_cpu);  // exact on the CPU: no sync to avoid
  m.impl("embedding_forward", &embedding_forward_cpu);
  m.impl("embedding_backward", &embedding_backward_cpu);
  m.impl("embedding_sparse_backward", &embedding_sparse_backward_cpu);
}

}  // namespace pyembed
