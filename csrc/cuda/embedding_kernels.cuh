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
// Backward: sort the keys (stably, on the bits the table needs: the order
// then depends on the data alone), find each segment of equal used keys, and sum its
// tokens in sorted order in fp32. A segment longer than kChunkRows (a row used 12000
// times must not be summed by one thread group) is summed in pieces by the chunks of
// sorted positions it spans, and its row adds those partial sums in order. No atomics,
// so the result is bitwise deterministic. The dense backward never waits for the device:
// every size the host needs is bounded by the token count or the table, and the segment
// bounds are indexed by table row, so it can be captured in a CUDA graph. Each launch
// costs the host microseconds and the GPU a ramp, so a dense gradient is the sort and
// two kernels: one pass over the sorted positions (segment bounds, the long segments'
// pieces); one over the table's rows (each written once, untouched rows as zeros: no zero
// fill before). Up to 16384 tokens over tables below 2^18 rows the sort is the tile sort,
// two launches of independent threads, the first also setting the sort's inputs (see
// tile_rank_kernel): four launches at 8x2048 tokens. Beyond, sort_inputs_kernel and CUB's
// radix sort (Launch::sort_pairs: a histogram and a pass per 8 bits, one kernel up to ~4.8K
// keys). A batch of at most kFewTokens tokens skips the sort: one kernel reads every key
// per group of rows (few_tokens_gradient_kernel), same sums.
// Learned positions (p = offset + t) are summed over the batch by extra blocks of the
// table's last kernel (PositionSums): no launch of their own; they also write the table
// rows used by one token, so dout is read once for those, not twice.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string_view>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../checks.h"
#include "../dropout.h"

namespace pyembed::cuda {

constexpr int kThreadsPerBlock = 256;
constexpr int64_t kChunkRows = 128;  // sorted positions per chunk: the longest segment summed directly

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

// store_pack as one 16-byte store whatever the compiler makes of the pack. Where the
// learned positions' blocks write the table's one-token rows (position_sum_row), nvcc 13
// split store_pack's 16 bytes into one store per element (PTX: st.global.f32 x 4 for fp32,
// st.global.u16 x 8 for bf16 / fp16): 4-8 store instructions a thread where one does,
// and as many L2 requests, for the rows of 72-88% of the tokens at 8x2048; and the chunk
// pass's float64 partial sums into two 8-byte stores (sum_piece). Elsewhere the compiler
// keeps store_pack whole; forcing it everywhere changed registers both ways (some kernels
// a granule up), so only those sites take this (tests/test_cuda_build.py checks them).
// (Its packing loop repeats store_pack's: one shared helper returning the pack left every
// kernel's registers as they were but changed nvcc's unrolling of the fp16 finish kernel's
// one-token rows, 7 copies of this store -> 3, unmeasured either way.)
template <int VEC, typename D, typename A>
__device__ __forceinline__ void store_pack_whole(D* p, const A (&in)[VEC]) {
#ifdef __CUDACC__
  if constexpr (sizeof(D) * VEC == 16) {
    Pack<D, VEC> pack;
#pragma unroll
    for (int i = 0; i < VEC; ++i) pack.val[i] = static_cast<D>(in[i]);
    uint4 bits;
    memcpy(&bits, &pack, sizeof(bits));
    __stwb(reinterpret_cast<uint4*>(p), bits);
    return;
  }
#endif
  store_pack<VEC>(p, in);
}

__device__ __forceinline__ void sincos_acc(float x, float* s, float* c) { sincosf(x, s, c); }
__device__ __forceinline__ void sincos_acc(double x, double* s, double* c) { sincos(x, s, c); }

// sin and cos of x for a 2-byte table's output: x less a whole number of turns (2*pi as
// float(2*pi) + the rest, the products inside FMAs: Cody-Waite), then the SFU's
// approximations (an absolute error below 2^-21.4 on [-pi, pi], against a bf16 / fp16
// output's half ulp of 2^-9 / 2^-12 at 1): a handful of instructions a pair where
// sincosf is ~40 with its own reduction -- the bf16 sinusoidal forward's largest cost, as
// in kernels/embedding.py's _sin_cos (where the Triton form of this went from 856 to 248
// SASS instructions a thread at d = 4096, sm_90). Host emulation runs sincosf on the
// reduced angle, so the CPU tests check the reduction.
__device__ __forceinline__ void fast_sincos(float x, float* s, float* c) {
  const float turns = floorf(x * 0.15915494309189535f + 0.5f);
  const float reduced = fmaf(-turns, -1.7484555314695172e-07f, fmaf(-turns, 6.2831854820251465f, x));
  __sincosf(reduced, s, c);
}

// A sinusoid pair's sine and cosine for a table of T: the SFU's for 2-byte tables.
template <typename T, typename A>
__device__ __forceinline__ void pair_sincos(A x, A* s, A* c) {
  if constexpr (sizeof(T) == 2) {
    fast_sincos(x, s, c);
  } else {
    sincos_acc(x, s, c);
  }
}
__device__ __forceinline__ float exp_acc(float x) { return expf(x); }
__device__ __forceinline__ double exp_acc(double x) { return exp(x); }

// The angle of pair k at position p: p * exp(2k * -ln(10000) / d_total), in A.
template <typename A>
__device__ __forceinline__ A sinusoid_angle(int64_t p, int64_t k, A neg_log_base_over_dim) {
  return static_cast<A>(p) * exp_acc(static_cast<A>(2 * k) * neg_log_base_over_dim);
}

// The token a forward thread row handles: (token, t) for row `slot` of the launch, t
// the token's index in its sequence. With learned positions p = offset + t (no
// position_ids: the batch's rows share their positions) the slots run position-major --
// the batch's tokens at position t take consecutive slots -- so the B reads of positional
// row t come together and all but the first hit L2. In token order they are seq_len
// tokens apart: at Llama's d = 4096 over 2048 positions, 96 MB of fp32 rows (table,
// positional and output row per token) pass between two reads of a positional row, more
// than an H100's 50 MB of L2, so each batch row read the positional table from DRAM again
// (the H100 at 664ac49: 63-68% of copy bandwidth with learned positions at Llama sizes,
// 87-93% with the sinusoid, which reads no table; 91-101% at GPT-2's d = 768, where 18 MB
// pass). Given position_ids, whose rows need not share positions (packed sequences restart
// them inside a row, where token order keeps a repeat close), and in the other modes,
// which read one row per token: token order.
struct TokenSlot {
  int64_t token, t;
};

template <int POS>
__host__ __device__ __forceinline__ TokenSlot token_of_slot(int64_t slot, int64_t num_tokens, int64_t seq_len,
                                                            bool has_position_ids) {
  if (POS == static_cast<int>(PosEncoding::kLearned) && !has_position_ids) {
    const int64_t batch = num_tokens / seq_len;  // ids are (B, T) or (T,) with a positional encoding
    const int64_t t = slot / batch;
    return {(slot - t * batch) * seq_len + t, t};
  }
  return {slot, slot % seq_len};
}

// out[token, :] = round(W[ids[token]] * scale + PE(p(token))). blockDim.y tokens per
// block, blockDim.x threads striding over the row VEC elements at a time. The positional
// mode (POS, a PosEncoding) and dropout are template parameters: the sinusoid's and
// Philox's registers then count only where they run (sm_90, bf16, 16-byte rows: 52
// registers for every mode at once, 29 for learned positions without dropout -- 8
// blocks of 256 threads per SM instead of 4).
template <typename T, typename index_t, int VEC, int POS, bool DROPOUT>
__global__ void embedding_forward_kernel(
    const index_t* __restrict__ ids,             // (num_tokens,)
    const T* __restrict__ weight,                // (num_embeddings, dim)
    const T* __restrict__ pos_weight,            // (num_positions, dim), learned only
    const int64_t* __restrict__ position_ids,    // (num_tokens,) or nullptr: p = offset + t
    T* __restrict__ out,                         // (num_tokens, dim)
    int64_t num_tokens, int64_t seq_len, int64_t num_embeddings, int64_t num_positions, int64_t dim,
    acc_t<T> scale, int64_t offset,
    acc_t<T> neg_log_base_over_dim,              // -ln(10000) / d_total: w_i = exp(2i * this)
    int64_t sinusoid_column_offset,              // even: the table's column 0 is this column of PE
    Dropout dropout,                             // applied to the sum before the rounding
    int64_t* error_record) {                     // host-mapped record of bad ids / positions, or nullptr
  using A = acc_t<T>;
  const int64_t slot = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (slot >= num_tokens) return;
  const TokenSlot at = token_of_slot<POS>(slot, num_tokens, seq_len, position_ids != nullptr);
  const int64_t token = at.token;
  const int64_t id = static_cast<int64_t>(ids[token]);
  const bool id_ok = id >= 0 && id < num_embeddings;
  const int64_t p = position_ids != nullptr ? position_ids[token] : offset + at.t;
  if (error_record != nullptr && threadIdx.x == 0) {
    // validate=True on a GPU: record what is wrong (checks.h: raise_recorded_error) instead of
    // making the host wait; any one offender serves the message, so plain stores, no atomics.
    constexpr bool learned_table = POS == static_cast<int>(PosEncoding::kLearned);
    if (!id_ok) error_record[1] = id, error_record[2] = num_embeddings, error_record[0] = 1;
    if (position_ids != nullptr && POS != static_cast<int>(PosEncoding::kNone) &&
        (p < 0 || (learned_table && p >= num_positions))) {
      error_record[4] = p, error_record[5] = learned_table ? num_positions : -1, error_record[3] = 1;
    }
  }
  // An out-of-range id gives a zero row, positional term included (vocab-parallel ranks
  // sum their rows: each token's is then added by the one rank holding its id).
  const bool learned = POS == static_cast<int>(PosEncoding::kLearned) && id_ok && p >= 0 && p < num_positions;
  const bool sinusoidal = POS == static_cast<int>(PosEncoding::kSinusoidal) && id_ok;
  // 64-bit row offsets: token * dim exceeds 2^31 on large batches.
  const T* w_row = weight + (id_ok ? id : 0) * dim;
  const T* p_row = learned ? pos_weight + p * dim : nullptr;
  T* o_row = out + token * dim;
  const uint64_t drop_seed = DROPOUT ? static_cast<uint64_t>(dropout.key[0]) : 0;
  const uint64_t drop_offset = DROPOUT ? static_cast<uint64_t>(dropout.key[1]) : 0;

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
      // Columns 2k and 2k + 1 of the encoding are the sine and cosine of pair k; the table's
      // column 0 is the encoding's (even) column sinusoid_column_offset.
      if constexpr (VEC % 2 == 0) {
        // j is a multiple of VEC: this thread's columns are VEC / 2 whole pairs, known at
        // compile time (a test per element of whether its pair was done made nvcc emit a
        // sine and cosine per element, behind branches, and cost ~16 integer instructions
        // per pair: about a quarter of the bf16 kernel's work).
        const int64_t first_pair = (sinusoid_column_offset + j) >> 1;
#pragma unroll
        for (int k = 0; k < VEC / 2; ++k) {
          A s, c;
          pair_sincos<T>(sinusoid_angle(p, first_pair + k, neg_log_base_over_dim), &s, &c);
          x[2 * k] += s;
          x[2 * k + 1] += c;
        }
      } else {  // one element: the sine or the cosine of its pair
        A s, c;
        pair_sincos<T>(sinusoid_angle(p, (sinusoid_column_offset + j) >> 1, neg_log_base_over_dim), &s, &c);
        x[0] += (j & 1) ? c : s;
      }
    }
    if constexpr (DROPOUT) {
      // Element e is word e % 4 of its group e / 4's Philox call (one call per group).
      const A keep_scale = static_cast<A>(dropout.scale);
      if constexpr (VEC % 4 == 0) {
        // j is a multiple of VEC: VEC / 4 whole groups, known at compile time (as the
        // sinusoid's pairs above).
#pragma unroll
        for (int g = 0; g < VEC / 4; ++g) {
          const unsigned bits = dropout_keep_bits(drop_seed, drop_offset, token, (j >> 2) + g, dropout.threshold);
#pragma unroll
          for (int w = 0; w < 4; ++w) x[4 * g + w] = (bits >> w) & 1u ? x[4 * g + w] * keep_scale : A(0);
        }
      } else {  // one or two elements (j a multiple of VEC): within one group
        const unsigned bits = dropout_keep_bits(drop_seed, drop_offset, token, j >> 2, dropout.threshold);
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = (bits >> ((j + i) & 3)) & 1u ? x[i] * keep_scale : A(0);
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

// The output gradient as the dense backward's kernels read it: row `token` of `rows`
// (tokens x dim). With kDropout, through the forward's dropout: element (token, j) is
// kept as round_T(x / (1 - p)) if its Philox bit was kept in the forward, else 0 -- what
// the forward kernel stored when it masked the whole gradient before the backward (ids
// 0..N-1: the same bits), now regenerated from the key as each element is read, so dout
// is read once instead of read, masked, written and read again (~35 us of an H100's GPT-2
// 8x2048 fp32 backward, and an N x d buffer). A kernel calls start() once to read the key.
template <typename T, bool kDropout>
struct Dout {
  using A = acc_t<T>;
  static constexpr bool kMasked = kDropout;  // for a caller holding a Dout of either form (with_dout)
  const T* rows;
  int64_t dim;
  Dropout dropout;  // kDropout: the key [seed, offset] on the device, the threshold and 1 / (1 - p)
  uint64_t seed = 0, offset = 0;

  __device__ __forceinline__ void start() {
    if constexpr (kDropout) {
      seed = static_cast<uint64_t>(dropout.key[0]);
      offset = static_cast<uint64_t>(dropout.key[1]);
    }
  }

  // Elements j .. j + VEC - 1 of row `token` (j a multiple of VEC), in A.
  template <int VEC>
  __device__ __forceinline__ void load(int64_t token, int64_t j, A (&x)[VEC]) const {
    load_pack<VEC>(rows + token * dim + j, x);
    if constexpr (kDropout) apply<VEC>(keep_bits<VEC>(token, j), x);
  }

  // Which of elements j .. j + VEC - 1 of row `token` the forward kept (bit i: element
  // j + i), and no other bit (finish_segments packs several rows' bits into one word):
  // element e is word e % 4 of its group e / 4's Philox call, as the forward draws it.
  template <int VEC>
  __device__ __forceinline__ unsigned keep_bits(int64_t token, int64_t j) const {
    if constexpr (VEC % 4 == 0) {  // VEC / 4 whole groups
      unsigned bits = 0;
#pragma unroll
      for (int g = 0; g < VEC / 4; ++g) {
        bits |= dropout_keep_bits(seed, offset, token, (j >> 2) + g, dropout.threshold) << (4 * g);
      }
      return bits;
    } else {  // one or two elements: within one group, the group's other bits masked off
      return (dropout_keep_bits(seed, offset, token, j >> 2, dropout.threshold) >> (j & 3)) & ((1u << VEC) - 1u);
    }
  }

  // x (as loaded) through keep bits: a kept element becomes round_T(x / (1 - p)), the rest 0.
  template <int VEC>
  __device__ __forceinline__ void apply(unsigned bits, A (&x)[VEC]) const {
    const A keep_scale = static_cast<A>(dropout.scale);
#pragma unroll
    for (int i = 0; i < VEC; ++i) x[i] = (bits >> i) & 1u ? static_cast<A>(static_cast<T>(x[i] * keep_scale)) : A(0);
  }
};

// The key the sort sees for `key`: a used one as it is, every other one as num_rows (sorted
// after all used ones); and the starting value of segment bound r.
__device__ __forceinline__ int64_t sort_key(int64_t key, int64_t num_rows, int64_t skip) {
  return used_key(key, num_rows, skip) ? key : num_rows;
}

__device__ __forceinline__ int64_t first_bound(int64_t r, int64_t num_zeros) { return r < num_zeros ? 0 : -1; }

// What the sort needs, in one launch: the keys it sees -- a used key as it is, every other
// one as num_rows (sorted after all used ones), in K: 32 bits when the table allows --
// the values it carries (each token's index), and the segment bounds' starting values:
// `num_zeros` zeros (begin, end, first token: empty ranges where no segment lands, whose
// first token is read but unused), then -1 up to `num_bounds` (the slots' keys: -1 marks a
// slot no segment lands in).
template <typename index_t, typename K>
__global__ void sort_inputs_kernel(const index_t* __restrict__ keys, int64_t n, int64_t num_rows, int64_t skip,
                                   K* __restrict__ out, int64_t* __restrict__ iota, int64_t* __restrict__ bounds,
                                   int64_t num_zeros, int64_t num_bounds) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r < num_bounds) bounds[r] = first_bound(r, num_zeros);
  if (r >= n) return;
  out[r] = static_cast<K>(sort_key(static_cast<int64_t>(keys[r]), num_rows, skip));
  iota[r] = r;
}

// The word sort, for 0 < n <= 2^14 tokens over keys of at most 18 bits (GPT-2, BERT,
// Llama-2 and Llama-3 tables up to 8x2048 tokens): each position r travels in the low 14
// bits of its key's 32-bit word, (key << 14) | r. The words are distinct, so ordering them
// orders the keys stably with no values beside them, and a word's sorted position is the
// number of words below it. The tile sort (the default) uses them: tile_rank_kernel places
// each word within its tile of kSortTile positions by counting the tile's words below it,
// merge_tiles_kernel places it among all of them by adding its lower bounds in the other
// tiles, which are sorted by then. Every SM busy: two launches (one for a single tile), the
// first also setting the segment bounds' starting values. The triton backend's sort
// (kernels/embedding.py), the same words. (A one-block sort -- CUB's block radix sort of the
// words in shared memory, one SM, in the launch setting the sort's inputs -- was timed
// beside it until the H200 run at 82eabd8: the dense backward op graphed, GPT-2 fp32 / bf16
// 123 / 92 us against the tile sort's 107 / 77, Llama-3 648 / 447 against 633 / 431.)
constexpr int kWordPositionBits = 14;
constexpr int64_t kWordSortMax = int64_t(1) << kWordPositionBits;
constexpr int kWordKeyBits = 32 - kWordPositionBits;  // keys below 2^18 (Llama-3's 128256 rows: 17 bits)

inline bool fits_word_sort(int64_t n, int64_t bits) { return n > 0 && n <= kWordSortMax && bits <= kWordKeyBits; }

template <typename index_t>
__device__ __forceinline__ uint32_t sort_word(const index_t* __restrict__ ids, int r, int n, int64_t num_rows,
                                              int64_t skip) {
  const uint32_t key = r < n ? static_cast<uint32_t>(sort_key(static_cast<int64_t>(ids[r]), num_rows, skip)) : ~0u;
  return key << kWordPositionBits | static_cast<uint32_t>(r);
}

// Sorted position r (< n) of the sorted words: its key and its token.
__device__ __forceinline__ void store_sort_word(uint32_t word, int r, int32_t* __restrict__ sorted,
                                                int64_t* __restrict__ order) {
  sorted[r] = static_cast<int32_t>(word >> kWordPositionBits);
  order[r] = word & ((1u << kWordPositionBits) - 1);
}

// 512 positions a tile: a word's rank in its tile is 512 comparisons, each a load every
// thread of the warp makes at once (one broadcast), and its place among 32 tiles at most
// is 32 lower bounds of 10 steps (the triton backend's sizes).
constexpr int kSortTile = 512;
constexpr int kSortMaxTiles = static_cast<int>(kWordSortMax / kSortTile);
// Threads a block of tile_rank_kernel / merge_tiles_kernel: one a word, so 8x2048 tokens
// in kThreadsPerBlock's 256 would be 64 blocks, half of an H100's 132 SMs idle; these make
// 128 / 256 blocks (a rank thread's loop is long, a merge thread's loads latency-bound).
constexpr int kRankThreads = 128, kMergeThreads = 64;
static_assert(kSortTile % kRankThreads == 0, "a rank block lies within one tile");

// A thread's share of a loop over [0, count) that its block's threads run between them
// (for i = first; i < count; i += stride): every blockDim.x-th index from threadIdx.x.
// Under host emulation each thread runs alone with its own `__shared__` memory
// (host_emulation.h), so it runs the whole loop itself.
struct BlockShare {
  int first, stride;
};

__device__ __forceinline__ BlockShare block_share() {
#ifdef __CUDACC__
  return {static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x)};
#else
  return {0, 1};
#endif
}

