// CPU row kernels, compiled once per instruction set (PYEMBED_ISA: base, avx2, avx512).
//
// Every kernel works row by row in the compute dtype (float32; float64 for float64
// tables) with at::vec, and rounds once when it stores. Work is split with
// at::parallel_for over rows or segments, never over the elements of one sum, so every
// result is bitwise identical whatever the thread count.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/bit_cast.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../optim.h"
#include "kernel_api.h"

#ifndef PYEMBED_ISA
#error "define PYEMBED_ISA (the namespace of this instruction set) before including kernels.h"
#endif

namespace pyembed::cpu::PYEMBED_ISA {
namespace {

using at::vec::Vectorized;

template <typename T>
constexpr bool kReduced = std::is_same_v<T, at::Half> || std::is_same_v<T, at::BFloat16>;

template <typename T>
using acc_t = acc_type<T>;

constexpr int64_t kPartTokens = 256;  // the longest run of one segment summed by one task

// At least ~64 KiB of row traffic per task, so waking a thread pays for itself.
int64_t grain_for(int64_t bytes_per_item) {
  return std::max<int64_t>(1, (int64_t(64) << 10) / std::max<int64_t>(bytes_per_item, 1));
}

// Vectorized<T>::size() elements of a row held in the compute dtype A: one vector for
// float/double, two float vectors for half/bf16 (one Vectorized<Half> widens to two).
template <typename T>
struct Chunk {
  using A = acc_t<T>;
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
  static Chunk load_acc(const A* p) {  // from an accumulator row, already in A
    Chunk c;
    for (int i = 0; i < kParts; ++i) c.v[i] = VA::loadu(p + i * VA::size());
    return c;
  }
  void store(T* p) const {  // the one rounding into T
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
  // this * s where mask is all-ones bits, 0 where it is 0 (a select, not a product with 0:
  // a dropped inf stays 0, as in the reference's torch.where)
  Chunk kept(const Chunk& mask, VA s) const {
    Chunk c;
    for (int i = 0; i < kParts; ++i) c.v[i] = VA::blendv(VA(0), v[i] * s, mask.v[i]);
    return c;
  }
};

// One token's dropout mask as select masks in A: all-ones bits where the element is kept.
template <typename A>
void dropout_mask_row(A* mask, const Dropout& d, int64_t token, int64_t dim) {
  using Bits = at::vec::int_same_size_t<A>;
  const A on = c10::bit_cast<A>(~Bits(0));
  const uint64_t seed = static_cast<uint64_t>(d.key[0]), offset = static_cast<uint64_t>(d.key[1]);
  for (int64_t group = 0; 4 * group < dim; ++group) {
    const unsigned bits = dropout_keep_bits(seed, offset, token, group, d.threshold);
    for (int64_t i = 0; i < 4 && 4 * group + i < dim; ++i) mask[4 * group + i] = (bits >> i) & 1u ? on : A(0);
  }
}

template <typename A>
bool is_kept(A mask) {
  return c10::bit_cast<at::vec::int_same_size_t<A>>(mask) != 0;
}

// out = round(W_row * scale + pe), times keep / (1 - p) with dropout. At most one of
// pe_row (learned, in T) / pe_acc (sinusoid, in A). w_row == nullptr (an out-of-range id
// under validate=false): the whole row is zero, positional term included (what lets
// vocab-parallel ranks sum). drop_mask: dropout_mask_row's masks, or nullptr.
template <typename T>
void forward_row(T* out, const T* w_row, acc_t<T> scale, const T* pe_row, const acc_t<T>* pe_acc,
                 const acc_t<T>* drop_mask, acc_t<T> drop_scale, int64_t dim) {
  using A = acc_t<T>;
  using C = Chunk<T>;
  if (w_row == nullptr) {
    std::fill(out, out + dim, T(0));
    return;
  }
  const Vectorized<A> vscale(scale), vdrop(drop_scale);
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) {
    C c = C::load(w_row + j) * vscale;
    if (pe_row) c += C::load(pe_row + j);
    if (pe_acc) c += C::load_acc(pe_acc + j);
    if (drop_mask) c = c.kept(C::load_acc(drop_mask + j), vdrop);
    c.store(out + j);
  }
  for (; j < dim; ++j) {  // scalar tail: d not a multiple of the vector width
    A x = static_cast<A>(w_row[j]) * scale;
    if (pe_row) x += static_cast<A>(pe_row[j]);
    if (pe_acc) x += pe_acc[j];
    if (drop_mask) x = is_kept(drop_mask[j]) ? x * drop_scale : A(0);
    out[j] = static_cast<T>(x);
  }
}

// acc = src (in A): the first row of a sum, so no accumulator is zeroed first.
template <typename T>
void load_row(acc_t<T>* acc, const T* src, int64_t dim) {
  using C = Chunk<T>;
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) C::load(src + j).store_acc(acc + j);
  for (; j < dim; ++j) acc[j] = static_cast<acc_t<T>>(src[j]);
}

// acc += src, where src is a row in T (a gradient) or in A (a partial sum).
template <typename S>
void accumulate_row(acc_t<S>* acc, const S* src, int64_t dim) {
  using C = Chunk<S>;
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) (C::load_acc(acc + j) += C::load(src + j)).store_acc(acc + j);
  for (; j < dim; ++j) acc[j] += static_cast<acc_t<S>>(src[j]);
}

