// CPU backend: the fused forward and the touched-rows backward (DESIGN §1).
//
// Forward: one pass per output row, out = f32(W[id]) * scale + f32(PE(p)), rounded once.
// With p = offset + t, the positional row of step t serves every sequence of the batch,
// so the loop runs over t outside and b inside: a learned row stays in L1 and a
// sinusoid is computed once per (t, d) -- never read from a table.
//
// Backward: the used (id, token) pairs are sorted by id (stable, so the summation order
// depends on nothing but the ids), cut into segments of equal ids, and each segment is
// summed in fp32 in token order. A segment longer than kPartTokens (a hot row: BOS,
// padding) is split into fixed parts summed in parallel, then the parts are added in
// order: the result is bitwise identical for any thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <vector>

#include "../checks.h"

namespace pyembed {
namespace {

using at::vec::Vectorized;

template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>;

// A run of Vectorized<T>::size() row elements held in the compute dtype A: one vector
// for float/double, two float vectors for half/bf16 (one Vectorized<Half> widens to two).
template <typename T>
struct Chunk {
  using A = acc_type<T>;
  using VA = Vectorized<A>;
  static constexpr int64_t kSize = Vectorized<T>::size();
  static constexpr int kParts = kReduced<T> ? 2 : 1;
  VA v[kParts];

  static Chunk zero() { return Chunk{}; }
  static Chunk load(const T* p) {
    Chunk c;
    if constexpr (kReduced<T>) {
      auto [lo, hi] = at::vec::convert_to_float<T>(Vectorized<T>::loadu(p));
      c.v[0] = lo, c.v[1] = hi;
    } else {
      c.v[0] = VA::loadu(p);
    }
    return c;
  }
  // Load from an accumulator row (already in A).
  static Chunk load_acc(const A* p) {
    Chunk c;
    for (int i = 0; i < kParts; ++i) c.v[i] = VA::loadu(p + i * VA::size());
    return c;
  }
  void store(T* p) const {
    if constexpr (kReduced<T>) {
      at::vec::convert_from_float<T>(v[0], v[1]).store(p);
    } else {
      v[0].store(p);
    }
  }
  void store_acc(A* p) const {
    for (int i = 0; i < kParts; ++i) v[i].store(p + i * VA::size());
  }
  Chunk& operator+=(const Chunk& o) {
    for (int i = 0; i < kParts; ++i) v[i] = v[i] + o.v[i];
    return *this;
  }
  Chunk operator*(VA s) const {
    Chunk c;
    for (int i = 0; i < kParts; ++i) c.v[i] = v[i] * s;
    return c;
  }
};

// out = W_row * scale + pe, rounded once. w_row == nullptr: a zero row (an out-of-range
// id with validate=false). Exactly one of pe_row (learned, T) / pe_acc (sinusoid, A) or
// neither is given.
template <typename T>
void forward_row(T* out, const T* w_row, acc_type<T> scale, const T* pe_row, const acc_type<T>* pe_acc,
                 int64_t dim) {
  using A = acc_type<T>;
  using C = Chunk<T>;
  const Vectorized<A> vscale(scale);
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) {
    C c = w_row ? C::load(w_row + j) * vscale : C::zero();
    if (pe_row) c += C::load(pe_row + j);
    if (pe_acc) c += C::load_acc(pe_acc + j);
    c.store(out + j);
  }
  for (; j < dim; ++j) {  // scalar tail: d not a multiple of the vector width
    A x = w_row ? static_cast<A>(w_row[j]) * scale : A(0);
    if (pe_row) x += static_cast<A>(pe_row[j]);
    if (pe_acc) x += pe_acc[j];
    out[j] = static_cast<T>(x);
  }
}

// acc += src (src in T or already in A).
template <typename T, typename S>
void accumulate_row(acc_type<T>* acc, const S* src, int64_t dim) {
  using C = Chunk<S>;
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) {
    (C::load_acc(acc + j) += C::load(src + j)).store_acc(acc + j);
  }
  for (; j < dim; ++j) acc[j] += static_cast<acc_type<T>>(src[j]);
}

// out = round(acc * factor): the single rounding of a gradient row.
template <typename T>
void finalize_row(T* out, const acc_type<T>* acc, acc_type<T> factor, int64_t dim) {
  using C = Chunk<T>;
  const Vectorized<acc_type<T>> vfactor(factor);
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) (C::load_acc(acc + j) * vfactor).store(out + j);
  for (; j < dim; ++j) out[j] = static_cast<T>(acc[j] * factor);
}