// Blocks [0, rank_blocks): word r stored at its tile's start plus the number of the tile's
// words below it -- with a single tile (n <= kSortTile) that is the sort, stored as keys
// and tokens, else `words`, each tile sorted, for merge_tiles_kernel. The blocks after
// set the segment bounds' starting values (sort_inputs_kernel's), one a thread.
//
// The tile's words are computed once a block, into shared memory, and each thread counts
// the words below its own there, four to a 16-byte load (every thread of a warp reads the
// same ones: a broadcast). Each thread computing its tile's 511 other words itself from
// the ids -- a load and ~20 dependent 64-bit instructions a word, with one warp per
// scheduler (128 blocks of 128 threads at 8x2048) -- took 27.1 us on the H200 at 26f0ba6
// (ncu), against triton's 7.1 for the same ranks. Positions past n in the last tile get
// sort_word's all-ones key, so they rank above every real word and are never counted.
template <typename index_t>
__global__ void tile_rank_kernel(const index_t* __restrict__ ids, int n, int64_t num_rows, int64_t skip,
                                 uint32_t* __restrict__ words, int32_t* __restrict__ sorted,
                                 int64_t* __restrict__ order, int64_t* __restrict__ bounds, int64_t num_zeros,
                                 int64_t num_bounds, int64_t rank_blocks) {
  if (blockIdx.x >= rank_blocks) {
    const int64_t b = (static_cast<int64_t>(blockIdx.x) - rank_blocks) * blockDim.x + threadIdx.x;
    if (b < num_bounds) bounds[b] = first_bound(b, num_zeros);
    return;
  }
  __shared__ __align__(16) uint32_t tile_words[kSortTile];
  const int r = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  const int tile_start = r - r % kSortTile;
  const BlockShare share = block_share();
  for (int i = share.first; i < kSortTile; i += share.stride) {
    tile_words[i] = sort_word(ids, tile_start + i, n, num_rows, skip);
  }
  __syncthreads();
  if (r >= n) return;
  const uint32_t word = tile_words[r - tile_start];
  int below = 0;
#pragma unroll 8
  for (int q = 0; q < kSortTile / 4; ++q) {
    const uint4 others = reinterpret_cast<const uint4*>(tile_words)[q];
    below += (others.x < word) + (others.y < word) + (others.z < word) + (others.w < word);
  }
  if (n <= kSortTile) {
    store_sort_word(word, below, sorted, order);
  } else {
    words[tile_start + below] = word;
  }
}

// Words in tile t of n sorted words: kSortTile but in the last tile, <= 0 past it.
__device__ __forceinline__ int tile_length(int t, int tiles, int n) {
  return t < tiles - 1 ? kSortTile : n - t * kSortTile;
}

// Word i of `words` (each tile sorted: tile_rank_kernel) stored at its sorted position: the
// sum over the tiles of its lower bound in each (in its own tile, its index there). Each
// bound is a branch-free binary search, the tiles' searches side by side: every step loads
// one probe of each tile first (never out of its tile, so unconditionally), then compares,
// so a thread has 32 loads in flight where one search would have one. The words (4 bytes a
// token) stay in L2, and the 32 threads of a warp hold neighbouring words of one tile, so
// their searches in another tile share their first steps' probes.
__global__ void merge_tiles_kernel(const uint32_t* __restrict__ words, int n, int32_t* __restrict__ sorted,
                                   int64_t* __restrict__ order) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i >= n) return;
  const uint32_t word = words[i];
  const int tiles = (n + kSortTile - 1) / kSortTile;
  int below[kSortMaxTiles];  // in tile t: how many of its words are below `word`
#pragma unroll
  for (int t = 0; t < kSortMaxTiles; ++t) below[t] = 0;
#pragma unroll 1
  for (int step = kSortTile; step > 0; step /= 2) {  // 512 too: a whole tile may be below
    uint32_t probe[kSortMaxTiles];
#pragma unroll
    for (int t = 0; t < kSortMaxTiles; ++t) {
      const int length = tile_length(t, tiles, n);
      const int next = below[t] + step;
      probe[t] = t < tiles ? words[t * kSortTile + (next < length ? next : length) - 1] : 0u;
    }
#pragma unroll
    for (int t = 0; t < kSortMaxTiles; ++t) {
      if (below[t] + step <= tile_length(t, tiles, n) && probe[t] < word) below[t] += step;
    }
  }
  int rank = 0;
#pragma unroll
  for (int t = 0; t < kSortMaxTiles; ++t) rank += below[t];
  store_sort_word(word, rank, sorted, order);
}

// An environment variable's value, "" when unset: the host code's A/B settings.
inline std::string_view env_setting(const char* name) {
  const char* value = std::getenv(name);
  return value == nullptr ? std::string_view() : std::string_view(value);
}

