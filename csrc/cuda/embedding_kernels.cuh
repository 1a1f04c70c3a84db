// CUDA backend: kernels and their host-side orchestration, compiled two ways:
//   - by nvcc into pyembed._C (embedding_cuda.cu, Launch = CudaLaunch), and
//   - by g++ with host_emulation.h into a test-only module (Launch = EmulatedLaunch),
//     which runs these exact kernels serially on CPU tensors (DESIGN §6).
// So the kernels use no shared memory and no block-level synchronisation: every thread
// is independent. An embedding op is bandwidth-bound, so nothing is lost by that.
//
// Forward: one thread owns VEC elements of one output row (16-byte loads/stores when
// rows are 16-byte multiples and aligned, else one element), reads the token's row,
// scales it, adds the learned row or a sinusoid computed in registers, rounds once.
// An out-of-range id (validate=false) reads nothing and yields a zero row (no positional term either).
//
// Backward: sort the keys (stable: the order then depends on the data alone), cut the
// sorted tokens into segments of equal used keys (two small kernels around one scan),
// split every segment into parts of at most kPartRows rows summed in parallel (fp32),
// and repeat on the partial sums until each segment has one part: a row used 100k times
// is reduced as a tree, not by one thread. No atomics, so the result is bitwise
// deterministic. The dense backward never waits for the device: segment and part counts
// are unknown to the host, so every array is sized by an upper bound computed from the
// token count, unused slots are empty ranges the kernels skip, and the number of tree
// levels is the one the longest possible segment (all tokens) needs -- as PyTorch's own
// embedding backward does. It can therefore be captured in a CUDA graph. Each launch
// costs the host microseconds while a level's arithmetic is tens of nanoseconds, so the
// bookkeeping is done by kernels, not by chains of tensor ops: a 16k-token backward is
// about 15 launches.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../checks.h"
#include "../dropout.h"

namespace pyembed::cuda {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kPartRows = 32;  // rows summed by one thread group before a tree level

template <typename T>
using acc_t = acc_type<T>;

// VEC elements moved as one aligned access (16 bytes for T, 16 or 32 for float partials).
template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T val[VEC];
};

template <int VEC, typename S, typename A>
__device__ __forceinline__ void load_pack(const S* p, A (&out)[VEC]) {
  const Pack<S, VEC> pack = *reinterpret_cast<const Pack<S, VEC>*>(p);
#pragma unroll
  for (int i = 0; i < VEC; ++i) out[i] = static_cast<A>(pack.val[i]);
}

template <int VEC, typename D, typename A>
__device__ __forceinline__ void store_pack(D* p, const A (&in)[VEC]) {
  Pack<D, VEC> pack;
#pragma unroll
  for (int i = 0; i < VEC; ++i) pack.val[i] = static_cast<D>(in[i]);
  *reinterpret_cast<Pack<D, VEC>*>(p) = pack;
}

__device__ __forceinline__ void sincos_acc(float x, float* s, float* c) { sincosf(x, s, c); }
__device__ __forceinline__ void sincos_acc(double x, double* s, double* c) { sincos(x, s, c); }
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