// out = round(acc * factor): the single rounding of a gradient row.
template <typename T>
void finalize_row(T* out, const acc_t<T>* acc, acc_t<T> factor, int64_t dim) {
  using C = Chunk<T>;
  const Vectorized<acc_t<T>> vfactor(factor);
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) (C::load_acc(acc + j) * vfactor).store(out + j);
  for (; j < dim; ++j) out[j] = static_cast<T>(acc[j] * factor);
}

// w_i = exp(-(2i) ln(10000) / d_total) for the pairs i of columns [first, first + dim)
// (first even: the whole table, or a column shard of it), in the compute dtype.
template <typename A>
std::vector<A> sinusoid_frequencies(int64_t dim, int64_t first, int64_t total_dim) {
  std::vector<A> w(dim / 2);
  for (int64_t i = 0; i < dim / 2; ++i) {
    w[i] = std::exp(-static_cast<A>(first + 2 * i) * (std::log(A(10000)) / total_dim));
  }
  return w;
}

// out[2i] = sin(p w_i), out[2i+1] = cos(p w_i): the angle is rounded to A, as on the GPU.
template <typename A>
void sinusoid_row(A* out, int64_t position, const std::vector<A>& freqs) {
  const A p = static_cast<A>(position);
  size_t i = 0;
#if defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    // 8 (16) pairs at a time: Sleef's sincos (1 ulp at any angle; std::sin per element made
    // a sinusoid forward ~2x slower than a table lookup), then interleaved into (sin, cos).
    using V = Vectorized<float>;
    for (; i + V::size() <= freqs.size(); i += V::size()) {
      const V angle = V::loadu(freqs.data() + i) * V(p);  // the same one rounding as below
#if defined(CPU_CAPABILITY_AVX512)
      // Sleef's 256-bit sincos on each half: its 512-bit one (Sleef_sincosf16_u10) measured
      // 3.5x slower per element on this project's AVX-512 machine (AMD EPYC, torch 2.14).
      const __m512 a = angle;
      const Sleef___m256_2 low_half = Sleef_sincosf8_u10(_mm512_castps512_ps256(a));
      const Sleef___m256_2 high_half = Sleef_sincosf8_u10(_mm512_extractf32x8_ps(a, 1));
      const V sin(_mm512_insertf32x8(_mm512_castps256_ps512(low_half.x), high_half.x, 1));
      const V cos(_mm512_insertf32x8(_mm512_castps256_ps512(low_half.y), high_half.y, 1));
#else
      const Sleef___m256_2 sin_cos = Sleef_sincosf8_u10(angle);
      const V sin(sin_cos.x), cos(sin_cos.y);
#endif
      const auto [low, high] = at::vec::interleave2(sin, cos);
      low.store(out + 2 * i);
      high.store(out + 2 * i + V::size());
    }
  }
#endif
  for (; i < freqs.size(); ++i) {
    const A angle = p * freqs[i];
    out[2 * i] = std::sin(angle);
    out[2 * i + 1] = std::cos(angle);
  }
}