// Whether sorted_segments uses the tile sort where a word sort fits: yes, unless
// PYEMBED_CUDA_SORT=cub asks for CUB's device sort everywhere (the sort past 2^14 tokens,
// so that tests reach it with few; read by every call: a getenv, well under a microsecond).
inline bool tile_sort_requested() { return env_setting("PYEMBED_CUDA_SORT") != "cub"; }

// starts[r] = 1 where sorted position r begins a segment: a used key (< num_rows, after
// sort_inputs) unlike the previous one. Its inclusive scan numbers the segments: scan[r]
// - 1 is the slot of r's (sparse gradients; a dense one numbers segments by their key).
template <typename K>
__global__ void segment_starts_kernel(const K* __restrict__ sorted, int64_t n, int64_t num_rows,
                                      int64_t* __restrict__ starts) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= n) return;
  const int64_t key = sorted[r];
  starts[r] = key < num_rows && (r == 0 || sorted[r - 1] != sorted[r]);
}

// The first of n sorted positions holding a key >= key (sorted[0, n) is non-decreasing).
template <typename K>
__device__ __forceinline__ int64_t lower_bound(const K* __restrict__ sorted, int64_t n, int64_t key) {
  int64_t lo = 0, hi = n;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (static_cast<int64_t>(sorted[mid]) < key) lo = mid + 1; else hi = mid;
  }
  return lo;
}

// acc += the dout rows src_rows[r], r in [r0, r1), added in order in the compute dtype A
// (the result does not depend on scheduling), at this thread's columns j .. j + VEC - 1.
template <int VEC, typename T, bool kDropout, typename A>
__device__ __forceinline__ void add_rows(const Dout<T, kDropout>& dout, const int64_t* __restrict__ src_rows,
                                         int64_t r0, int64_t r1, int64_t j, A (&acc)[VEC]) {
#pragma unroll 4
  for (int64_t r = r0; r < r1; ++r) {
    A x[VEC];
    dout.template load<VEC>(src_rows[r], j, x);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += x[i];
  }
}

// d_row = factor * (sum of dout rows src_row(r), r in [r0, r1)), from +0. This thread's columns only.
template <int VEC, typename T, bool kDropout, typename D, typename A>
__device__ __forceinline__ void sum_rows(const Dout<T, kDropout>& dout, const int64_t* __restrict__ src_rows,
                                         int64_t r0, int64_t r1, D* __restrict__ d_row, A factor, int64_t dim) {
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = A(0);
    add_rows<VEC>(dout, src_rows, r0, r1, j, acc);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= factor;
    store_pack<VEC>(d_row + j, acc);
  }
}

// A long segment's piece (chunk_kernel): sum_rows, with the loads of kPieceRowsInFlight rows
// issued before any of them is added. The adds keep their order, so the sum is sum_rows'
// bit for bit. One row at a time, a piece of kChunkRows rows was as many dependent round
// trips to memory: the H200 at e204d9e (ncu, GPT-2 8x2048 fp32, a 12000-use row) ran
// chunk_kernel in 61 us at 13% of DRAM bandwidth -- one block per chunk, 9% occupancy, so
// only more loads in flight per thread could help. Rows are held as loaded (Pack<T>), 8 at
// a time: 16 took sm_90's bf16 kernels to 228 registers (one block per SM for the whole
// kernel, whose first part is a pass over every sorted position) and past 255 with dropout
// (spills). finish_segments, whose occupancy counts more, keeps sum_rows.
//
// A batch's rows are loaded from tokens already held: the next batch's tokens are loaded
// behind its rows (clamped to the piece: no predicate), the whole batches first, the last
// rows after them. Loading a batch's 8 tokens, then its rows, each under a `token >= 0`
// predicate, took two round trips a batch at best; and ptxas (sm_90 SASS of the fp32
// kernel) issued each token's load just before its row's and each row's after the previous
// row's add, to stay at ~70 registers -- a chain of round trips (chunk_kernel's launch bound
// now lifts that), and with a predicate a row, under that bound, the 8th row's load still
// waited for the 1st row's add (sm_90 has 7 predicate registers). Now a batch is its 8 row
// loads and the next 8 tokens' (loaded_here keeps NVVM from loading one of them again
// beside its row), then the adds: one round trip. At 26f0ba6 (H200, ncu, GPT-2 8x2048 fp32
// with a 12000-use row) chunk_kernel took 39.8 us, `triton`'s, whose tokens run ahead of
// its rows (num_stages), 25.2. Not measured on a GPU yet.
constexpr int kPieceRowsInFlight = 8;

// An empty asm that takes v: v is computed before this point and kept in a register from
// there, not loaded again later. (NVVM carried one of sum_piece's 8 prefetched tokens
// across the loop as its address and loaded it again beside its row's load, chaining that
// row to it.) The host emulation's compiler takes the same statement.
__device__ __forceinline__ void loaded_here(int64_t v) {
#ifdef __CUDA_ARCH__
  asm volatile("" : : "l"(v));
#else
  asm volatile("" : : "r"(v));
#endif
}

template <int VEC, typename T, bool kDropout, typename A>
__device__ __forceinline__ void add_piece_row(const Dout<T, kDropout>& dout, const Pack<T, VEC>& row,
                                              int64_t token, int64_t j, A (&acc)[VEC]) {
  A x[VEC];
#pragma unroll
  for (int i = 0; i < VEC; ++i) x[i] = static_cast<A>(row.val[i]);
  if constexpr (kDropout) dout.template apply<VEC>(dout.template keep_bits<VEC>(token, j), x);
#pragma unroll
  for (int i = 0; i < VEC; ++i) acc[i] += x[i];
}

// Rows [r0, r1) of the piece, r0 < r1.
template <int VEC, typename T, bool kDropout, typename A>
__device__ __forceinline__ void sum_piece(const Dout<T, kDropout>& dout, const int64_t* __restrict__ src_rows,
                                          int64_t r0, int64_t r1, A* __restrict__ d_row, int64_t dim) {
  constexpr int kRows = kPieceRowsInFlight;
  const int64_t batches_end = r0 + (r1 - r0) / kRows * kRows, last = r1 - 1;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = A(0);
    int64_t token[kRows];  // of rows r .. r + kRows - 1 (past the piece: its last row's)
#pragma unroll
    for (int k = 0; k < kRows; ++k) token[k] = src_rows[r0 + k < last ? r0 + k : last];
    for (int64_t r = r0; r < batches_end; r += kRows) {
      Pack<T, VEC> row[kRows];
      int64_t held[kRows];
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        held[k] = token[k];
        row[k] = *reinterpret_cast<const Pack<T, VEC>*>(dout.rows + held[k] * dim + j);
      }
#pragma unroll
      for (int k = 0; k < kRows; ++k) {
        token[k] = src_rows[r + kRows + k < last ? r + kRows + k : last];
        loaded_here(token[k]);
      }
#pragma unroll
      for (int k = 0; k < kRows; ++k) add_piece_row<VEC>(dout, row[k], held[k], j, acc);
    }
#pragma unroll
    for (int k = 0; k < kRows - 1; ++k) {  // the rows after the whole batches, in order
      if (batches_end + k >= r1) break;
      add_piece_row<VEC>(dout, *reinterpret_cast<const Pack<T, VEC>*>(dout.rows + token[k] * dim + j), token[k], j,
                         acc);
    }
    store_pack_whole<VEC>(d_row + j, acc);  // float64 partials were split in two
  }
}

// The sorted positions are cut into chunks of kChunkRows. A segment longer than a chunk
// (a hot row: 12000 uses must not be summed by one thread group) is summed in pieces, one
// per chunk it touches, and its row then adds the pieces' partial sums, in order. A
// chunk holds at most two such pieces: the one at its first position (partial slot 2c)
// and, when another segment reaches its last position, that one's (slot 2c + 1). So a
// long segment [b, e) has its pieces in slot 2c of every chunk c it touches, except the
// first when it starts inside that chunk (slot 2c + 1 there).
__device__ __forceinline__ int64_t first_piece_slot(int64_t b) {
  return b % kChunkRows == 0 ? 2 * (b / kChunkRows) : 2 * (b / kChunkRows) + 1;
}

// Chunk c of the sorted positions: (1) the segment bounds of its positions -- each
// segment's [begin, end) written by the threads at its edges, at slot scan[r] - 1
// (numbered segments, with their key) or at the key itself (`scan` nullptr: a dense
// gradient, one entry per table row), and its first token (order[begin]: what a one-token
// segment's row is, so finish_segments reads it beside the bounds instead of after them);
// with `solo` (by token, -1 from sort_inputs), the key of each token that is its segment's
// only one (PositionSums); (2) the partial sums of its long-segment pieces (`partials`
// nullptr when no segment can be longer than a chunk).
//
// Bounded to two blocks of kThreadsPerBlock an SM (up to 128 registers; one with dropout,
// whose Philox state spilled at 128): under no bound ptxas kept sum_piece's registers to
// ~70 by issuing each row's load behind the previous row's add (sm_90 SASS: a round trip
// a row); bounded, a batch's 8 row loads and the next 8 tokens' go out before any add.
template <typename K, typename T, typename A, int VEC, bool kDropout>
__global__ void __launch_bounds__(kThreadsPerBlock, kDropout ? 1 : 2)
    chunk_kernel(const K* __restrict__ sorted, const int64_t* __restrict__ scan, int64_t n,
                 int64_t num_rows, int64_t* __restrict__ keys, int64_t* __restrict__ begin,
                 int64_t* __restrict__ end, int64_t* __restrict__ first, int64_t* __restrict__ solo,
                 Dout<T, kDropout> dout, const int64_t* __restrict__ order, A* __restrict__ partials,
                 int64_t num_chunks, int64_t dim) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (c >= num_chunks) return;
  const int64_t c0 = c * kChunkRows, c1 = c0 + kChunkRows < n ? c0 + kChunkRows : n;
  for (int64_t r = c0 + threadIdx.x; r < c1; r += blockDim.x) {
    const int64_t key = sorted[r];
    if (key >= num_rows) continue;  // an unused key (sort_inputs)
    const int64_t s = scan != nullptr ? scan[r] - 1 : key;
    const bool starts = r == 0 || sorted[r - 1] != sorted[r], ends = r == n - 1 || sorted[r + 1] != sorted[r];
    if (starts) {
      begin[s] = r;
      first[s] = order[r];
      if (keys != nullptr) keys[s] = key;
    }
    if (ends) end[s] = r + 1;
    if (starts && ends && solo != nullptr) solo[order[r]] = key;
  }
  if (partials == nullptr) return;
  dout.start();
  // Where the chunk's first run stops and its last run starts (searches within the chunk);
  // whether their segments are longer than a chunk, from one key outside each run.
  const int64_t head = sorted[c0], tail = sorted[c1 - 1];
  if (head < num_rows) {
    const int64_t stop = c0 + lower_bound(sorted + c0, c1 - c0, head + 1);
    const bool continues = stop == c1 && c1 < n && sorted[c1] == head;
    if (continues || (stop > kChunkRows && sorted[stop - kChunkRows - 1] == head)) {
      sum_piece<VEC>(dout, order, c0, stop, partials + 2 * c * dim, dim);
    }
  }
  if (tail != head && tail < num_rows) {
    const int64_t start = c0 + lower_bound(sorted + c0, c1 - c0, tail);
    if (start + kChunkRows < n && sorted[start + kChunkRows] == tail) {
      sum_piece<VEC>(dout, order, start, c1, partials + (2 * c + 1) * dim, dim);
    }
  }
}

// Learned positions with p = offset + t (no position_ids): row p of their gradient is
// the sum over b of dout[b, t], b ascending, for the `steps` positions the sequence
// reaches, and zeros in every other row. The token table's last kernel writes them too,
// in blocks of its own launch: one launch less per backward; batch_sum_kernel alone when
// the table needs no gradient. In finish_segments_kernel they come first: a position block
// reads `batch` rows of dout (and writes the one-token rows below), a table block's rows
// are mostly one load or none, so the long blocks start first and the short ones fill in
// around them, instead of running last, as a tail, with the GPU otherwise idle (not yet
// measured on a GPU). In few_tokens_gradient_kernel, whose position blocks read a row or
// two, last: a test of both bounds took its fp32 form from 64 registers to 70. (The triton
// backend keeps its position programs last: the same reordering made Triton spill 8-24 B
// in some of _finish_segments_kernel's specialisations.)
//
// Those blocks read every token's dout row, and so did the table's blocks: dout twice. At
// the H100 run of d81f5b2 that second read was ~50 of the ~260 MB finish_segments moved
// at GPT-2 8x2048 fp32 (~99 us, about copy bandwidth: the kernel was not slow, it moved
// too much). So when they reach every token (steps == seq_len), the position blocks also
// write the table row of each token that is its row's only one (`solo`, from chunk_kernel),
// from the dout row they hold, and the table's blocks skip those rows: at 8x2048 over
// GPT-2's rows 72% of the tokens (88% at Llama-3's) are read once, not twice. The row is
// the same expression as the table's blocks write, so the same bits.
template <typename T>
struct PositionSums {
  T* out = nullptr;  // (rows, dim); nullptr: no positional gradient in this launch
  int64_t rows = 0, batch = 0, seq_len = 0, steps = 0, offset = 0;
  // Blocks [first_block, first_block + blocks) write `out`: the first ones (first_block 0) or
  // the last ones (blocks: up to the launch's end) -- add_position_blocks.
  int64_t first_block = 0, blocks = 0;
  // Per token: its table row when the token is that row's only one, else -1; nullptr: the
  // table's blocks write every row (finish_segments sets it from SortedSegments::solo).
  const int64_t* solo = nullptr;
};