// PE(p, 2i) = sin(p w_i), PE(p, 2i+1) = cos(p w_i), in the compute dtype.
template <typename A>
std::vector<A> sinusoid_frequencies(int64_t dim) {
  std::vector<A> w(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) w[i] = std::exp(-static_cast<A>(2 * i) * (std::log(A(10000)) / dim));
  return w;
}

template <typename A>
void sinusoid_row(A* out, int64_t position, const std::vector<A>& freqs) {
  const A p = static_cast<A>(position);
  for (size_t i = 0; i < freqs.size(); ++i) {
    const A angle = p * freqs[i];
    out[2 * i] = std::sin(angle);
    out[2 * i + 1] = std::cos(angle);
  }
}

// At least ~64 KiB of row traffic per task, so thread wake-ups stay negligible.
int64_t grain_for(int64_t row_bytes) { return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1)); }

template <typename T, typename index_t>
void forward_impl(const at::Tensor& ids, const at::Tensor& weight, const std::optional<at::Tensor>& pos_weight,
                  const std::optional<at::Tensor>& position_ids, PosEncoding mode, double scale_d, int64_t offset,
                  at::Tensor& out) {
  using A = acc_type<T>;
  const index_t* id_ptr = ids.data_ptr<index_t>();
  const T* w = weight.data_ptr<T>();
  T* o = out.data_ptr<T>();
  const int64_t num_tokens = ids.numel(), num_embeddings = weight.size(0), dim = weight.size(1);
  const A scale = static_cast<A>(scale_d);
  const T* pw = mode == PosEncoding::kLearned ? pos_weight->data_ptr<T>() : nullptr;
  const int64_t num_positions = pw ? pos_weight->size(0) : 0;
  const int64_t* pid = position_ids ? position_ids->data_ptr<int64_t>() : nullptr;
  const auto freqs = mode == PosEncoding::kSinusoidal ? sinusoid_frequencies<A>(dim) : std::vector<A>{};

  auto token_row = [&](int64_t token) -> const T* {
    const int64_t id = static_cast<int64_t>(id_ptr[token]);
    return (id >= 0 && id < num_embeddings) ? w + id * dim : nullptr;
  };
  // The positional term of position p: (learned row or nullptr, sinusoid buffer or nullptr).
  auto positional = [&](int64_t p, std::vector<A>& buf) -> std::pair<const T*, const A*> {
    if (mode == PosEncoding::kLearned) return {(p >= 0 && p < num_positions) ? pw + p * dim : nullptr, nullptr};
    if (mode == PosEncoding::kSinusoidal) {
      sinusoid_row(buf.data(), p, freqs);
      return {nullptr, buf.data()};
    }
    return {nullptr, nullptr};
  };

  if (mode != PosEncoding::kNone && pid == nullptr) {
    // p = offset + t: one positional row per step t, shared by the whole batch.
    const int64_t seq_len = ids.size(-1), batch = num_tokens / seq_len;
    at::parallel_for(0, seq_len, grain_for(batch * dim * sizeof(T)), [&](int64_t t0, int64_t t1) {
      std::vector<A> buf(mode == PosEncoding::kSinusoidal ? dim : 0);
      for (int64_t t = t0; t < t1; ++t) {
        auto [pe_row, pe_acc] = positional(offset + t, buf);
        for (int64_t b = 0; b < batch; ++b) {
          const int64_t token = b * seq_len + t;
          forward_row<T>(o + token * dim, token_row(token), scale, pe_row, pe_acc, dim);
        }
      }
    });
  } else {
    at::parallel_for(0, num_tokens, grain_for(dim * sizeof(T)), [&](int64_t n0, int64_t n1) {
      std::vector<A> buf(mode == PosEncoding::kSinusoidal ? dim : 0);
      for (int64_t token = n0; token < n1; ++token) {
        auto [pe_row, pe_acc] = pid ? positional(pid[token], buf) : std::pair<const T*, const A*>{nullptr, nullptr};
        forward_row<T>(o + token * dim, token_row(token), scale, pe_row, pe_acc, dim);
      }
    });
  }
}