template <typename T, typename index_t>
void forward_typed(const ForwardArgs& a) {
  using A = acc_t<T>;
  const auto* ids = static_cast<const index_t*>(a.ids);
  const auto* weight = static_cast<const T*>(a.weight);
  const auto* pos_weight = static_cast<const T*>(a.pos_weight);
  auto* out = static_cast<T*>(a.out);
  const int64_t dim = a.dim;
  const A scale = static_cast<A>(a.scale);  // sqrt(d) in float64, applied as float32
  const auto freqs = a.mode == PosEncoding::kSinusoidal
                         ? sinusoid_frequencies<A>(dim, a.sinusoid_column_offset, a.sinusoid_dim)
                         : std::vector<A>{};

  auto token_row = [&](int64_t token) -> const T* {
    const int64_t id = static_cast<int64_t>(ids[token]);
    return (id >= 0 && id < a.num_embeddings) ? weight + id * dim : nullptr;
  };
  // The positional term of position p: (learned row or nullptr, sinusoid row or nullptr).
  auto positional = [&](int64_t p, std::vector<A>& buf) -> std::pair<const T*, const A*> {
    if (a.mode == PosEncoding::kLearned) return {(p >= 0 && p < a.num_positions) ? pos_weight + p * dim : nullptr, nullptr};
    if (a.mode == PosEncoding::kSinusoidal) {
      sinusoid_row(buf.data(), p, freqs);
      return {nullptr, buf.data()};
    }
    return {nullptr, nullptr};
  };
  const A drop_scale = static_cast<A>(a.dropout.scale);
  // One row's dropout masks, computed into a task-local buffer just before the row.
  auto row = [&](int64_t token, const T* w_row, const T* pe_row, const A* pe_acc, std::vector<A>& mask) {
    if (a.dropout.active()) dropout_mask_row(mask.data(), a.dropout, token, dim);
    forward_row<T>(out + token * dim, w_row, scale, pe_row, pe_acc, a.dropout.active() ? mask.data() : nullptr,
                   drop_scale, dim);
  };
  // Half / bf16: the table rows of up to kGroup tokens are copied into a task-local buffer
  // before any arithmetic. A plain copy keeps many cache misses in flight (as index_select
  // does), where the convert / scale / add / convert work behind each load of a cold row
  // kept few. A/B on GPT-2 8x512 with each variant on its own (cold) table copy, turns
  // shuffled: bf16 1.22-1.38x eager with staging, 0.82-0.92x without; fp16 ~1.0x either way;
  // prefetching the next group's rows or staging 16/32 rows at once changed nothing (+-3%).
  // float32 rows, with little work per byte, lost 10-20% to the extra copy, so they are read
  // in place. rows[i]: the row to read, nullptr for an out-of-range id.
  constexpr bool kStage = kReduced<T>;
  constexpr int64_t kGroup = 8;
  struct Scratch {
    std::vector<A> sinusoid, mask;
    std::vector<T> staged;  // kGroup rows when kStage
    int64_t tokens[kGroup];
    const T* rows[kGroup];
  };
  auto scratch = [&] {
    return Scratch{std::vector<A>(a.mode == PosEncoding::kSinusoidal ? dim : 0),
                   std::vector<A>(a.dropout.active() ? dim : 0),
                   std::vector<T>(kStage ? kGroup * dim : 0), {}, {}};
  };
  auto stage = [&](Scratch& s, int64_t count) {
    for (int64_t i = 0; i < count; ++i) {
      const T* src = token_row(s.tokens[i]);
      s.rows[i] = src;
      if (kStage && src != nullptr) {
        s.rows[i] = s.staged.data() + i * dim;
        std::memcpy(s.staged.data() + i * dim, src, dim * sizeof(T));
      }
    }
  };

  if (a.mode != PosEncoding::kNone && a.position_ids == nullptr) {
    // p = offset + t: step t's positional row serves the whole batch, so t is the outer
    // loop -- a learned row stays in L1 and a sinusoid is computed once per step.
    const int64_t batch = a.num_tokens / a.seq_len;
    at::parallel_for(0, a.seq_len, grain_for(batch * dim * sizeof(T)), [&](int64_t t0, int64_t t1) {
      Scratch s = scratch();
      for (int64_t t = t0; t < t1; ++t) {
        auto [pe_row, pe_acc] = positional(a.offset + t, s.sinusoid);
        for (int64_t b0 = 0; b0 < batch; b0 += kGroup) {
          const int64_t count = std::min(kGroup, batch - b0);
          for (int64_t i = 0; i < count; ++i) s.tokens[i] = (b0 + i) * a.seq_len + t;
          stage(s, count);
          for (int64_t i = 0; i < count; ++i) row(s.tokens[i], s.rows[i], pe_row, pe_acc, s.mask);
        }
      }
    });
    return;
  }
  at::parallel_for(0, a.num_tokens, grain_for(dim * sizeof(T)), [&](int64_t n0, int64_t n1) {
    Scratch s = scratch();
    for (int64_t n = n0; n < n1; n += kGroup) {
      const int64_t count = std::min(kGroup, n1 - n);
      for (int64_t i = 0; i < count; ++i) s.tokens[i] = n + i;
      stage(s, count);
      for (int64_t i = 0; i < count; ++i) {
        std::pair<const T*, const A*> pe{nullptr, nullptr};
        if (a.mode != PosEncoding::kNone) pe = positional(a.position_ids[s.tokens[i]], s.sinusoid);
        row(s.tokens[i], s.rows[i], pe.first, pe.second, s.mask);
      }
    }
  });
}