// The sizes of PositionSums for a batch of `ids` ((B, T) or (T,)) over `rows` learned
// positions from `offset` (out not set): the positions' gradient kernels and their update.
template <typename T>
PositionSums<T> position_sums(int64_t rows, const at::Tensor& ids, int64_t offset) {
  PositionSums<T> pos;
  const int64_t num_tokens = ids.numel(), seq_len = num_tokens > 0 ? ids.size(-1) : 0;
  pos.rows = rows;
  pos.batch = seq_len > 0 ? num_tokens / seq_len : 0;
  pos.seq_len = seq_len;
  pos.steps = std::clamp<int64_t>(rows - offset, 0, seq_len);
  pos.offset = offset;
  return pos;
}

// Rows of dout a position row's thread loads before adding any (the batch's rows at its
// position; the adds keep their order: the same sums), in finish_segments_kernel's forms
// with 16-byte accesses and no dropout. There the loop also writes the table's one-token
// rows (kSolo), and the compiler cannot tell those stores from the next row's load: one
// row at a time, each load waits for the store before it, batch-many dependent round
// trips to memory per column pass -- at 8x2048 the 2048 position blocks come first and
// hold the SMs alone for several waves (Llama-3 bf16 is where the dense backward is
// furthest from its bytes floor). bf16: four rows (sm_90: 66 registers with one, 76 with
// four and store_pack_whole: 4 blocks of 192 or 3 of 256 threads per SM either way); fp32:
// two (62 -> 60; four took 72, a block fewer per SM). fp16 (64: any more is a block fewer
// per SM), one element a thread (48 -> 56) and the dropout kernels (they spilled) keep one.
template <typename T, int VEC, bool kSolo, bool kDropout>
constexpr int position_rows_in_flight() {
  if constexpr (!kSolo || kDropout || VEC == 1) return 1;
  return std::is_same_v<T, c10::BFloat16> ? 4 : std::is_same_v<T, float> ? 2 : 1;
}

// Row p of pos.out, this thread's columns. kSolo: the launch may write one-token rows
// (pos.solo, checked at run time) into `table`, scaled by `scale`, as the table's blocks
// would; the kernels that never do are compiled without that path (it took the bf16
// few_tokens_gradient_kernel from 64 registers to 72).
template <int VEC, bool kSolo, typename T, bool kDropout>
__device__ __forceinline__ void position_sum_row(const Dout<T, kDropout>& dout, const PositionSums<T>& pos, int64_t p,
                                                 int64_t dim, T* table, acc_t<T> scale) {
  using A = acc_t<T>;
  constexpr int kInFlight = position_rows_in_flight<T, VEC, kSolo, kDropout>();
  if (p >= pos.rows) return;
  const int64_t t = p - pos.offset;
  const int64_t count = t >= 0 && t < pos.steps ? pos.batch : 0;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] = A(0);
    for (int64_t b0 = 0; b0 < count; b0 += kInFlight) {
      A x[kInFlight][VEC];
      int64_t solo_row[kInFlight];
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) {
        const int64_t token = (b0 + k) * pos.seq_len + t;
        const bool inside = b0 + k < count;
        solo_row[k] = inside && kSolo && pos.solo != nullptr ? pos.solo[token] : -1;
        if (inside) dout.template load<VEC>(token, j, x[k]);
      }
#pragma unroll
      for (int k = 0; k < kInFlight; ++k) {
        if (b0 + k >= count) break;
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] += x[k][i];
        if (solo_row[k] >= 0) {  // as finish_segments_kernel writes a one-token row
          A row[VEC];
#pragma unroll
          for (int i = 0; i < VEC; ++i) row[i] = (A(0) + x[k][i]) * scale;
          store_pack_whole<VEC>(table + solo_row[k] * dim + j, row);
        }
      }
    }
    store_pack<VEC>(pos.out + p * dim + j, acc);
  }
}

// This block's rows of pos.out, if it is one of the blocks that write them (blockDim.y rows
// each): the launch's first blocks (kFirst) or its last ones, one bound to test either way.
template <int VEC, bool kSolo, bool kFirst, typename T, bool kDropout>
__device__ __forceinline__ bool position_block(const Dout<T, kDropout>& dout, const PositionSums<T>& pos, int64_t dim,
                                               T* table = nullptr, acc_t<T> scale = 1) {
  const int64_t block = static_cast<int64_t>(blockIdx.x) - pos.first_block;
  if (kFirst ? block >= pos.blocks : block < 0) return false;
  position_sum_row<VEC, kSolo>(dout, pos, block * blockDim.y + threadIdx.y, dim, table, scale);
  return true;
}

// acc = long segment [b, e)'s pieces' partial sums (chunk_kernel), added in order, at this
// thread's columns j .. j + VEC - 1: its sum, for a segment longer than a chunk.
template <int VEC, typename A>
__device__ __forceinline__ void add_pieces(const A* __restrict__ partials, int64_t b, int64_t e, int64_t j,
                                           int64_t dim, A (&acc)[VEC]) {
  const int64_t first = first_piece_slot(b), last = 2 * ((e - 1) / kChunkRows);
  load_pack<VEC>(partials + first * dim + j, acc);
#pragma unroll 4
  for (int64_t slot = first - first % 2 + 2; slot <= last; slot += 2) {
    A x[VEC];
    load_pack<VEC>(partials + slot * dim + j, x);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] += x[i];
  }
}

// d_row = factor * add_pieces: sum_rows for a segment longer than a chunk. This thread's columns only.
template <int VEC, typename A, typename D>
__device__ __forceinline__ void sum_pieces(const A* __restrict__ partials, int64_t b, int64_t e,
                                           D* __restrict__ d_row, A factor, int64_t dim) {
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC];
    add_pieces<VEC>(partials, b, e, j, dim, acc);
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= factor;
    store_pack<VEC>(d_row + j, acc);
  }
}

// The segments of two or more tokens among group + k * groups (bit k of `longer`), one
// after another: factor * their sums, from their pieces where longer than a chunk. A loop,
// not unrolled, so their bounds are read again (from cache): bounds held per k, with k
// known at run time only, would live in local memory.
template <int kRows, int VEC, typename T, bool kDropout, typename A>
__device__ __forceinline__ void sum_longer_segments(const Dout<T, kDropout>& dout, const int64_t* __restrict__ order,
                                                    const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                                    const int64_t* __restrict__ end, T* __restrict__ out, A scale,
                                                    bool divide_by_count, unsigned longer, int64_t group,
                                                    int64_t groups, int64_t dim) {
#pragma unroll 1
  for (int k = 0; k < kRows; ++k) {
    if (!(longer >> k & 1u)) continue;
    const int64_t g = group + k * groups;
    const int64_t b = begin[g], e = end[g];
    T* d_row = out + g * dim;
    const A factor = divide_by_count ? scale / static_cast<A>(e - b) : scale;
    if (e - b <= kChunkRows) {
      sum_rows<VEC>(dout, order, b, e, d_row, factor, dim);
    } else {
      sum_pieces<VEC>(partials, b, e, d_row, factor, dim);
    }
  }
}

// Segments per thread group of finish_segments_kernel. A segment's sum is a chain of
// dependent loads -- its bounds, its first token's index (order), that token's dout row --
// and with one segment per thread group a warp had one 16-byte dout load in flight at a
// time: the H100 at a4a8951 ran the GPT-2 fp32 kernel at 64% of DRAM bandwidth, its warps
// stalled on those loads (long scoreboard: 28 of ~35 cycles per instruction). Each step
// of the chain is now issued for the group's segments together: kSegmentsPerGroup loads in
// flight where there was one. And the first token comes with the bounds (chunk_kernel
// writes it per segment), so a one-token segment's row is two dependent loads away, not
// three: a group's rows are stored only once its last load is back. (At d81f5b2 this
// launch still took ~99 us of GPT-2 fp32's ~129 us backward, both GPU backends alike: with
// the learned positions' blocks, which read dout a second time; PositionSums says more.)
constexpr int kSegmentsPerGroup = 4;