// out[token, :] = round(W[ids[token]] * scale + PE(p(token))). blockDim.y tokens per
// block, blockDim.x threads striding over the row VEC elements at a time.
template <typename T, typename index_t, int VEC>
__global__ void embedding_forward_kernel(
    const index_t* __restrict__ ids,             // (num_tokens,)
    const T* __restrict__ weight,                // (num_embeddings, dim)
    const T* __restrict__ pos_weight,            // (num_positions, dim), learned only
    const int64_t* __restrict__ position_ids,    // (num_tokens,) or nullptr: p = offset + t
    T* __restrict__ out,                         // (num_tokens, dim)
    int64_t num_tokens, int64_t seq_len, int64_t num_embeddings, int64_t num_positions, int64_t dim,
    int pos_mode, acc_t<T> scale, int64_t offset,
    acc_t<T> neg_log_base_over_dim,              // -ln(10000) / d_total: w_i = exp(2i * this)
    int64_t sinusoid_column_offset,              // even: the table's column 0 is this column of PE
    Dropout dropout,                             // applied to the sum before the rounding
    int64_t* error_record) {                     // host-mapped record of bad ids / positions, or nullptr
  using A = acc_t<T>;
  const int64_t token = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (token >= num_tokens) return;
  const int64_t id = static_cast<int64_t>(ids[token]);
  const bool id_ok = id >= 0 && id < num_embeddings;
  const int64_t p = position_ids != nullptr ? position_ids[token] : offset + token % seq_len;
  if (error_record != nullptr && threadIdx.x == 0) {
    // validate=True on a GPU: record what is wrong (checks.h: raise_recorded_error) instead of
    // making the host wait; any one offender serves the message, so plain stores, no atomics.
    const bool learned_table = pos_mode == static_cast<int>(PosEncoding::kLearned);
    if (!id_ok) error_record[1] = id, error_record[2] = num_embeddings, error_record[0] = 1;
    if (position_ids != nullptr && pos_mode != static_cast<int>(PosEncoding::kNone) &&
        (p < 0 || (learned_table && p >= num_positions))) {
      error_record[4] = p, error_record[5] = learned_table ? num_positions : -1, error_record[3] = 1;
    }
  }
  // An out-of-range id gives a zero row, positional term included (vocab-parallel ranks
  // sum their rows: each token's is then added by the one rank holding its id).
  const bool learned = id_ok && pos_mode == static_cast<int>(PosEncoding::kLearned) && p >= 0 && p < num_positions;
  const bool sinusoidal = id_ok && pos_mode == static_cast<int>(PosEncoding::kSinusoidal);
  // 64-bit row offsets: token * dim exceeds 2^31 on large batches.
  const T* w_row = weight + (id_ok ? id : 0) * dim;
  const T* p_row = learned ? pos_weight + p * dim : nullptr;
  T* o_row = out + token * dim;
  const uint64_t drop_seed = dropout.active() ? static_cast<uint64_t>(dropout.key[0]) : 0;
  const uint64_t drop_offset = dropout.active() ? static_cast<uint64_t>(dropout.key[1]) : 0;

  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A x[VEC];
    if (id_ok) {
      load_pack<VEC>(w_row + j, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] *= scale;
    } else {
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = A(0);
    }
    if (learned) {
      A pe[VEC];
      load_pack<VEC>(p_row + j, pe);
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] += pe[i];
    } else if (sinusoidal) {
      // Element e belongs to pair e / 2: sin for even e, cos for odd e (interleaved).
      A s = A(0), c = A(0);
      int64_t pair_done = -1;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int64_t e = j + i, pair = (sinusoid_column_offset + e) >> 1;
        if (pair != pair_done) {
          const A angle = static_cast<A>(p) * exp_acc(static_cast<A>(2 * pair) * neg_log_base_over_dim);
          sincos_acc(angle, &s, &c);
          pair_done = pair;
        }
        x[i] += (e & 1) ? c : s;
      }
    }
    if (dropout.active()) {
      // Element e is word e % 4 of its group e / 4's Philox call (one call per group).
      const A keep_scale = static_cast<A>(dropout.scale);
      unsigned bits = 0;
      int64_t group_done = -1;
#pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const int64_t e = j + i, group = e >> 2;
        if (group != group_done) {
          bits = dropout_keep_bits(drop_seed, drop_offset, token, group, dropout.threshold);
          group_done = group;
        }
        x[i] = (bits >> (e & 3)) & 1u ? x[i] * keep_scale : A(0);
      }
    }
    store_pack<VEC>(o_row + j, x);
  }
}

// ------------------------------------------------------------------ backward kernels
// A key is used when it names a row of the table other than the skipped one (the padding
// row); out-of-range ids (validate=false) are not used.
__device__ __forceinline__ bool used_key(int64_t key, int64_t num_rows, int64_t skip) {
  return key >= 0 && key < num_rows && key != skip;
}

// The keys the sort sees: a used key as it is, every other one as num_rows (sorted after
// all used ones), in K -- 32 bits when the table allows, so the radix sort makes half the
// passes of a 64-bit one (PyTorch's embedding backward likewise sorts only the bits V needs).
template <typename index_t, typename K>
__global__ void compact_keys_kernel(const index_t* __restrict__ keys, int64_t n, int64_t num_rows, int64_t skip,
                                    K* __restrict__ out) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int64_t key = static_cast<int64_t>(keys[r]);
  out[r] = static_cast<K>(used_key(key, num_rows, skip) ? key : num_rows);
}

// starts[r] = 1 where sorted position r begins a segment: a used key (< num_rows, after
// compact_keys) unlike the previous one. Its inclusive scan then numbers the segments:
// scan[r] - 1 is the slot of r's.
template <typename K>
__global__ void segment_starts_kernel(const K* __restrict__ sorted, int64_t n, int64_t num_rows,
                                      int64_t* __restrict__ starts) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int64_t key = sorted[r];
  starts[r] = key < num_rows && (r == 0 || sorted[r - 1] != sorted[r]);
}