at::Tensor embedding_forward_cpu(const at::Tensor& ids_in, const at::Tensor& weight_in,
                                 const std::optional<at::Tensor>& pos_weight_in,
                                 const std::optional<at::Tensor>& position_ids_in, std::string_view pos_encoding,
                                 double scale, int64_t offset, bool validate) {
  const PosEncoding mode = parse_pos_encoding(std::string(pos_encoding));
  check_forward_args(ids_in, weight_in, pos_weight_in, position_ids_in, mode);
  const int64_t num_positions = pos_weight_in ? pos_weight_in->size(0) : 0;
  if (validate) validate_forward(ids_in, weight_in.size(0), position_ids_in, mode, num_positions);

  const at::Tensor ids = ids_in.contiguous(), weight = weight_in.contiguous();
  std::optional<at::Tensor> pos_weight, position_ids;
  if (mode == PosEncoding::kLearned) pos_weight = pos_weight_in->contiguous();
  if (mode != PosEncoding::kNone && position_ids_in) position_ids = position_ids_in->to(at::kLong).contiguous();

  auto out_sizes = ids.sizes().vec();
  out_sizes.push_back(weight.size(1));
  at::Tensor out = at::empty(out_sizes, weight.options());
  if (ids.numel() == 0 || weight.size(1) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "pyembed_forward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "pyembed_forward_cpu", [&] {
      forward_impl<scalar_t, index_t>(ids, weight, pos_weight, position_ids, mode, scale, offset, out);
    });
  });
  return out;
}

// ------------------------------------------------------------------------- backward
constexpr int64_t kPartTokens = 256;  // longest run summed by one task

// Tokens grouped by key: segment s holds order[begin[s] .. begin[s+1]) (token indices in
// increasing order), all with key rows[s]; rows is sorted ascending.
struct Segments {
  std::vector<int64_t> rows, begin, order;
  int64_t size() const { return static_cast<int64_t>(rows.size()); }
  int64_t count(int64_t s) const { return begin[s + 1] - begin[s]; }
};

// Keys outside [0, num_rows) and the skip key (padding) are left out.
template <typename key_t>
Segments build_segments(const key_t* keys, int64_t num_tokens, int64_t num_rows, int64_t skip) {
  std::vector<std::pair<int64_t, int64_t>> pairs;  // (key, token): sorting orders tokens within a key
  pairs.reserve(num_tokens);
  for (int64_t n = 0; n < num_tokens; ++n) {
    const int64_t k = static_cast<int64_t>(keys[n]);
    if (k >= 0 && k < num_rows && k != skip) pairs.emplace_back(k, n);
  }
  std::sort(pairs.begin(), pairs.end());
  Segments seg;
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

// dest(s)[:] = round(factor(s) * sum_{n in segment s} dout[n, :]), fp32 (fp64) accumulation.
template <typename T, typename Dest>
void reduce_segments(const Segments& seg, const T* dout, int64_t dim, double scale, bool by_freq, Dest dest) {
  using A = acc_type<T>;
  // scale and 1/count applied once per row, after the sum (as the reference does).
  auto factor = [&](int64_t s) {
    return by_freq ? static_cast<A>(scale) / static_cast<A>(seg.count(s)) : static_cast<A>(scale);
  };
  // Parts: (segment, first sorted position). Long segments get several parts, each with
  // a scratch row; single-part segments are finalised directly.
  std::vector<int64_t> part_seg, part_start, scratch_slot;
  std::vector<int64_t> long_segments, first_slot;
  int64_t slots = 0;
  for (int64_t s = 0; s < seg.size(); ++s) {
    const bool is_long = seg.count(s) > kPartTokens;
    if (is_long) long_segments.push_back(s), first_slot.push_back(slots);
    for (int64_t i = seg.begin[s]; i < seg.begin[s + 1]; i += kPartTokens) {
      part_seg.push_back(s), part_start.push_back(i), scratch_slot.push_back(is_long ? slots++ : -1);
    }
  }
  std::vector<A> scratch(static_cast<size_t>(slots * dim));
  const int64_t num_parts = static_cast<int64_t>(part_seg.size());
  at::parallel_for(0, num_parts, grain_for(kPartTokens * dim * sizeof(T) / 16), [&](int64_t p0, int64_t p1) {
    std::vector<A> acc(dim);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = part_seg[p], end = std::min(part_start[p] + kPartTokens, seg.begin[s + 1]);
      A* sum = scratch_slot[p] >= 0 ? scratch.data() + scratch_slot[p] * dim : acc.data();
      std::fill(sum, sum + dim, A(0));
      for (int64_t i = part_start[p]; i < end; ++i) accumulate_row<T>(sum, dout + seg.order[i] * dim, dim);
      if (scratch_slot[p] < 0) finalize_row<T>(dest(s), sum, factor(s), dim);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(long_segments.size()), 1, [&](int64_t l0, int64_t l1) {
    std::vector<A> acc(dim);
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t s = long_segments[l];
      const int64_t parts = (seg.count(s) + kPartTokens - 1) / kPartTokens;
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t k = 0; k < parts; ++k) accumulate_row<T>(acc.data(), scratch.data() + (first_slot[l] + k) * dim, dim);
      finalize_row<T>(dest(s), acc.data(), factor(s), dim);
    }
  });
}