// out[g] = factor * (sum of the dout rows of segment g) for every segment g < num_segments,
// summed in sorted (= token) order, rounded once: factor = scale, or scale / (the
// segment's token count) with divide_by_count. A segment longer than a chunk adds its
// pieces' partial sums instead (chunk_kernel). An empty segment (an untouched row) is
// written as zeros with zero_empty (a dense gradient: every row written once, no fill
// before), else not at all. The first positions.blocks blocks write the learned
// positions' gradient instead (PositionSums; add_position_blocks with positions_first),
// and with positions.solo the one-token rows too, which the table's blocks leave alone.
//
// Each thread group writes kSegmentsPerGroup segments' rows in its first pass: those of
// at most one token -- the common case: 8x2048 uniform ids over GPT-2's 50257 rows leave
// 72% of the rows untouched and touch 85% of the others once -- its loads issued for every
// segment at once. The segments of two or more tokens are summed by the loop after it, one
// after another. Kept apart, the common pass holds a few registers per segment: with the
// longer segments' loops unrolled into it per segment the kernel took 118-174.
//
// The loop's segments are `groups` apart (segment group + k * groups), not consecutive:
// real text's frequent tokens are neighbouring ids (a tokenizer numbers them by frequency;
// Zipf ids at GPT-2 8x2048 give rows 12-15 145, 123, 119 and 102 uses), and a group of
// such rows summed them one after another, each a chain of dependent loads: the H200 at
// de2aee7 ran the dense backward op in 173 us with Zipf ids against 107 with uniform ones.
// Spread apart, each lands in another group, summed side by side (a segment's sum is the
// same either way, bit for bit). The first pass's segments are consecutive (`consecutive`:
// group * kSegmentsPerGroup + k): with them spread too (1b12bd6) the H200 at 26f0ba6 ran
// this kernel in 85.8 us at GPT-2 fp32 against 61.4 at de2aee7, whose groups were
// consecutive in both passes, and at Llama-3 bf16 -- 88% of the rows zeros -- at 55% of
// DRAM bandwidth: a block's stores then land in four rows far apart, its bounds' loads in
// four cache lines. PYEMBED_CUDA_FINISH_ROWS=spread (read each call) spreads the first pass
// too: at 82eabd8 (H200) consecutive was as fast or faster in every case (the dense backward
// op graphed, Llama-3 bf16 432 against 448 us, with Zipf ids 456 against 484; GPT-2 fp32
// within 1%). Kept, with `consecutive` a kernel argument: with the first pass's step the
// constant 1, ptxas laid the bounds' loads out otherwise, and the dropout kernel's bf16 form
// spilled at its 80 registers (sm_90).
template <typename T, typename A, int VEC, bool kDropout>
__device__ __forceinline__ void finish_segments_body(Dout<T, kDropout> dout, const int64_t* __restrict__ order,
                                                     const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                                     const int64_t* __restrict__ end,
                                                     const int64_t* __restrict__ first_token, T* __restrict__ out,
                                                     A scale, bool divide_by_count, bool zero_empty,
                                                     int64_t num_segments, int64_t dim, PositionSums<T> positions,
                                                     bool consecutive) {
  dout.start();
  if (position_block<VEC, /*kSolo=*/true, /*kFirst=*/true>(dout, positions, dim, out, scale)) return;
  constexpr int kRows = kSegmentsPerGroup;
  // token[k] of an empty segment, of one of two or more tokens, of one token whose row the
  // position blocks write (PositionSums::solo)
  constexpr int64_t kEmpty = -1, kLonger = -2, kByPositions = -3;
  const bool solo_by_positions = positions.solo != nullptr;
  const int64_t groups = (num_segments + kRows - 1) / kRows;
  const int64_t group = (static_cast<int64_t>(blockIdx.x) - positions.blocks) * blockDim.y + threadIdx.y;
  if (group >= groups) return;
  // The first pass's segment k: first_segment + k * segment_step.
  const int64_t first_segment = consecutive ? group * kRows : group, segment_step = consecutive ? 1 : groups;
  // Every segment's bounds and first token, all loads together, not a chain per segment
  // (the rows past num_segments read the last row's).
  int64_t length[kRows], token[kRows];  // token: of a one-token segment, else kEmpty / kLonger
  unsigned stores = 0;  // bit k: the pass below writes segment k's row (registers: a word, not a test per k)
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const bool past = first_segment + k * segment_step >= num_segments;
    const int64_t g = past ? num_segments - 1 : first_segment + k * segment_step;
    token[k] = first_token[g];
    length[k] = past ? 0 : end[g] - begin[g];
    if (!past && (length[k] == 1 ? !solo_by_positions : length[k] == 0 && zero_empty)) stores |= 1u << k;
  }
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    token[k] = length[k] == 1 ? (solo_by_positions ? kByPositions : token[k]) : length[k] == 0 ? kEmpty : kLonger;
  }
  // Bit k: segment group + k * groups has two or more tokens (the loop after the first
  // pass), known before that pass: with consecutive first segments these bounds are other
  // cache lines, loaded here beside the first pass's, not one round trip a k after it.
  unsigned longer = 0;
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t g = group + k * groups;
    if (g < num_segments && end[g] - begin[g] >= 2) longer |= 1u << k;
  }
  T* const group_out = out + first_segment * dim;  // segment k's row: group_out + k * segment_stride
  const int64_t segment_stride = segment_step * dim;
  // Whether the first pass stores a row of one token. A group that stores only untouched
  // rows' zeros -- with consecutive segments at 8x2048 uniform ids ~60% of Llama-3's groups
  // (88% of its rows untouched), ~27% of GPT-2's -- stores them without the code that loads,
  // masks, scales and converts rows: at Llama-3 bf16 the kernel ran at 50% of the SMs' issue
  // and 55% of DRAM bandwidth (the H200 at 26f0ba6, ncu), `triton`'s, which has such a
  // branch, at 24% / 74%. Not measured on a GPU yet. Only in the forms with 16-byte rows
  // and no dropout, and not for fp16: the dropout forms spilled (bf16, sm_90: 12 bytes),
  // fp16's went 62 -> 70 registers (a block of 256 fewer an SM), double's element-wise one
  // 48 -> 56; bf16 76 and fp32 56 at sm_90 as without it.
  constexpr bool kZeroBranch = !kDropout && sizeof(T) * VEC == 16 && !std::is_same_v<T, c10::Half>;
  bool sums = true;
  if constexpr (kZeroBranch) {
    sums = false;
#pragma unroll
    for (int k = 0; k < kRows; ++k) sums |= (stores >> k & 1u) && token[k] >= 0;
    if (!sums) {
      const A zeros[VEC] = {};  // +0, as the sums below store for an untouched row
      for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim;
           j += static_cast<int64_t>(blockDim.x) * VEC) {
#pragma unroll
        for (int k = 0; k < kRows; ++k) {
          if (stores >> k & 1u) store_pack<VEC>(group_out + k * segment_stride + j, zeros);
        }
      }
    }
  }
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; sums && j < dim;
       j += static_cast<int64_t>(blockDim.x) * VEC) {
    // With dropout, the rows' keep bits first, one row's Philox calls at a time: computed
    // beside the rows' loads, or unrolled, the kernel held Philox states and loaded rows at
    // once (96-124 registers for bf16 at sm_90, against 68 without dropout).
    static_assert(VEC * kRows <= 32, "the keep bits of a group's rows fill one word");
    unsigned keep = 0;  // row k's bits at VEC * k
    if constexpr (kDropout) {
#pragma unroll 1
      for (int k = 0; k < kRows; ++k) {
        int64_t t = token[0];  // token[k] without indexing by a run-time k (which would put token in memory)
#pragma unroll
        for (int i = 1; i < kRows; ++i) t = k == i ? token[i] : t;
        if (t >= 0) keep |= dout.template keep_bits<VEC>(t, j) << (VEC * k);
      }
    }
    Pack<T, VEC> row[kRows];  // as stored: half the registers of fp32 sums for bf16 / fp16
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (token[k] >= 0) row[k] = *reinterpret_cast<const Pack<T, VEC>*>(dout.rows + token[k] * dim + j);
    }
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (!(stores >> k & 1u)) continue;
      A x[VEC];
#pragma unroll
      for (int i = 0; i < VEC; ++i) x[i] = static_cast<A>(row[k].val[i]);
      if constexpr (kDropout) dout.template apply<VEC>(keep >> (VEC * k), x);
      A sum[VEC];
#pragma unroll  // 0 + x: a sum from zero (+0, never -0); an untouched row: +0, as a fill; scale / 1 = scale
      for (int i = 0; i < VEC; ++i) sum[i] = token[k] >= 0 ? (A(0) + x[i]) * scale : A(0);
      store_pack<VEC>(group_out + k * segment_stride + j, sum);
    }
  }
  sum_longer_segments<kRows, VEC>(dout, order, partials, begin, end, out, scale, divide_by_count, longer, group,
                                  groups, dim);  // `groups` apart
}

template <typename T, typename A, int VEC>
__global__ void finish_segments_kernel(Dout<T, false> dout, const int64_t* __restrict__ order,
                                       const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                       const int64_t* __restrict__ end, const int64_t* __restrict__ first_token,
                                       T* __restrict__ out, A scale, bool divide_by_count, bool zero_empty,
                                       int64_t num_segments, int64_t dim, PositionSums<T> positions, bool consecutive) {
  finish_segments_body<T, A, VEC>(dout, order, partials, begin, end, first_token, out, scale, divide_by_count,
                                  zero_empty, num_segments, dim, positions, consecutive);
}

// The same with the forward's dropout applied as dout is read. The keep bits' Philox
// calls hold registers of their own (~90 for bf16 at sm_90, against 68 without dropout):
// bounded so that three blocks fit an SM, as many as hold the bf16 kernel without dropout.
template <typename T, typename A, int VEC>
__global__ void __launch_bounds__(kThreadsPerBlock, 3)
    finish_segments_dropout_kernel(Dout<T, true> dout, const int64_t* __restrict__ order,
                                   const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                   const int64_t* __restrict__ end, const int64_t* __restrict__ first_token,
                                   T* __restrict__ out, A scale, bool divide_by_count, bool zero_empty,
                                   int64_t num_segments, int64_t dim, PositionSums<T> positions, bool consecutive) {
  finish_segments_body<T, A, VEC>(dout, order, partials, begin, end, first_token, out, scale, divide_by_count,
                                  zero_empty, num_segments, dim, positions, consecutive);
}

// finish_segments_kernel where the position blocks write every one-token row
// (PositionSums::solo: learned positions reaching every token, the benchmark's 8x2048 and a
// language model's training batch), chosen by PYEMBED_CUDA_FINISH_GROUP=4|8|16|8-last (rows a
// thread group; read by every call) for the forms without dropout over 16-byte fp32 / bf16
// rows, to be timed on a GPU against that kernel. There a table's thread group has no row
// of one token to load and store -- its first pass stores its untouched rows' zeros, and
// it sums the rows of two or more tokens `groups` apart -- so it needs of each row only
// whether it is untouched (end == begin: both zero) and whether it is longer: two loads a
// row, all issued together, then kRows rows' zeros. At 82eabd8 (H200, ncu) the kernel above
// ran at Llama-3 bf16 8x2048 -- 88% of the rows untouched, every group taking its zero branch
// -- at 60% of DRAM bandwidth, its warps waiting on loads 11 of every 17 cycles, four rows'
// zeros stored after each group's three loads a row; `triton`'s, whose programs there load
// sixteen rows' bounds at once (four four-row tiles), at 72% -- and its op took 406 us with
// one tile a program, 370 with two, 380 with four. Each segment is summed as in that kernel:
// the same bits.
// kPositionsFirst: the position blocks are the launch's first blocks, as in that kernel,
// or its last, as in `triton`'s (PYEMBED_CUDA_FINISH_GROUP=8-last): there the table's
// zeros go out first, and the position blocks' chains of row loads come after them.
template <typename T, typename A, int VEC, int kRows, bool kPositionsFirst>
__global__ void finish_segments_solo_kernel(Dout<T, false> dout, const int64_t* __restrict__ order,
                                            const A* __restrict__ partials, const int64_t* __restrict__ begin,
                                            const int64_t* __restrict__ end, T* __restrict__ out, A scale,
                                            bool divide_by_count, bool zero_empty, int64_t num_segments, int64_t dim,
                                            PositionSums<T> positions) {
  static_assert(kRows <= 32, "a group's rows are bits of a word");
  dout.start();
  if (position_block<VEC, /*kSolo=*/true, kPositionsFirst>(dout, positions, dim, out, scale)) return;
  const int64_t groups = (num_segments + kRows - 1) / kRows;
  const int64_t table_block = static_cast<int64_t>(blockIdx.x) - (kPositionsFirst ? positions.blocks : 0);
  const int64_t group = table_block * blockDim.y + threadIdx.y;
  if (group >= groups) return;
  unsigned untouched = 0, longer = 0;  // bit k: row group * kRows + k; segment group + k * groups
#pragma unroll
  for (int k = 0; k < kRows; ++k) {
    const int64_t g = group * kRows + k, h = group + k * groups;
    if (zero_empty && g < num_segments && end[g] == begin[g]) untouched |= 1u << k;
    if (h < num_segments && end[h] - begin[h] >= 2) longer |= 1u << k;
  }
  T* const group_out = out + group * kRows * dim;
  const A zeros[VEC] = {};  // +0, as the sums store for an untouched row
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; untouched != 0 && j < dim;
       j += static_cast<int64_t>(blockDim.x) * VEC) {
#pragma unroll
    for (int k = 0; k < kRows; ++k) {
      if (untouched >> k & 1u) store_pack<VEC>(group_out + k * dim + j, zeros);
    }
  }
  sum_longer_segments<kRows, VEC>(dout, order, partials, begin, end, out, scale, divide_by_count, longer, group,
                                  groups, dim);
}

// A dense gradient of at most kFewTokens tokens (a one-token step, a short batch) in one
// launch, no sort: each thread group owns few_rows<VEC>() consecutive rows of the table,
// reads every token's key and sums the dout rows of its own rows' tokens in token order --
// the order the sorted path sums a segment in, so both give the same bits. Every row
// written once (untouched rows as zeros). The sorted path is three kernels and CUB's
// eight GPU operations, all host cost when the batch is small; here each thread reads n
// keys (from cache: every thread reads the same ones) per few_rows rows it writes, which
// stays small next to writing them while n <= 32.
constexpr int64_t kFewTokens = 32;

// Rows per thread group: 8, or 4 for 8-element (bf16/fp16 16-byte) accesses -- at most
// 32 fp32 sums in registers (8 rows of 8 took 95 registers at sm_90: a quarter of the
// threads an SM holds, for a kernel that writes the whole table).
template <int VEC>
constexpr int few_rows() {
  return VEC >= 8 ? 4 : 8;
}

template <typename index_t, typename T, typename A, int VEC, bool kDropout>
__global__ void few_tokens_gradient_kernel(const index_t* __restrict__ keys, int64_t n, Dout<T, kDropout> dout,
                                           T* __restrict__ out, A scale, bool divide_by_count, int64_t num_rows,
                                           int64_t skip, int64_t dim, PositionSums<T> positions) {
  dout.start();
  if (position_block<VEC, /*kSolo=*/false, /*kFirst=*/false>(dout, positions, dim)) return;
  constexpr int kFewRows = few_rows<VEC>();
  const int64_t g0 = (static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y) * kFewRows;
  if (g0 >= num_rows) return;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[kFewRows][VEC] = {};
    int count[kFewRows] = {};  // n <= kFewTokens
    for (int64_t t = 0; t < n; ++t) {
      const int64_t key = static_cast<int64_t>(keys[t]), k = key - g0;
      if (k < 0 || k >= kFewRows || !used_key(key, num_rows, skip)) continue;
      A x[VEC];
      dout.template load<VEC>(t, j, x);
#pragma unroll
      for (int r = 0; r < kFewRows; ++r) {  // acc[k] with k known at run time only: registers stay registers
        if (r != k) continue;
        ++count[r];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[r][i] += x[i];
      }
    }
#pragma unroll
    for (int r = 0; r < kFewRows; ++r) {
      if (g0 + r >= num_rows) break;
      const A factor = divide_by_count && count[r] > 0 ? scale / static_cast<A>(count[r]) : scale;
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[r][i] = count[r] > 0 ? acc[r][i] * factor : A(0);  // +0, never -0
      store_pack<VEC>(out + (g0 + r) * dim + j, acc[r]);
    }
  }
}