// Slot s = scan[r] - 1 of the segment holding sorted position r gets its key and its
// range [begin, end) of sorted positions, each written by the one thread at the range's
// edge; with row_segment (a dense gradient), the key's row learns its slot. Slots past the
// last segment keep the zeros they were made with: empty ranges.
template <typename K>
__global__ void segment_bounds_kernel(const K* __restrict__ sorted, const int64_t* __restrict__ scan, int64_t n,
                                      int64_t num_rows, int64_t* __restrict__ keys, int64_t* __restrict__ begin,
                                      int64_t* __restrict__ end, int64_t* __restrict__ row_segment) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int64_t key = sorted[r];
  if (key >= num_rows) return;  // an unused key (compact_keys)
  const int64_t s = scan[r] - 1;
  if (r == 0 || sorted[r - 1] != sorted[r]) {
    begin[s] = r, keys[s] = key;
    if (row_segment != nullptr) row_segment[key] = s;
  }
  if (r == n - 1 || sorted[r + 1] != sorted[r]) end[s] = r + 1;
}

// The parts of at most kPartRows rows a segment of `length` rows is cut into.
__device__ __forceinline__ int64_t parts_of(int64_t length) { return (length + kPartRows - 1) / kPartRows; }

// d_row = factor * (sum of src rows src_row(r), r in [r0, r1)), summed in order in the
// compute dtype A: the result does not depend on scheduling. This thread's columns only.
template <int VEC, typename S, typename D, typename A>
__device__ __forceinline__ void sum_rows(const S* __restrict__ src, const int64_t* __restrict__ src_rows, int64_t r0,
                                         int64_t r1, D* __restrict__ d_row, A factor, int64_t dim) {
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = A(0);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t row = src_rows != nullptr ? src_rows[r] : r;
      A x[VEC];
      load_pack<VEC>(src + row * dim + j, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += x[i];
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= factor;
    store_pack<VEC>(d_row + j, acc);
  }
}

// One tree level's finished segments: segment g of at most max_rows rows is summed,
// scaled and written to dst row dst_row(g) (rounded once, to the gradient's dtype). A
// longer one gets parts[g] = its number of parts for the next level (0 when finished
// here; parts may be nullptr at the last level, where every segment fits).
template <typename S, typename D, typename A, int VEC>
__global__ void finish_segments_kernel(
    const S* __restrict__ src, const int64_t* __restrict__ src_rows,  // nullptr: row r itself
    const int64_t* __restrict__ begin, const int64_t* __restrict__ end,
    D* __restrict__ dst, const int64_t* __restrict__ dst_rows,        // nullptr: row g
    A scale, const A* __restrict__ factors,                           // factors (scale / count) or nullptr: scale
    int64_t* __restrict__ parts, int64_t max_rows, int64_t num_segments, int64_t dim) {
  const int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (g >= num_segments) return;
  const int64_t r0 = begin[g], r1 = end[g];
  const bool fits = r1 - r0 <= max_rows;
  if (parts != nullptr && threadIdx.x == 0) parts[g] = fits ? 0 : parts_of(r1 - r0);
  if (r0 == r1 || !fits) return;  // an unused slot, or a segment finished at a later level
  D* d_row = dst + (dst_rows != nullptr ? dst_rows[g] : g) * dim;
  sum_rows<VEC>(src, src_rows, r0, r1, d_row, factors != nullptr ? factors[g] : scale, dim);
}

// The first tree level of a dense gradient, over every row of the table: so the (V, d)
// gradient is written exactly once, with no zero fill before it. Row v holds segment
// s = row_segment[v] (-1: untouched, written as zeros); a segment of at most max_rows
// sorted tokens is summed, scaled and rounded here; a longer one gets its part count in
// parts[s] (zero-initialised) and is written by a later level's finish_segments_kernel.
template <typename T, typename A, int VEC>
__global__ void finish_rows_kernel(
    const T* __restrict__ dout, const int64_t* __restrict__ order,  // token rows, in sorted order
    const int64_t* __restrict__ begin, const int64_t* __restrict__ end, const int64_t* __restrict__ row_segment,
    T* __restrict__ out, A scale, const A* __restrict__ factors, int64_t* __restrict__ parts, int64_t max_rows,
    int64_t num_rows, int64_t dim) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (v >= num_rows) return;
  const int64_t s = row_segment[v];
  T* d_row = out + v * dim;
  if (s < 0) {
    const A zeros[VEC] = {};
    for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
      store_pack<VEC>(d_row + j, zeros);
    }
    return;
  }
  const int64_t r0 = begin[s], r1 = end[s];
  if (r1 - r0 > max_rows) {
    if (threadIdx.x == 0) parts[s] = parts_of(r1 - r0);
    return;
  }
  sum_rows<VEC>(dout, order, r0, r1, d_row, factors != nullptr ? factors[s] : scale, dim);
}