template <typename T>
void segment_sum_typed(const SegmentSumArgs& a) {
  using A = acc_t<T>;
  const Segments& seg = *a.segments;
  const auto* dout = static_cast<const T*>(a.dout);
  auto* out = static_cast<T*>(a.out);
  const int64_t dim = a.dim;
  auto dest = [&](int64_t s) { return out + (a.dest_rows ? a.dest_rows[s] : s) * dim; };
  auto factor = [&](int64_t s) {  // scale (and 1/count) once per row, after the sum
    const A scale = static_cast<A>(a.scale);
    return a.divide_by_count ? scale / static_cast<A>(seg.count(s)) : scale;
  };

  // Parts of at most kPartTokens tokens. A segment of one part is summed and finalised by
  // one task; a longer one (a hot row) sums each part into its own scratch row, and the
  // parts are added in order afterwards. Scratch: (tokens / kPartTokens) x d at most.
  std::vector<int64_t> part_segment, part_start, part_slot, long_segments, long_first_slot;
  int64_t slots = 0;
  for (int64_t s = 0; s < seg.size(); ++s) {
    const bool is_long = seg.count(s) > kPartTokens;
    if (is_long) long_segments.push_back(s), long_first_slot.push_back(slots);
    for (int64_t i = seg.begin[s]; i < seg.begin[s + 1]; i += kPartTokens) {
      part_segment.push_back(s), part_start.push_back(i), part_slot.push_back(is_long ? slots++ : -1);
    }
  }
  std::vector<A> scratch(static_cast<size_t>(slots * dim));
  const int64_t num_parts = static_cast<int64_t>(part_segment.size());
  // grain: a part is 1..kPartTokens rows; aim for tasks of a few rows at least.
  at::parallel_for(0, num_parts, grain_for(4 * dim * sizeof(T)), [&](int64_t p0, int64_t p1) {
    std::vector<A> acc(dim);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t s = part_segment[p], first = part_start[p];
      const int64_t end = std::min(first + kPartTokens, seg.begin[s + 1]);
      const T* first_row = dout + seg.order[first] * dim;
      if (end - first == 1 && part_slot[p] < 0) {
        // A row used once -- most rows of a large vocabulary: round(f32(dout) * factor)
        // straight out, the same single rounding with no accumulator to zero and fill.
        forward_row<T>(dest(s), first_row, factor(s), nullptr, nullptr, nullptr, A(1), dim);
        continue;
      }
      A* sum = part_slot[p] >= 0 ? scratch.data() + part_slot[p] * dim : acc.data();
      load_row<T>(sum, first_row, dim);
      for (int64_t i = first + 1; i < end; ++i) accumulate_row<T>(sum, dout + seg.order[i] * dim, dim);
      if (part_slot[p] < 0) finalize_row<T>(dest(s), sum, factor(s), dim);
    }
  });
  at::parallel_for(0, static_cast<int64_t>(long_segments.size()), 1, [&](int64_t l0, int64_t l1) {
    std::vector<A> acc(dim);
    for (int64_t l = l0; l < l1; ++l) {
      const int64_t s = long_segments[l], parts = (seg.count(s) + kPartTokens - 1) / kPartTokens;
      std::fill(acc.begin(), acc.end(), A(0));
      for (int64_t k = 0; k < parts; ++k) accumulate_row<A>(acc.data(), scratch.data() + (long_first_slot[l] + k) * dim, dim);
      finalize_row<T>(dest(s), acc.data(), factor(s), dim);
    }
  });
}

template <typename T>
void batch_sum_typed(const BatchSumArgs& a) {
  using A = acc_t<T>;
  const auto* dout = static_cast<const T*>(a.dout);
  auto* out = static_cast<T*>(a.out);
  const int64_t dim = a.dim;
  at::parallel_for(0, a.steps, grain_for(a.batch * dim * sizeof(T)), [&](int64_t t0, int64_t t1) {
    std::vector<A> acc(dim);
    for (int64_t t = t0; t < t1; ++t) {
      load_row<T>(acc.data(), dout + t * dim, dim);
      for (int64_t b = 1; b < a.batch; ++b) accumulate_row<T>(acc.data(), dout + (b * a.seq_len + t) * dim, dim);
      finalize_row<T>(out + (a.offset + t) * dim, acc.data(), A(1), dim);
    }
  });
}