// A sparse gradient's rows (the sparse backward, touched_rows) of at most kFewTokens
// tokens in one launch, no sort: slot s is the s-th smallest used key -- the sorted path's
// numbering -- with the sum of its tokens' dout rows in token order and the same factor,
// so the same bits. A thread finds its slot's key as s + 1 successive minima over the n
// keys (from cache: every thread reads the same few), then sums its columns. rows[s] is
// -1 for the slots past the used keys, whose values are not written.
template <typename index_t, typename T, typename A, int VEC, bool kDropout>
__global__ void few_tokens_slots_kernel(const index_t* __restrict__ keys, int64_t n, Dout<T, kDropout> dout,
                                        int64_t* __restrict__ rows, T* __restrict__ values, A scale,
                                        bool divide_by_count, int64_t slots, int64_t num_rows, int64_t skip,
                                        int64_t dim) {
  dout.start();
  const int64_t s = static_cast<int64_t>(blockIdx.x) * blockDim.y + threadIdx.y;
  if (s >= slots) return;
  int64_t key = -1;  // after r steps: the r-th smallest used key
  for (int64_t r = 0; r <= s; ++r) {
    int64_t next = INT64_MAX;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t k = static_cast<int64_t>(keys[t]);
      if (used_key(k, num_rows, skip) && k > key && k < next) next = k;
    }
    key = next;
  }
  if (key == INT64_MAX) key = -1;  // fewer than s + 1 used keys
  if (threadIdx.x == 0) rows[s] = key;
  if (key < 0) return;
  for (int64_t j = static_cast<int64_t>(threadIdx.x) * VEC; j < dim; j += static_cast<int64_t>(blockDim.x) * VEC) {
    A acc[VEC] = {};
    int64_t count = 0;
    for (int64_t t = 0; t < n; ++t) {
      if (static_cast<int64_t>(keys[t]) != key) continue;
      A x[VEC];
      dout.template load<VEC>(t, j, x);
#pragma unroll
      for (int i = 0; i < VEC; ++i) acc[i] += x[i];
      ++count;
    }
    const A factor = divide_by_count ? scale / static_cast<A>(count) : scale;
#pragma unroll
    for (int i = 0; i < VEC; ++i) acc[i] *= factor;
    store_pack<VEC>(values + s * dim + j, acc);
  }
}

// The learned positions' gradient alone (the token table needs none): every block a position block.
template <typename T, int VEC, bool kDropout>
__global__ void batch_sum_kernel(Dout<T, kDropout> dout, PositionSums<T> positions, int64_t dim) {
  dout.start();
  position_block<VEC, /*kSolo=*/false, /*kFirst=*/true>(dout, positions, dim);
}

// ------------------------------------------------------------------------- host side
// Rows of `dim` elements of T: blockDim.x threads cover a row VEC at a time, blockDim.y
// rows share a block. A row of `per_row` accesses takes the fewest passes of at most
// kThreadsPerBlock threads, spread evenly in whole warps: d = 768 fp32 (192 accesses) gets
// 192 threads, not 256 with a quarter idle. Rows under a warp share one (a power of two each).
//
// With min_rows_per_block rows a block (the forward's learned positions), narrower rows
// of whole warps, more passes over each: of the widths up to kThreadsPerBlock /
// min_rows_per_block, the one whose passes leave the fewest lanes idle (the widest of
// equals). Taking the widest alone gave d = 768 bf16 / fp16 (96 16-byte accesses) 64
// threads in two passes, the second with one of its two warps idle -- a quarter of the
// block's lanes over the row, where 32 threads make three full passes (and eight rows a
// block); the H200 at 26f0ba6 ran that forward at 77% of a graphed copy (GPT-2 bf16
// 8x2048, four rows a block), the fp32 one, 192 accesses in three full passes, at 91%.
struct RowGrid {
  dim3 grid, block;
};

inline RowGrid row_grid(int64_t rows, int64_t dim, int vec, int64_t min_rows_per_block = 1) {
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
  if (kThreadsPerBlock / tx < min_rows_per_block) {
    auto idle_lanes = [&](int64_t width) { return (per_row + width - 1) / width * width - per_row; };
    tx = std::max<int64_t>(kWarp, kThreadsPerBlock / min_rows_per_block / kWarp * kWarp);
    for (int64_t width = tx - kWarp; width >= kWarp; width -= kWarp) {
      if (idle_lanes(width) < idle_lanes(tx)) tx = width;
    }
  }
  const int64_t ty = std::max<int64_t>(1, kThreadsPerBlock / tx);
  const int64_t blocks = std::max<int64_t>(1, (rows + ty - 1) / ty);
  TORCH_CHECK(blocks < (int64_t(1) << 31), "pyembed: too many rows for one launch: ", rows);
  return {dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(tx), static_cast<unsigned>(ty))};
}