// One tree level's parts: part j of the level belongs to the first segment g whose
// running part count part_end[g] (the inclusive scan of parts) exceeds j; it sums rows
// [begin[g] + k * kPartRows, ...) of g, k = j - (its first part), into partials row j.
// Slots past the last part (j >= part_end of the last segment) do nothing.
template <typename S, typename A, int VEC>
__global__ void sum_parts_kernel(const S* __restrict__ src, const int64_t* __restrict__ src_rows,
                                 const int64_t* __restrict__ begin, const int64_t* __restrict__ end,
                                 const int64_t* __restrict__ part_end, int64_t num_segments, A* __restrict__ partials,
                                 int64_t num_parts, int64_t dim) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (j >= num_parts) return;
  int64_t lo = 0, hi = num_segments;  // binary search: part_end is non-decreasing
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (part_end[mid] > j) hi = mid; else lo = mid + 1;
  }
  if (lo == num_segments) return;
  const int64_t g = lo, length = end[g] - begin[g];
  const int64_t r0 = begin[g] + (j - (part_end[g] - parts_of(length))) * kPartRows;
  const int64_t r1 = r0 + kPartRows < end[g] ? r0 + kPartRows : end[g];
  sum_rows<VEC>(src, src_rows, r0, r1, partials + j * dim, A(1), dim);
}

// Learned positions with p = offset + t: out[offset + t] = sum over b of dout[b, t].
template <typename T, int VEC>
__global__ void batch_sum_kernel(const T* __restrict__ dout, T* __restrict__ out, int64_t batch, int64_t seq_len,
                                 int64_t steps, int64_t offset, int64_t dim) {
  using A = acc_t<T>;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (t >= steps) return;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = A(0);
    for (int64_t b = 0; b < batch; ++b) {
      A x[VEC];
      load_pack<VEC>(dout + (b * seq_len + t) * dim + j, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += x[i];
    }
    store_pack<VEC>(out + (offset + t) * dim + j, acc);
  }
}

// ------------------------------------------------------------------------- host side
// Rows of `dim` elements of T: blockDim.x threads cover a row VEC at a time, blockDim.y
// rows share a block. A row of `per_row` accesses takes the fewest passes of at most
// kThreadsPerBlock threads, spread evenly in whole warps: d = 768 fp32 (192 accesses) gets
// 192 threads, not 256 with a quarter idle. Rows under a warp share one (a power of two each).
struct RowGrid {
  dim3 grid, block;
};