// One table row through the update rule: vectors of Chunk<T> in the compute dtype, a
// scalar tail. g == nullptr: no gradient for this row (g = 0). Each of p, s1, s2 is read
// and written once, rounded once.
template <typename T, int RULE>
void update_row(T* p, T* s1, T* s2, const T* g, int64_t dim, const optim::Scalars<acc_t<T>>& h) {
  using A = acc_t<T>;
  using C = Chunk<T>;
  int64_t j = 0;
  for (; j + C::kSize <= dim; j += C::kSize) {
    C cp = C::load(p + j), c1 = s1 ? C::load(s1 + j) : C::zero(), c2 = s2 ? C::load(s2 + j) : C::zero();
    const C cg = g ? C::load(g + j) : C::zero();
    for (int i = 0; i < C::kParts; ++i) optim::update<RULE>(cp.v[i], c1.v[i], c2.v[i], cg.v[i], h);
    cp.store(p + j);
    if (s1) c1.store(s1 + j);
    if (s2) c2.store(s2 + j);
  }
  for (; j < dim; ++j) {
    A vp = static_cast<A>(p[j]), v1 = s1 ? static_cast<A>(s1[j]) : A(0), v2 = s2 ? static_cast<A>(s2[j]) : A(0);
    optim::update<RULE>(vp, v1, v2, g ? static_cast<A>(g[j]) : A(0), h);
    p[j] = static_cast<T>(vp);
    if (s1) s1[j] = static_cast<T>(v1);
    if (s2) s2[j] = static_cast<T>(v2);
  }
}

// Rows split over threads; with all_rows each task walks the table rows of its range and
// the sorted touched rows in step (one binary search per task), so a row's gradient is
// found without a (V,) map.
template <typename T, int RULE>
void optimizer_update_typed(const OptimizerArgs& a) {
  const auto h = optim::Scalars<acc_t<T>>::from(a.rule, a.hyper);
  auto* p = static_cast<T*>(a.param);
  auto* s1 = static_cast<T*>(a.state1);
  auto* s2 = static_cast<T*>(a.state2);
  const auto* values = static_cast<const T*>(a.values);
  const int64_t dim = a.dim;
  auto row = [&](int64_t r, const T* g) {
    update_row<T, RULE>(p + r * dim, s1 ? s1 + r * dim : nullptr, s2 ? s2 + r * dim : nullptr, g, dim, h);
  };
  const int64_t grain = grain_for(3 * dim * sizeof(T));
  if (!a.all_rows) {
    at::parallel_for(0, a.touched, grain, [&](int64_t k0, int64_t k1) {
      for (int64_t k = k0; k < k1; ++k) row(a.rows[k], values + k * dim);
    });
    return;
  }
  at::parallel_for(0, a.num_rows, grain, [&](int64_t r0, int64_t r1) {
    int64_t k = std::lower_bound(a.rows, a.rows + a.touched, r0) - a.rows;
    for (int64_t r = r0; r < r1; ++r) {
      const bool touched = k < a.touched && a.rows[k] == r;
      row(r, touched ? values + k * dim : nullptr);
      k += touched;
    }
  });
}

void forward(const ForwardArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "pyembed_forward_cpu", [&] {
    AT_DISPATCH_INDEX_TYPES(a.id_type, "pyembed_forward_cpu", [&] { forward_typed<scalar_t, index_t>(a); });
  });
}

void segment_sum(const SegmentSumArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "pyembed_segment_sum_cpu",
                                  [&] { segment_sum_typed<scalar_t>(a); });
}

void batch_sum(const BatchSumArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "pyembed_batch_sum_cpu",
                                  [&] { batch_sum_typed<scalar_t>(a); });
}

void optimizer_update(const OptimizerArgs& a) {
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, a.dtype, "pyembed_optimizer_update_cpu", [&] {
    switch (a.rule) {
      case optim::kSGD: return optimizer_update_typed<scalar_t, optim::kSGD>(a);
      case optim::kAdam: return optimizer_update_typed<scalar_t, optim::kAdam>(a);
      case optim::kAdagrad: return optimizer_update_typed<scalar_t, optim::kAdagrad>(a);
      default: return optimizer_update_typed<scalar_t, optim::kSparseAdam>(a);
    }
  });
}

}  // namespace

#define PYEMBED_STR2(x) #x
#define PYEMBED_STR(x) PYEMBED_STR2(x)
const Kernels kKernels = {PYEMBED_STR(PYEMBED_ISA), &forward, &segment_sum, &batch_sum, &optimizer_update};

}  // namespace pyembed::cpu::PYEMBED_ISA