// g (over `units` rows or groups of rows of a table) extended by the blocks that write the
// learned positions' rows, when the launch writes them too (PositionSums): blockDim.y rows
// each, before the table's blocks (positions_first) or after them.
template <typename T>
RowGrid add_position_blocks(RowGrid g, int64_t units, PositionSums<T>& positions, bool positions_first) {
  const int64_t table_blocks = units > 0 ? g.grid.x : 0;
  const int64_t position_blocks = positions.out != nullptr ? (positions.rows + g.block.y - 1) / g.block.y : 0;
  const int64_t blocks = table_blocks + position_blocks;
  TORCH_CHECK(blocks < (int64_t(1) << 31), "pyembed: too many blocks for one launch: ", blocks);
  positions.first_block = positions_first ? 0 : table_blocks;
  positions.blocks = position_blocks;
  g.grid.x = static_cast<unsigned>(std::max<int64_t>(blocks, 1));
  return g;
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

// grad_out as the kernels read it, (tokens, d) rows in order: contiguous, checked against
// the token count and d rather than viewed as (tokens, d) (a view is an op the host pays for).
inline at::Tensor dout_rows_of(const at::Tensor& grad_out, int64_t num_tokens, int64_t dim) {
  TORCH_CHECK(grad_out.dim() > 0 && grad_out.size(-1) == dim && grad_out.numel() == num_tokens * dim,
              "pyembed: grad_out of shape ", grad_out.sizes(), " for ", num_tokens, " tokens of ", dim, " elements");
  return grad_out.contiguous();
}

// run(Dout<T, kDropout>) over dout's rows, kDropout = dropout.active(): the dense backward's
// kernels come in both forms (without dropout, the loads as they were).
template <typename T, typename F>
void with_dout(const at::Tensor& dout, const Dropout& dropout, F&& run) {
  if (dropout.active()) {
    run(Dout<T, true>{dout.data_ptr<T>(), dout.size(-1), dropout});
  } else {
    run(Dout<T, false>{dout.data_ptr<T>(), dout.size(-1), dropout});
  }
}

// Rows (tokens) per block of the forward with learned positions and no position_ids,
// whose slots run position-major (token_of_slot): a block's rows then share a positional
// row where the batch has as many sequences, and its thread rows read that row's same
// 16 bytes at about the same time -- from L1 after the first, if the SM's L1 serves them,
// where one token per block (row_grid's choice for d >= 256 elements a row) has every
// token read its positional row from L2: at Llama-3 8x2048 bf16 as many bytes as the
// table's rows (the H200 at 1b594a4: 87% of L2 throughput, 70% of DRAM's, 84% of copy
// bandwidth; Triton's kernel, whose programs hold 4 tokens of a position, 91% / 76% / 92%,
// with 26% of its loads L1 hits against the CUDA kernel's 3%). The H200 at 26f0ba6 (the
// op replayed from a CUDA graph, against a graphed copy; tests/gpu/profile_workload.py):
// four rows a block reached GPT-2 fp32 91% (one: 82%), bf16 77% (74%), Llama-3 bf16 88%
// (82%), but Llama-3 fp32 88% (91%): a 16 KB row keeps enough bytes in flight a block
// alone. So four rows or more where a row is at most 8 KB (row_grid: eight at d = 768 in
// 2-byte types), else one: at 82eabd8 the faster in each of those four cases again (graphed,
// GPT-2 fp32 28.2 against 30.9 us, bf16 14.4 against 17.0, Llama-3 bf16 74.1 against 79.1;
// Llama-3 fp32 141.0 against 144.5 at four).
constexpr int64_t kFourRowsMaxRowBytes = 8192;

inline int64_t forward_min_rows_per_block(PosEncoding mode, bool has_position_ids, int64_t row_bytes) {
  if (mode != PosEncoding::kLearned || has_position_ids) return 1;
  return row_bytes <= kFourRowsMaxRowBytes ? 4 : 1;
}

template <class Launch, typename T, typename index_t>
void launch_forward(const at::Tensor& ids, const at::Tensor& weight, const at::Tensor& pos_weight,
                    const at::Tensor& position_ids, PosEncoding mode, double scale, int64_t offset,
                    const Dropout& dropout, int64_t sinusoid_column_offset, int64_t sinusoid_dim,
                    int64_t* error_record, at::Tensor& out) {
  const int64_t num_tokens = ids.numel(), dim = weight.size(1);
  const T* pw = pos_weight.defined() ? pos_weight.data_ptr<T>() : nullptr;
  const int vec = vector_width<T>(dim, {weight.data_ptr(), pw, out.data_ptr()});
  const int64_t min_rows = forward_min_rows_per_block(mode, position_ids.defined(), dim * weight.element_size());
  const RowGrid g = row_grid(num_tokens, dim, vec, min_rows);
  const int64_t* pid = position_ids.defined() ? position_ids.data_ptr<int64_t>() : nullptr;
  const auto neg_log_base_over_dim = static_cast<acc_t<T>>(-std::log(10000.0) / static_cast<double>(sinusoid_dim));
  auto run = [&](auto pos, auto with_dropout) {
    constexpr int kPos = decltype(pos)::value;
    constexpr bool kDropout = decltype(with_dropout)::value;
    auto kernel = vec > 1 ? embedding_forward_kernel<T, index_t, 16 / sizeof(T), kPos, kDropout>
                          : embedding_forward_kernel<T, index_t, 1, kPos, kDropout>;
    Launch::run(g.grid, g.block, kernel, ids.data_ptr<index_t>(), weight.data_ptr<T>(), pw, pid, out.data_ptr<T>(),
                num_tokens, ids.dim() > 0 ? ids.size(-1) : int64_t(1), weight.size(0),
                pos_weight.defined() ? pos_weight.size(0) : int64_t(0), dim, static_cast<acc_t<T>>(scale), offset,
                neg_log_base_over_dim, sinusoid_column_offset, dropout, error_record);
  };
  auto with_pos = [&](auto pos) {
    if (dropout.active()) run(pos, std::true_type{}); else run(pos, std::false_type{});
  };
  switch (mode) {
    case PosEncoding::kNone: return with_pos(std::integral_constant<int, static_cast<int>(PosEncoding::kNone)>{});
    case PosEncoding::kLearned:
      return with_pos(std::integral_constant<int, static_cast<int>(PosEncoding::kLearned)>{});
    default: return with_pos(std::integral_constant<int, static_cast<int>(PosEncoding::kSinusoidal)>{});
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

// The bits a radix sort of keys in [0, max_key] needs: PyTorch's own embedding backward
// likewise sorts only the bits V needs (GPT-2's 50257 rows: 16 bits, 2 radix passes of 8).
inline int64_t key_bits(int64_t max_key) {
  int64_t bits = 1;
  while (bits < 63 && (max_key >> bits) != 0) ++bits;
  return bits;
}

// The segments of equal used keys among the stably sorted keys, numbered two ways:
//   - by key (`by_row`, a dense gradient): entry v of begin/end is table row v's segment,
//     [0, 0) when untouched -- num_rows entries;
//   - by slot (sparse gradients): slot s holds the s-th segment in key order, with its
//     key; slots past the last segment are empty -- min(tokens, num_rows) entries, a size
//     the host knows without asking the device; `count` (on the device) is how many.
// Plus the partial sums of the pieces of segments longer than a chunk (chunk_kernel).
// The arrays live in one allocation (Scratch): each allocation is a dispatcher call and a
// caching-allocator lookup the host pays for (a dense backward made five, and four views
// of them; the H200's host took ~49 us for a GPT-2 8x2048 `cuda` backward op at 26f0ba6,
// ~21 of them its four launches). By slot, the bounds are a tensor of their own, as the
// keys among them are returned (touched_rows_op) and should not hold the rest.
struct SortedSegments {
  std::vector<at::Tensor> scratch;  // own the arrays below (Scratch)
  at::Tensor bounds;                // by slot
  at::Tensor library_keys, library_order;  // the library sort's outputs, where it ran
  int64_t* order = nullptr;  // (tokens,) token index of each sorted position
  int64_t* begin = nullptr;  // the segment's sorted positions [begin, end)
  int64_t* end = nullptr;
  int64_t* first = nullptr;  // the segment's first token, order[begin] (0 for an empty one)
  int64_t* solo = nullptr;   // with_solo: per token, its key when it is its segment's only token, else -1
  void* partials = nullptr;  // (2 * chunks, d) in the compute dtype, or null: no segment is longer than a chunk
  at::Tensor keys;   // by slot: the key of segment s (-1 for an empty slot)
  at::Tensor count;  // by slot: () int64 on the device, the number of segments
};

// Arrays of a call laid out in one allocation, each starting 16-byte aligned (the kernels'
// vector accesses): take() each, then allocate(), then at(). PYEMBED_CUDA_SCRATCH=separate
// (read each call: gpu-check's compute-sanitizer runs set it) gives each array an
// allocation of its own instead, so that an access past an array is past an allocation,
// which memcheck reports (within one allocation it could not).
class Scratch {
 public:
  template <typename E>
  int take(int64_t count) {
    sizes_.push_back(count * static_cast<int64_t>(sizeof(E)));
    return static_cast<int>(sizes_.size()) - 1;
  }

  std::vector<at::Tensor> allocate(const at::TensorOptions& options) {
    const auto bytes = options.dtype(at::kByte);
    std::vector<at::Tensor> owners;
    if (env_setting("PYEMBED_CUDA_SCRATCH") == "separate") {
      for (const int64_t size : sizes_) bases_.push_back(owners.emplace_back(at::empty({size}, bytes)).data_ptr());
      return owners;
    }
    int64_t total = 0;
    for (const int64_t size : sizes_) total += round_up16(size);
    uint8_t* const base = owners.emplace_back(at::empty({total}, bytes)).data_ptr<uint8_t>();
    int64_t offset = 0;
    for (const int64_t size : sizes_) {
      bases_.push_back(base == nullptr ? nullptr : base + offset);
      offset += round_up16(size);
    }
    return owners;
  }

  template <typename E>
  E* at(int array) const {
    return static_cast<E*>(bases_[array]);
  }

 private:
  static int64_t round_up16(int64_t bytes) { return (bytes + 15) / 16 * 16; }

  std::vector<int64_t> sizes_;  // bytes, by array
  std::vector<void*> bases_;
};

// The tile sort of n keys (fits_word_sort): sorted (n,) int32 and order (n,) int64, and
// the bounds' starting values as sort_inputs_kernel sets them. `words`: n int32 of scratch
// (the tiles' words; unused for one tile).
template <class Launch>
void tile_sort(const at::Tensor& keys, int64_t num_rows, int64_t skip, int32_t* sorted, int64_t* order,
               int32_t* words, int64_t* bounds, int64_t num_bounds, int64_t num_zeros) {
  const int n = static_cast<int>(keys.numel());
  const int64_t rank_blocks = (n + kRankThreads - 1) / kRankThreads;
  const int64_t bound_blocks = (num_bounds + kRankThreads - 1) / kRankThreads;
  uint32_t* const tiles = reinterpret_cast<uint32_t*>(words);
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_tile_sort", [&] {
    Launch::run(dim3(static_cast<unsigned>(rank_blocks + bound_blocks)), dim3(kRankThreads),
                tile_rank_kernel<index_t>, keys.data_ptr<index_t>(), n, num_rows, skip, tiles, sorted, order,
                bounds, num_zeros, num_bounds, rank_blocks);
  });
  if (n > kSortTile) {
    Launch::run(dim3(static_cast<unsigned>((n + kMergeThreads - 1) / kMergeThreads)), dim3(kMergeThreads),
                merge_tiles_kernel, static_cast<const uint32_t*>(tiles), n, sorted, order);
  }
}

// Keys outside [0, num_rows) (out-of-range ids, validate=False) and `skip` (the padding
// row) are left out. Launches, with no device->host sync: the tile sort's one or two (up
// to 2^14 tokens over keys of at most 18 bits; the first sets the sort's inputs), else
// sort_inputs and the radix sort (Launch::sort_pairs, on the bits num_rows needs), [by
// slot: starts and their scan], chunk_kernel. One allocation by row with the tile sort
// (the default for up to 8x2048 tokens), no view.
template <class Launch, typename T>
SortedSegments sorted_segments(const at::Tensor& dout, const at::Tensor& keys_in, int64_t num_rows, int64_t skip,
                               bool by_row, bool with_solo = false, const Dropout& dropout = {}) {
  using A = acc_t<T>;
  SortedSegments seg;
  const at::Tensor keys = keys_in.contiguous();  // read by the kernels as (n,)
  const int64_t n = keys.numel(), dim = dout.size(-1);
  num_rows = std::max<int64_t>(num_rows, 0);
  const auto long_options = keys.options().dtype(at::kLong);
  const int64_t entries = by_row ? num_rows : std::min(n, num_rows);
  // begin, end, first token (zeros), [by slot: keys (-1)], [solo (-1), by token]: set by sort_inputs
  const int64_t rows_of_bounds = by_row ? 3 : 4;
  const int64_t num_bounds = rows_of_bounds * entries + (with_solo ? n : 0), num_zeros = 3 * entries;
  // 32-bit sort keys when V (the unused keys' stand-in) fits: half the bytes and passes.
  const bool narrow = num_rows < std::numeric_limits<int32_t>::max();
  const int64_t bits = key_bits(num_rows);
  const bool tiles = narrow && fits_word_sort(n, bits) && tile_sort_requested();
  const int64_t num_chunks = (n + kChunkRows - 1) / kChunkRows;
  const bool with_partials = n > kChunkRows && dim > 0;

  Scratch scratch;
  const int bounds_array = by_row ? scratch.take<int64_t>(num_bounds) : -1;
  const int order_array = tiles ? scratch.take<int64_t>(n) : -1;
  // the sorted keys, then the tile sort's words (its scratch, past one tile)
  const int sorted_array = tiles ? scratch.take<int32_t>(n > kSortTile ? 2 * n : n) : -1;
  const int partials_array = with_partials ? scratch.take<A>(2 * num_chunks * dim) : -1;
  seg.scratch = scratch.allocate(keys.options());
  int64_t* bounds;
  if (by_row) {
    bounds = scratch.at<int64_t>(bounds_array);
  } else {
    seg.bounds = at::empty({num_bounds}, long_options);
    bounds = seg.bounds.data_ptr<int64_t>();
    seg.keys = seg.bounds.narrow(0, 3 * entries, entries);
  }
  seg.begin = bounds, seg.end = bounds + entries, seg.first = bounds + 2 * entries;
  if (with_solo) seg.solo = bounds + rows_of_bounds * entries;
  if (with_partials) seg.partials = scratch.at<A>(partials_array);
  int64_t* order = order_array >= 0 ? scratch.at<int64_t>(order_array) : nullptr;
  int32_t* const words = sorted_array >= 0 ? scratch.at<int32_t>(sorted_array) : nullptr;
  const void* sorted = words;  // K = int32 for the tile sort
  if (tiles) {
    tile_sort<Launch>(keys, num_rows, skip, words, order, words + n, bounds, num_bounds, num_zeros);
  } else {
    const at::Tensor compact = at::empty({n}, keys.options().dtype(narrow ? at::kInt : at::kLong));
    const at::Tensor iota = at::empty({n}, long_options);
    if (n + num_bounds > 0) {
      const RowGrid g = linear_grid(std::max(n, num_bounds));
      AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_sort_inputs", [&] {
        auto run = [&](auto key_type) {
          using K = decltype(key_type);
          Launch::run(g.grid, g.block, sort_inputs_kernel<index_t, K>, keys.data_ptr<index_t>(), n, num_rows, skip,
                      compact.data_ptr<K>(), iota.data_ptr<int64_t>(), bounds, num_zeros, num_bounds);
        };
        if (narrow) run(int32_t{}); else run(int64_t{});
      });
    }
    if (n == 0) {
      seg.count = at::zeros({}, long_options);
      return seg;
    }
    std::tie(seg.library_keys, seg.library_order) = Launch::sort_pairs(compact, iota, bits);  // stable
    sorted = seg.library_keys.data_ptr();
    order = seg.library_order.data_ptr<int64_t>();
  }
  seg.order = order;
  const int vec = vector_width<T>(dim, {dout.data_ptr()});
  auto with_keys = [&](auto key_type) {
    using K = decltype(key_type);
    at::Tensor scan;
    if (!by_row) {
      const RowGrid g = linear_grid(n);
      scan = at::empty({n}, long_options);
      Launch::run(g.grid, g.block, segment_starts_kernel<K>, static_cast<const K*>(sorted), n, num_rows,
                  scan.data_ptr<int64_t>());
      scan.cumsum_(0);
      seg.count = scan[n - 1];
    }
    const RowGrid g = row_grid(num_chunks, dim, vec);
    with_dout<T>(dout, dropout, [&](auto rows) {
      constexpr bool kDropout = decltype(rows)::kMasked;
      auto run = [&](auto v) {
        Launch::run(g.grid, g.block, chunk_kernel<K, T, A, decltype(v)::value, kDropout>,
                    static_cast<const K*>(sorted), by_row ? nullptr : scan.data_ptr<int64_t>(), n, num_rows,
                    by_row ? nullptr : seg.keys.data_ptr<int64_t>(), seg.begin, seg.end, seg.first, seg.solo, rows,
                    order, static_cast<A*>(seg.partials), num_chunks, dim);
      };
      if (vec > 1) run(std::integral_constant<int, 16 / sizeof(T)>{}); else run(std::integral_constant<int, 1>{});
    });
  };
  if (narrow) with_keys(int32_t{}); else with_keys(int64_t{});
  return seg;
}

// finish_segments_body's first pass over consecutive segments, unless PYEMBED_CUDA_FINISH_ROWS
// says "spread" (read by every call, a getenv, so that gpu-check times both in one process).
inline bool finish_rows_consecutive() { return env_setting("PYEMBED_CUDA_FINISH_ROWS") != "spread"; }

// finish_segments_solo_kernel's form that PYEMBED_CUDA_FINISH_GROUP (read by every call) asks
// for: rows a thread group, 4, 8 or 16, its position blocks first, or "8-last": 8 rows, the
// position blocks last. rows 0 (unset, or any other value): finish_segments_kernel.
struct SoloForm {
  int rows = 0;
  bool positions_first = true;
};
inline SoloForm finish_solo_form() {
  const std::string_view form = env_setting("PYEMBED_CUDA_FINISH_GROUP");
  if (form == "8-last") return {8, false};
  return {form == "4" ? 4 : form == "8" ? 8 : form == "16" ? 16 : 0, true};
}