inline RowGrid row_grid(int64_t rows, int64_t dim, int vec) {
  constexpr int64_t kWarp = 32;
  const int64_t per_row = std::max<int64_t>(1, (dim + vec - 1) / vec);
  int64_t tx = 1;
  if (per_row < kWarp) {
    while (tx < per_row) tx *= 2;
  } else {
    const int64_t passes = (per_row + kThreadsPerBlock - 1) / kThreadsPerBlock;
    const int64_t per_pass = (per_row + passes - 1) / passes;
    tx = std::min<int64_t>(kThreadsPerBlock, (per_pass + kWarp - 1) / kWarp * kWarp);
  }
  const int64_t ty = std::max<int64_t>(1, kThreadsPerBlock / tx);
  const int64_t blocks = std::max<int64_t>(1, (rows + ty - 1) / ty);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "pyembed: too many rows for one launch: ", rows);
  return {dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

inline bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// 16 bytes per access when every row of every tensor involved starts 16-byte aligned.
template <typename T>
int vector_width(int64_t dim, std::initializer_list<const void*> pointers) {
  constexpr int kVec = 16 / sizeof(T);
  if (dim % kVec != 0) return 1;
  for (const void* p : pointers) {
    if (p != nullptr && !aligned16(p)) return 1;
  }
  return kVec;
}

template <class Launch, typename T, typename index_t>
void launch_forward(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& pos_weight,
                    const at::Tensor& position_ids, PosEncoding mode, double scale, int64_t offset,
                    const Dropout& dropout, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                    int64_t* error_record, at::Tensor& out) {
  const int64_t num_tokens = ids.numel(), dim = weight.size(1);
  const T* pw = pos_weight.defined() ? pos_weight.data_ptr<T>() : nullptr;
  const int vec = vector_width<T>(dim, {weight.data_ptr(), pw, out.data_ptr()});
  const RowGrid g = row_grid(num_tokens, dim, vec);
  const int64_t* pid = position_ids.defined() ? position_ids.data_ptr<int64_t>() : nullptr;
  const auto neg_log_base_over_dim = static_cast<acc_t<T>>(-std::log(10000.0) / static_cast<double>(sinusoid_dim));
  auto run = [&](auto kernel) {
    Launch::run(g.grid, g.block, kernel, ids.data_ptr<index_t>(), weight.data_ptr<T>(), pw, pid, out.data_ptr<T>(),
                num_tokens, ids.dim() > 0 ? ids.size(-1) : int64_t(1), weight.size(0),
                pos_weight.defined() ? pos_weight.size(0) : int64_t(0), dim, static_cast<int>(mode),
                static_cast<acc_t<T>>(scale), offset, neg_log_base_over_dim, sinusoid_column_offset, dropout,
                error_record);
  };
  if (vec > 1) {
    run(embedding_forward_kernel<T, index_t, 16 / sizeof(T)>);
  } else {
    run(embedding_forward_kernel<T, index_t, 1>);
  }
}

template <class Launch>
at::Tensor forward_op(const at::Tensor& ids_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& pos_weight_in,
                      const std::optional<at::Tensor>& position_ids_in, std::string_view pos_encoding, double scale,
                      int64_t offset, const std::optional<at::Tensor>& dropout_key, double dropout_p,
                      int64_t sinusoid_column_offset, int64_t sinusoid_dim, int64_t error_record) {
  ForwardInputs in = prepare_forward(ids_in, weight_in, pos_weight_in, position_ids_in, pos_encoding, dropout_key,
                                     dropout_p, sinusoid_column_offset, sinusoid_dim, error_record);
  if (in.empty()) return in.out;
  const at::Tensor &ids = in.ids, &weight = in.weight;
  at::Tensor& out = in.out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, weight.scalar_type(), "pyembed_forward_cuda", [&] {
    AT_DISPATCH_INDEX_TYPES(ids.scalar_type(), "pyembed_forward_cuda", [&] {
      launch_forward<Launch, scalar_t, index_t>(ids, weight, in.pos_weight, in.position_ids, in.mode, scale, offset,
                                                  in.dropout, in.sinusoid_column_offset, in.sinusoid_dim,
                                                  in.error_record, out);
    });
  });
  return out;
}

// One thread per item, kThreadsPerBlock to a block.
inline RowGrid linear_grid(int64_t items) {
  const int64_t blocks = std::max<int64_t>(1, (items + kThreadsPerBlock - 1) / kThreadsPerBlock);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "pyembed: too many items for one launch: ", items);
  return {dim3(static_cast<unsigned>(blocks)), dim3(kThreadsPerBlock)};
}

// The segments of equal used keys among the stably sorted keys, in arrays whose sizes the
// host knows without asking the device: `slots` = min(tokens, num_rows) entries (at most
// one segment per distinct key). Slot s holds the s-th segment in key order; slots past
// the last segment are empty ranges (begin == end == 0). So the real segments are exactly
// the first U slots, U = the number of distinct used keys = `count`.
struct SortedSegments {
  at::Tensor order;       // (tokens,) token index of each sorted position
  at::Tensor keys;        // (slots,) the key of segment s (0 for an empty slot)
  at::Tensor begin, end;  // (slots,) the segment's sorted positions [begin, end)
  at::Tensor parts;       // (slots,) zeros: the first tree level's part counts (dense gradients)
  at::Tensor count;       // () int64 on the device: U
  at::Tensor row_segment;  // (num_rows,) the slot of each table row's segment, -1 if none (dense only)
  int64_t tokens = 0;
};