// A (rows, dim) zero tensor whose untouched pages are never written: calloc of a large
// block maps the kernel's zero pages, so rows the backward does not write cost nothing
// here. (at::zeros would write every byte of a V x d gradient.)
at::Tensor lazily_zeroed(int64_t rows, int64_t dim, const at::TensorOptions& options) {
  const size_t bytes = static_cast<size_t>(rows * dim) * options.dtype().itemsize();
  if (bytes < (size_t(1) << 20)) return at::zeros({rows, dim}, options);
  void* data = std::calloc(bytes, 1);
  TORCH_CHECK(data != nullptr, "pyembed: could not allocate a ", rows, " x ", dim, " gradient");
  return at::from_blob(data, {rows, dim}, [](void* p) { std::free(p); }, options);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> embedding_backward_cpu(
    const at::Tensor& grad_out_in, const at::Tensor& ids_in, const std::optional<at::Tensor>& position_ids_in,
    int64_t offset, int64_t num_embeddings, int64_t num_positions, double scale, std::optional<int64_t> padding_idx,
    bool scale_grad_by_freq, bool sparse, bool need_weight_grad, bool need_pos_grad) {
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  const at::Tensor dout = grad_out_in.contiguous(), ids = ids_in.contiguous();
  const auto options = dout.options();
  at::Tensor weight_rows = at::empty({0}, options.dtype(at::kLong));
  at::Tensor weight_values = at::empty({0, dim}, options), pos_grad = at::empty({0, dim}, options);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dout.scalar_type(), "pyembed_backward_cpu", [&] {
    using T = scalar_t;
    const T* g = dout.data_ptr<T>();
    T* out = nullptr;
    if (need_weight_grad) {
      Segments seg;
      AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "pyembed_backward_cpu", [&] {
        seg = build_segments(ids.data_ptr<index_t>(), num_tokens, num_embeddings, padding_idx.value_or(-1));
      });
      if (sparse) {
        weight_rows = at::tensor(seg.rows, options.dtype(at::kLong));
        weight_values = at::empty({seg.size(), dim}, options);
        out = weight_values.data_ptr<T>();
        reduce_segments<T>(seg, g, dim, scale, scale_grad_by_freq, [&](int64_t s) { return out + s * dim; });
      } else {
        weight_values = lazily_zeroed(num_embeddings, dim, options);
        out = weight_values.data_ptr<T>();
        reduce_segments<T>(seg, g, dim, scale, scale_grad_by_freq, [&](int64_t s) { return out + seg.rows[s] * dim; });
      }
    }
    if (need_pos_grad) {
      pos_grad = at::zeros({num_positions, dim}, options);
      T* pg = pos_grad.data_ptr<T>();
      if (position_ids_in) {
        const at::Tensor positions = position_ids_in->to(at::kLong).contiguous();
        Segments seg = build_segments(positions.data_ptr<int64_t>(), num_tokens, num_positions, -1);
        reduce_segments<T>(seg, g, dim, 1.0, false, [&](int64_t s) { return pg + seg.rows[s] * dim; });
      } else if (num_tokens > 0) {
        // p = offset + t: dP[offset + t] = sum over the batch, in batch order.
        const int64_t seq_len = ids.size(-1), batch = num_tokens / seq_len;
        const int64_t steps = std::clamp<int64_t>(num_positions - offset, 0, seq_len);
        at::parallel_for(0, steps, grain_for(batch * dim * sizeof(T)), [&](int64_t t0, int64_t t1) {
          std::vector<acc_type<T>> acc(dim);
          for (int64_t t = t0; t < t1; ++t) {
            std::fill(acc.begin(), acc.end(), acc_type<T>(0));
            for (int64_t b = 0; b < batch; ++b) accumulate_row<T>(acc.data(), g + (b * seq_len + t) * dim, dim);
            finalize_row<T>(pg + (offset + t) * dim, acc.data(), 1, dim);
          }
        });
      }
    }
  });
  return {weight_rows, weight_values, pos_grad};
}

}  // namespace

TORCH_LIBRARY_IMPL(pyembed, CPU, m) {
  m.impl("embedding_forward", &embedding_forward_cpu);
  m.impl("embedding_backward", &embedding_backward_cpu);
}

}  // namespace pyembed