// out[g] = factor(g) * (sum of the dout rows of segment g), for the first out.size(0)
// segments (one launch, finish_segments_kernel): factor = scale, or scale / (the
// segment's token count) with divide_by_count. zero_empty: empty segments are written as
// zeros (a dense gradient, numbered by row: every row written once, no fill before).
template <class Launch, typename T>
void finish_segments(const at::Tensor& dout, const SortedSegments& seg, double scale, bool divide_by_count,
                     bool zero_empty, at::Tensor& out, PositionSums<T> positions = {}, const Dropout& dropout = {}) {
  using A = acc_t<T>;
  const int64_t dim = dout.size(-1), rows = out.size(0);
  if (dim == 0 || rows + positions.rows == 0) return;
  // The position blocks write the one-token rows when the segments mark them (with_solo).
  if (positions.out != nullptr && seg.solo != nullptr) positions.solo = seg.solo;
  const int vec = vector_width<T>(dim, {dout.data_ptr(), out.data_ptr(), positions.out});
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    const SoloForm solo = positions.solo != nullptr && !dropout.active() && vec > 1 ? finish_solo_form() : SoloForm{};
    if (solo.rows > 0) {
      const int64_t groups = (rows + solo.rows - 1) / solo.rows;
      const RowGrid g = add_position_blocks(row_grid(groups, dim, vec), groups, positions, solo.positions_first);
      constexpr int kVec = 16 / sizeof(T);
      const auto kernel = !solo.positions_first ? finish_segments_solo_kernel<T, A, kVec, 8, false>
                          : solo.rows == 4      ? finish_segments_solo_kernel<T, A, kVec, 4, true>
                          : solo.rows == 8      ? finish_segments_solo_kernel<T, A, kVec, 8, true>
                                                : finish_segments_solo_kernel<T, A, kVec, 16, true>;
      Launch::run(g.grid, g.block, kernel, Dout<T, false>{dout.data_ptr<T>(), dim, dropout}, seg.order,
                  static_cast<const A*>(seg.partials), seg.begin, seg.end, out.data_ptr<T>(), static_cast<A>(scale),
                  divide_by_count, zero_empty, rows, dim, positions);
      return;
    }
  }
  const int64_t groups = (rows + kSegmentsPerGroup - 1) / kSegmentsPerGroup;
  const RowGrid g = add_position_blocks(row_grid(groups, dim, vec), groups, positions, /*positions_first=*/true);
  const bool consecutive = finish_rows_consecutive();
  with_dout<T>(dout, dropout, [&](auto dout_rows) {
    constexpr bool kDropout = decltype(dout_rows)::kMasked;
    auto run = [&](auto v) {
      constexpr int kVec = decltype(v)::value;
      const auto kernel = [] {
        if constexpr (kDropout) {
          return finish_segments_dropout_kernel<T, A, kVec>;
        } else {
          return finish_segments_kernel<T, A, kVec>;
        }
      }();
      Launch::run(g.grid, g.block, kernel, dout_rows, seg.order, static_cast<const A*>(seg.partials), seg.begin,
                  seg.end, seg.first, out.data_ptr<T>(), static_cast<A>(scale), divide_by_count, zero_empty, rows,
                  dim, positions, consecutive);
    };
    if (vec > 1) run(std::integral_constant<int, 16 / sizeof(T)>{}); else run(std::integral_constant<int, 1>{});
  });
}

// few_tokens_gradient_kernel over every row of grad (and of positions.out).
template <class Launch, typename T>
void few_tokens_gradient(const at::Tensor& dout, const at::Tensor& keys, int64_t skip, double scale,
                         bool divide_by_count, at::Tensor& grad, PositionSums<T> positions, const Dropout& dropout) {
  using A = acc_t<T>;
  const int64_t num_rows = grad.size(0), dim = grad.size(1);
  if (dim == 0 || num_rows + positions.rows == 0) return;
  const int vec = vector_width<T>(dim, {dout.data_ptr(), grad.data_ptr(), positions.out});
  AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_few_tokens_gradient", [&] {
    with_dout<T>(dout, dropout, [&](auto rows) {
      constexpr bool kDropout = decltype(rows)::kMasked;
      auto run = [&](auto v) {
        const int64_t groups = (num_rows + few_rows<decltype(v)::value>() - 1) / few_rows<decltype(v)::value>();
        const RowGrid g =
            add_position_blocks(row_grid(groups, dim, vec), groups, positions, /*positions_first=*/false);
        Launch::run(g.grid, g.block, few_tokens_gradient_kernel<index_t, T, A, decltype(v)::value, kDropout>,
                    keys.data_ptr<index_t>(), keys.numel(), rows, grad.data_ptr<T>(), static_cast<A>(scale),
                    divide_by_count, num_rows, skip, dim, positions);
      };
      if (vec > 1) run(std::integral_constant<int, 16 / sizeof(T)>{}); else run(std::integral_constant<int, 1>{});
    });
  });
}

// A dense gradient (num_rows, d) of the rows named by `keys`, each row written once: one
// kernel for a few tokens, else three around the sort. Its last kernel also writes the
// learned positions' gradient, if given (PositionSums).
template <class Launch, typename T>
at::Tensor dense_gradient(const at::Tensor& dout, const at::Tensor& keys, int64_t num_rows, int64_t skip,
                          double scale, bool divide_by_count, PositionSums<T> positions, const Dropout& dropout) {
  at::Tensor grad = at::empty({num_rows, dout.size(-1)}, dout.options());
  if (keys.numel() <= kFewTokens) {
    few_tokens_gradient<Launch, T>(dout, keys.contiguous(), skip, scale, divide_by_count, grad, positions, dropout);
    return grad;
  }
  // The position blocks write the one-token rows when they read every token (PositionSums).
  const bool solo_by_positions = positions.out != nullptr && positions.steps == positions.seq_len;
  const SortedSegments seg =
      sorted_segments<Launch, T>(dout, keys, num_rows, skip, /*by_row=*/true, solo_by_positions, dropout);
  finish_segments<Launch, T>(dout, seg, scale, divide_by_count, /*zero_empty=*/true, grad, positions, dropout);
  return grad;
}

// Dense gradients (weight_grad (V, d) and / or pos_grad (max_seq_len, d); (0, d) when not
// needed): no device->host sync. Each is written once, every row: no zero fill first.
// Launches for the token table: sort_inputs, the radix sort, chunk_kernel, finish_segments
// (up to kFewTokens tokens: few_tokens_gradient_kernel alone); learned positions by
// p = offset + t are written by the table's last kernel (or batch_sum_kernel, when the
// table needs no gradient); by position_ids, they are a dense gradient of their own.
template <class Launch>
std::tuple<at::Tensor, at::Tensor> backward_op(const at::Tensor& grad_out_in, const at::Tensor& ids_in,
                                               const std::optional<at::Tensor>& position_ids_in, int64_t offset,
                                               int64_t num_embeddings, int64_t num_positions, double scale,
                                               std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                               bool need_weight_grad, bool need_pos_grad,
                                               const std::optional<at::Tensor>& dropout_key = std::nullopt,
                                               double dropout_p = 0.0) {
  check_same_device(grad_out_in.device(), {&ids_in, opt(position_ids_in), opt(dropout_key)});
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  const at::Tensor dout = dout_rows_of(grad_out_in, num_tokens, dim);
  at::Tensor key;  // the forward's dropout, applied to dout as the kernels read it (Dout)
  const Dropout dropout = dropout_of(dropout_key, dropout_p, key);
  const auto options = dout.options();
  at::Tensor weight_grad, pos_grad;  // (0, d) where not asked for, made only then (each op costs the host)

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dout.scalar_type(), "pyembed_backward_cuda", [&] {
    using T = scalar_t;
    PositionSums<T> positions;
    if (need_pos_grad && !position_ids_in) {
      pos_grad = at::empty({num_positions, dim}, options);  // every row written by the launch that takes positions
      if (num_positions > 0 && dim > 0) {
        positions = position_sums<T>(num_positions, ids_in, offset);
        positions.out = pos_grad.data_ptr<T>();
      }
    }
    if (need_weight_grad) {
      weight_grad = dense_gradient<Launch, T>(dout, ids_in, num_embeddings, padding_idx.value_or(-1), scale,
                                              scale_grad_by_freq, positions, dropout);
    } else if (positions.out != nullptr) {
      const int vec = vector_width<T>(dim, {dout.data_ptr(), positions.out});
      const RowGrid g = add_position_blocks(row_grid(0, dim, vec), 0, positions, /*positions_first=*/true);
      with_dout<T>(dout, dropout, [&](auto rows) {
        constexpr bool kDropout = decltype(rows)::kMasked;
        if (vec > 1) {
          Launch::run(g.grid, g.block, batch_sum_kernel<T, 16 / sizeof(T), kDropout>, rows, positions, dim);
        } else {
          Launch::run(g.grid, g.block, batch_sum_kernel<T, 1, kDropout>, rows, positions, dim);
        }
      });
    }
    if (need_pos_grad && position_ids_in) {
      pos_grad = dense_gradient<Launch, T>(dout, *position_ids_in, num_positions, -1, 1.0, false, {}, dropout);
    }
  });
  return {weight_grad.defined() ? weight_grad : at::empty({0, dim}, options),
          pos_grad.defined() ? pos_grad : at::empty({0, dim}, options)};
}

// The token table's gradient rows, by slot: slot s holds the s-th smallest used id and
// its tokens' scaled sum. exact: the U used rows only (U read back from the device: one
// host sync); else min(tokens, V) slots, a size the host knows, the slots past the used
// rows marked row -1 (their values not written). Up to kFewTokens tokens:
// few_tokens_slots_kernel alone; else the sorted segments by slot and finish_segments.
template <class Launch>
std::tuple<at::Tensor, at::Tensor> sum_used_rows(const at::Tensor& grad_out_in, const at::Tensor& ids_in,
                                                 int64_t num_embeddings, double scale,
                                                 std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                 bool exact, const std::optional<at::Tensor>& dropout_key,
                                                 double dropout_p) {
  check_same_device(grad_out_in.device(), {&ids_in, opt(dropout_key)});
  const int64_t dim = grad_out_in.size(-1), num_tokens = ids_in.numel();
  const at::Tensor dout = dout_rows_of(grad_out_in, num_tokens, dim);
  at::Tensor key;  // the forward's dropout, applied to dout as the kernels read it (Dout)
  const Dropout dropout = dropout_of(dropout_key, dropout_p, key);
  const int64_t skip = padding_idx.value_or(-1);
  at::Tensor rows, values;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dout.scalar_type(), "pyembed_sum_used_rows_cuda", [&] {
    using T = scalar_t;
    using A = acc_t<T>;
    if (num_tokens <= kFewTokens) {
      const int64_t slots = std::min(num_tokens, std::max<int64_t>(num_embeddings, 0));
      rows = at::empty({slots}, dout.options().dtype(at::kLong));
      values = at::empty({slots, dim}, dout.options());
      if (slots > 0) {
        const at::Tensor keys = ids_in.contiguous();  // read as (tokens,)
        const int vec = vector_width<T>(dim, {dout.data_ptr(), values.data_ptr()});
        const RowGrid g = row_grid(slots, dim, vec);
        AT_DISPATCH_INDEX_TYPES(keys.scalar_type(), "pyembed_few_tokens_slots", [&] {
          with_dout<T>(dout, dropout, [&](auto dout_rows) {
            constexpr bool kDropout = decltype(dout_rows)::kMasked;
            auto run = [&](auto v) {
              Launch::run(g.grid, g.block, few_tokens_slots_kernel<index_t, T, A, decltype(v)::value, kDropout>,
                          keys.data_ptr<index_t>(), num_tokens, dout_rows, rows.data_ptr<int64_t>(),
                          values.data_ptr<T>(), static_cast<A>(scale), scale_grad_by_freq, slots, num_embeddings,
                          skip, dim);
            };
            if (vec > 1) run(std::integral_constant<int, 16 / sizeof(T)>{}); else run(std::integral_constant<int, 1>{});
          });
        });
      }
      if (exact) {
        const int64_t used = rows.ge(0).sum().item<int64_t>();  // one device->host read
        rows = rows.slice(0, 0, used), values = values.slice(0, 0, used);
      }
      return;
    }
    const SortedSegments seg =
        sorted_segments<Launch, T>(dout, ids_in, num_embeddings, skip, /*by_row=*/false, /*with_solo=*/false, dropout);
    const int64_t used = exact ? seg.count.item<int64_t>() : seg.keys.numel();  // exact: one device->host read
    values = at::empty({used, dim}, dout.options());
    finish_segments<Launch, T>(dout, seg, scale, scale_grad_by_freq, /*zero_empty=*/false, values, {}, dropout);
    rows = exact ? seg.keys.slice(0, 0, used).clone() : seg.keys;  // -1 where no segment landed
  });
  return {rows, values};
}

// The token table's sparse gradient: (rows (U,) sorted unique used ids, values (U, d)).
// U is read back from the device once (this op is tagged cudagraph_unsafe).
template <class Launch>
std::tuple<at::Tensor, at::Tensor> sparse_backward_op(const at::Tensor& grad_out, const at::Tensor& ids,
                                                      int64_t num_embeddings, double scale,
                                                      std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                      const std::optional<at::Tensor>& dropout_key = std::nullopt,
                                                      double dropout_p = 0.0) {
  return sum_used_rows<Launch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                               /*exact=*/true, dropout_key, dropout_p);
}

// The sparse backward's (rows, values) without the host sync: sized by the bound
// min(tokens, V) the host knows, the slots past the touched rows marked row -1 (their
// values are never written, and the optimizer update skips them). What the optimizer in
// the backward takes (pyembed/optim.py).
template <class Launch>
std::tuple<at::Tensor, at::Tensor> touched_rows_op(const at::Tensor& grad_out, const at::Tensor& ids,
                                                   int64_t num_embeddings, double scale,
                                                   std::optional<int64_t> padding_idx, bool scale_grad_by_freq,
                                                   const std::optional<at::Tensor>& dropout_key = std::nullopt,
                                                   double dropout_p = 0.0) {
  return sum_used_rows<Launch>(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                               /*exact=*/false, dropout_key, dropout_p);
}

}  // namespace pyembed::cuda