// Keys outside [0, num_rows) (out-of-range ids, validate=False) and `skip` (the padding
// row) are left out. With `by_row` (a dense gradient) each used row also learns its
// segment's slot. Launches: compact, the sort, starts, scan, zeros, bounds (+ a -1 fill of
// row_segment); no device->host sync.
template <class Launch>
SortedSegments sorted_segments(const at::Tensor& keys_in, int64_t num_rows, int64_t skip, bool by_row) {
  SortedSegments seg;
  const at::Tensor keys = keys_in.reshape(-1);
  const int64_t n = seg.tokens = keys.numel();
  const int64_t slots = std::min(n, std::max<int64_t>(num_rows, 0));
  const auto long_options = keys.options().dtype(at::kLong);
  const at::Tensor bounds = at::zeros({4, slots}, long_options);  // keys, begin, end, parts
  seg.keys = bounds[0], seg.begin = bounds[1], seg.end = bounds[2], seg.parts = bounds[3];
  if (by_row) seg.row_segment = at::full({std::max<int64_t>(num_rows, 0)}, -1, long_options);
  if (n == 0) {
    seg.order = at::empty({0}, long_options);
    seg.count = at::zeros({}, long_options);
    return seg;
  }
  const RowGrid g = linear_grid(n);
  // 32-bit sort keys when V (the unused keys' stand-in) fits: half the radix passes.
  const bool narrow = num_rows < std::numeric_limits<int32_t>::max();
  at::Tensor compact = at::empty({n}, keys.options().dtype(narrow ? at::kInt : at::kLong));
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_compact_keys", [&] {
    if (narrow) {
      Launch::run(g.grid, g.block, compact_keys_kernel<index_t, int32_t>, keys.data_ptr<index_t>(), n, num_rows,
                  skip, compact.data_ptr<int32_t>());
    } else {
      Launch::run(g.grid, g.block, compact_keys_kernel<index_t, int64_t>, keys.data_ptr<index_t>(), n, num_rows,
                  skip, compact.data_ptr<int64_t>());
    }
  });
  auto [sorted, order] = compact.sort(/*stable=*/true, 0, false);  // stable: the order depends on the data alone
  seg.order = order;
  at::Tensor scan = at::empty({n}, long_options);
  auto bounds_of = [&](auto key_type) {
    using K = decltype(key_type);
    Launch::run(g.grid, g.block, segment_starts_kernel<K>, sorted.template data_ptr<K>(), n, num_rows,
                scan.data_ptr<int64_t>());
    scan.cumsum_(0);
    if (slots > 0) {
      Launch::run(g.grid, g.block, segment_bounds_kernel<K>, sorted.template data_ptr<K>(), scan.data_ptr<int64_t>(),
                  n, num_rows, seg.keys.data_ptr<int64_t>(), seg.begin.data_ptr<int64_t>(),
                  seg.end.data_ptr<int64_t>(), by_row ? seg.row_segment.data_ptr<int64_t>() : nullptr);
    }
  };
  if (narrow) {
    bounds_of(int32_t{});
  } else {
    bounds_of(int64_t{});
  }
  seg.count = scan[n - 1];
  return seg;
}

// out[dst_row(s)] = factor(s) * (sum of the dout rows of segment s), for every segment:
// dst_row(s) = keys[s] for a dense gradient, s for sparse values; factor = scale, or
// scale / (the segment's token count) with divide_by_count. A tree of parts of at most
// kPartRows rows: at each level the segments that fit in one part are finished (summed,
// scaled, rounded once, written); the longer ones are cut into parts whose fp32 sums
// become the next level's rows. The host bounds every size from the token count. Per
// level: finish (which also counts the parts), scan, subtract, sum the parts. A dense
// gradient's first level runs over every table row (finish_rows_kernel), so `out` needs
// no zero fill: each of its rows is written once, untouched ones as zeros.
template <class Launch, typename T>
void sum_segments(const at::Tensor& dout, const SortedSegments& seg, double scale, bool divide_by_count, bool dense,
                  at::Tensor& out) {
  using A = acc_t<T>;
  const int64_t dim = dout.size(1), slots = seg.keys.numel();
  if (dim == 0) return;
  TORCH_CHECK(!dense || seg.row_segment.defined(), "pyembed: a dense gradient needs sorted_segments(by_row=true)");
  if (slots == 0 && !dense) return;
  const auto acc_opts = dout.options().dtype(c10::CppTypeToScalarType<A>::value);
  const int vec = vector_width<T>(dim, {dout.data_ptr(), out.data_ptr()});
  at::Tensor factors;  // scale / count, fixed at level 0 (later levels' ranges count parts, not tokens)
  if (divide_by_count) factors = static_cast<A>(scale) / (seg.end - seg.begin).clamp_min(1).to(acc_opts.dtype());
  const A* factor_ptr = factors.defined() ? factors.data_ptr<A>() : nullptr;
  const int64_t* dst_rows = dense ? seg.keys.data_ptr<int64_t>() : nullptr;
  // 16 bytes of T per access when the rows allow it (S and D rows then move vec at a time too), else 1.
  auto with_vec = [&](auto run) {
    if (vec > 1) {
      run(std::integral_constant<int, 16 / sizeof(T)>{});
    } else {
      run(std::integral_constant<int, 1>{});
    }
  };

  // Level 0 sums tokens (via `order`) straight from dout; each further level sums the
  // partial rows of the previous one, which are contiguous per segment.
  at::Tensor begin = seg.begin, end = seg.end, partials;
  int64_t rows = seg.tokens;     // rows at this level, at most
  int64_t longest = seg.tokens;  // the longest segment at this level, at most
  // One level; true when it was the last (every segment fit in one part).
  auto level = [&](const auto* src, const int64_t* src_rows, bool first) {
    using S = std::remove_cv_t<std::remove_pointer_t<decltype(src)>>;
    const bool last = longest <= kPartRows;
    const int64_t max_rows = last ? std::numeric_limits<int64_t>::max() : kPartRows;
    at::Tensor parts;
    if constexpr (std::is_same_v<S, T>) {
      if (dense && first) {  // the first level of a dense gradient: every table row
        const int64_t num_rows = out.size(0);
        const RowGrid g = row_grid(num_rows, dim, vec);
        parts = seg.parts;  // zeros: only the segments left to later levels get a count
        with_vec([&](auto v) {
          Launch::run(g.grid, g.block, finish_rows_kernel<T, A, decltype(v)::value>, src, src_rows,
                      begin.data_ptr<int64_t>(), end.data_ptr<int64_t>(), seg.row_segment.data_ptr<int64_t>(),
                      out.data_ptr<T>(), static_cast<A>(scale), factor_ptr, parts.data_ptr<int64_t>(), max_rows,
                      num_rows, dim);
        });
      }
    }
    if (!parts.defined()) {
      if (!last) parts = at::empty({slots}, begin.options());
      const RowGrid g = row_grid(slots, dim, vec);
      with_vec([&](auto v) {
        Launch::run(g.grid, g.block, finish_segments_kernel<S, T, A, decltype(v)::value>, src, src_rows,
                    begin.data_ptr<int64_t>(), end.data_ptr<int64_t>(), out.data_ptr<T>(), dst_rows,
                    static_cast<A>(scale), factor_ptr, last ? nullptr : parts.data_ptr<int64_t>(), max_rows, slots,
                    dim);
      });
    }
    if (last || slots == 0) return true;
    // A segment of length > kPartRows has ceil(length / kPartRows) < 2 length / kPartRows parts.
    const int64_t next_rows = 2 * rows / kPartRows;
    const at::Tensor part_end = parts.cumsum(0);
    at::Tensor next = at::empty({next_rows, dim}, acc_opts);
    const RowGrid pg = row_grid(next_rows, dim, vec);
    with_vec([&](auto v) {
      Launch::run(pg.grid, pg.block, sum_parts_kernel<S, A, decltype(v)::value>, src, src_rows,
                  begin.data_ptr<int64_t>(), end.data_ptr<int64_t>(), part_end.data_ptr<int64_t>(), slots,
                  next.data_ptr<A>(), next_rows, dim);
    });
    begin = part_end - parts, end = part_end, partials = next;
    rows = next_rows;
    longest = (longest + kPartRows - 1) / kPartRows;
    return false;
  };
  bool done = level(dout.data_ptr<T>(), seg.order.data_ptr<int64_t>(), true);
  while (!done) done = level(static_cast<const A*>(partials.data_ptr<A>()), nullptr, false);
}

// Dense gradients (weight_grad (V, d) and / or pos_grad (max_seq_len, d); (0, d) when not
// needed): no device->host sync.
template <class Launch>
std::tuple<at::Tensor, at::Tensor> backward_op(const at::Tensor& grad_out_in, const at::Tensor& ids_in,
                                               const std::optional<at::Tensor>& position_ids_in, int64_t offset,
                                               int64_t num_embeddings, int64_t num_positions, double scale,
                                               std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                               bool need_weight_grad, bool need_pos_grad) {
  check_same_device(grad_out_in.device(), {&ids_in, opt(position_ids_in)});
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  const at::Tensor dout = grad_out_in.contiguous().view({num_tokens, dim});
  const auto options = dout.options();
  at::Tensor weight_grad = at::empty({0, dim}, options), pos_grad = at::empty({0, dim}, options);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dout.scalar_type(), "pyembed_backward_cuda", [&] {
    using T = scalar_t;
    // The dense gradients are written once, every row (sum_segments), not zero-filled first.
    if (need_weight_grad) {
      weight_grad = at::empty({num_embeddings, dim}, options);
      sum_segments<Launch, T>(dout, sorted_segments<Launch>(ids_in, num_embeddings, padding_idx.value_or(-1), true),
                              scale, scale_grad_by_freq, /*dense=*/true, weight_grad);
    }
    if (need_pos_grad) {
      if (position_ids_in) {
        pos_grad = at::empty({num_positions, dim}, options);
        sum_segments<Launch, T>(dout, sorted_segments<Launch>(*position_ids_in, num_positions, -1, true), 1.0, false,
                                /*dense=*/true, pos_grad);
      } else {
        pos_grad = at::zeros({num_positions, dim}, options);  // the rows past the sequence get nothing
        const int64_t seq_len = num_tokens > 0 ? ids_in.size(-1) : 0;
        const int64_t steps = std::clamp<int64_t>(num_positions - offset, 0, seq_len);
        if (steps > 0 && dim > 0) {
          const int vec = vector_width<T>(dim, {dout.data_ptr(), pos_grad.data_ptr()});
          const RowGrid g = row_grid(steps, dim, vec);
          auto run = [&](auto kernel) {
            Launch::run(g.grid, g.block, kernel, dout.data_ptr<T>(), pos_grad.data_ptr<T>(), num_tokens / seq_len,
                        seq_len, steps, offset, dim);
          };
          if (vec > 1) {
            run(batch_sum_kernel<T, 16 / sizeof(T)>);
          } else {
            run(batch_sum_kernel<T, 1>);
          }
        }
      }
    }
  });
  return {weight_grad, pos_grad};
}

// The token table's gradient rows: the used ids' segments, the first `rows` slots'
// scaled sums written into a (rows, d) tensor -- rows >= the number of touched rows.
template <class Launch>
std::pair<SortedSegments, at::Tensor> sum_used_rows(const at::Tensor& grad_out_in, const at::Tensor& ids_in,
                                                     int64_t num_embeddings, double scale,
                                                     std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                     bool exact) {
  check_same_device(grad_out_in.device(), {&ids_in});
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  const at::Tensor dout = grad_out_in.contiguous().view({num_tokens, dim});
  SortedSegments seg = sorted_segments<Launch>(ids_in, num_embeddings, padding_idx.value_or(-1), false);
  const int64_t rows = exact ? seg.count.item<int64_t>() : seg.keys.numel();  // exact: one device->host read
  at::Tensor values = at::empty({rows, dim}, dout.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dout.scalar_type(), "pyembed_sum_used_rows_cuda", [&] {
    sum_segments<Launch, scalar_t>(dout, seg, scale, scale_grad_by_freq, /*dense=*/false, values);
  });
  return {std::move(seg), values};
}

// The token table's sparse gradient: (rows (U,) sorted unique used ids, values (U, d)).
// U is read back from the device once (this op is tagged cudagraph_unsafe).
template <class Launch>
std::tuple<at::Tensor, at::Tensor> sparse_backward_op(const at::Tensor& grad_out, const at::Tensor& ids,
                                                      int64_t num_embeddings, double scale,
                                                      std::optional<int64_t> padding_idx, bool scale_grad_by_freq) {
  auto [seg, values] = sum_used_rows<Launch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                             /*exact=*/true);
  return {seg.keys.slice(0, 0, values.size(0)).clone(), values};
}

// The sparse backward's (rows, values) without the host sync: sized by the bound
// min(tokens, V) the host knows, the slots past the touched rows marked row -1 (their
// values are never written, and the optimizer update skips them). What the optimizer in
// the backward takes (pyembed/optim.py).
template <class Launch>
std::tuple<at::Tensor, at::Tensor> touched_rows_op(const at::Tensor& grad_out, const at::Tensor& ids,
                                                   int64_t num_embeddings, double scale,
                                                   std::optional<int64_t> padding_idx, bool scale_grad_by_freq) {
  auto [seg, values] = sum_used_rows<Launch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                             /*exact=*/false);
  return {at::where(seg.end > seg.begin, seg.keys, -1), values};
}

}  // namespace pyembed::cuda
