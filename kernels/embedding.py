"""Triton kernels of the fused embedding op (installed as ``pyembed.kernels.embedding``).

Forward: a program owns a (BLOCK_T tokens x BLOCK_D features) tile; it gathers the
tokens' rows, scales them, adds the learned row or a sinusoid computed in registers, and
stores once -- fp32 math (fp64 for fp64 tables), one rounding, 64-bit offsets. An
out-of-range id (validate=False) is masked: a zero row (no positional term either: the
vocab-parallel layer sums ranks' rows), no memory access.

Backward: the keys are sorted stably on the device (tile_sort: the keys with their
positions as distinct 32-bit words, ranked within tiles, then merged; torch's sort past
2^14 tokens or 2^18 rows), and each segment of equal used keys is summed in sorted (=
token) order in fp32 -- no atomics, so it is deterministic (this backend has no atomic
fast path). A segment longer than CHUNK_ROWS (a row used 12000 times must not be summed
by one program) is summed in pieces by the chunks of sorted positions it spans, and its
row adds those partial sums in order. The host never waits for the device (a dense
backward can be captured in a CUDA graph): every size is bounded by the token count or
the table, and a dense gradient's segment bounds are indexed by table row. Launches, not
arithmetic, are what the host pays for, so a dense gradient at GPT-2's 8x2048 tokens is
four kernels: the tile sort's two, one pass over the sorted positions (segment bounds,
the long segments' pieces), one over the table's rows (each written once, untouched ones
as zeros) -- as csrc/cuda/embedding_kernels.cuh, which has the same structure (its sort
one launch: one thread block's shared memory holds 2^14 keys). The learned-PE gradient
with p = offset + t is a batch reduction, run by extra programs of the table's last
kernel (no launch of its own), which also write the table rows used by one token (dout
read once for those, not twice).

Scalars: Triton types a Python float argument as fp32, so ``scale`` and the sinusoid's
frequency step are annotated fp64 (exact for fp64 tables) and rounded to the compute
dtype inside the kernel -- the same rounding the host would do for fp32.

Recompilation policy: ``dim`` is a runtime argument, so a new d only compiles anew when
it changes BLOCK_D = min(next_pow2(d), 512) or Triton's divisibility-by-16 specialisation
of d (which is what lets it emit 16-byte accesses); BLOCK_T follows from BLOCK_D.
"""

import functools
import math
import os
from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.jit import JITFunction

from ..checks import POS_CODES  # installed as pyembed.kernels
from .launch import Binding, LaunchPlan, cached, int_class  # noqa: F401  (pyembed/_triton.py uses all)

POS_NONE, POS_LEARNED, POS_SINUSOIDAL = (POS_CODES[name] for name in ("none", "learned", "sinusoidal"))
MAX_BLOCK_D = 512
# A row wider than MAX_BLOCK_D takes column tiles of the widest power of two, down to
# MIN_BLOCK_D, whose lanes past the row's end are at most 1/9 of all: GPT-2's d = 768 in
# two 512-wide tiles left a quarter of the lanes (the second tile's half) idle -- the H100
# at a4a8951 measured the GPT-2 `triton` forward at 1.34x the `cuda` one's GPU time (fp32)
# against 1.06x at Llama's d = 4096, which 512-wide tiles fill -- three 256-wide tiles fill it.
MIN_BLOCK_D = 128
TILE_ELEMENTS = 2048  # BLOCK_T * BLOCK_D: 16 fp32 registers per thread at 4 warps
# Narrow rows make tall tiles, and every token of a tile holds its id, position and row
# offsets (64-bit) in registers: past 64 tokens, d=8 tiles spill (tests/triton_aot.py).
MAX_BLOCK_T = 64
MAX_SEGMENT_ROWS = 32  # _segment_blocks


def _blocks(dim: int, pos_mode: int = POS_NONE, dropout: bool = False) -> tuple[int, int]:
    """(BLOCK_T, BLOCK_D). A sinusoid holds an angle, a sine and a cosine per element, and
    dropout four Philox words per group of four, so their tiles are half as tall (without
    that the fp16 kernel spills on sm_80/sm_90). Dropout needs whole groups: BLOCK_D >= 4.
    Remembered per (d, mode): every launch asks (a symbolic d, under torch.compile's
    dynamic shapes, is computed afresh)."""
    if type(dim) is int:
        return _blocks_of(dim, pos_mode, bool(dropout))
    return _blocks_of.__wrapped__(dim, pos_mode, dropout)


@functools.lru_cache(maxsize=None)
def _blocks_of(dim: int, pos_mode: int, dropout: bool) -> tuple[int, int]:
    block_d = min(triton.next_power_of_2(max(dim, 4 if dropout else 1)), MAX_BLOCK_D)
    if dim > MAX_BLOCK_D:  # several column tiles: narrower ones where the last would idle many lanes
        while block_d > MIN_BLOCK_D and _cdiv(dim, block_d) * block_d * 8 > dim * 9:
            block_d //= 2
    tile = TILE_ELEMENTS // 2 if pos_mode == POS_SINUSOIDAL or dropout else TILE_ELEMENTS
    return max(1, min(tile // block_d, MAX_BLOCK_T)), block_d


def _cdiv(a, b):
    """Plain arithmetic: recent Triton makes triton.cdiv a constexpr function, a call through a wrapper."""
    return -(-a // b)


@triton.jit
def _rounded(x, ptr):
    """x converted to ptr's element type, rounding to nearest even. On a GPU that is the
    conversion itself (cvt.rn.bf16x2.f32: one instruction per two elements); Triton's CPU
    interpreter truncates to bf16, so there bf16 is rounded by hand. (By hand on the GPU
    too, the rounding and its NaN test cost ~30 instructions per 16 elements: the `triton`
    bf16 forward ran at 1.29x-1.34x the `cuda` one's GPU time on the H100 at d81f5b2.)"""
    if ptr.dtype.element_ty == tl.bfloat16 and INTERPRETED:
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, x.to(tl.bfloat16), bits.to(tl.uint16).to(tl.bfloat16, bitcast=True))
    else:
        return x.to(ptr.dtype.element_ty)


# Whether @triton.jit made these kernels Python functions for Triton's CPU interpreter
# (TRITON_INTERPRET, as this module was imported), which rounds to bf16 unlike a GPU.
INTERPRETED = tl.constexpr(not isinstance(_rounded, JITFunction))

# 2*pi as float(2*pi) + the rest, and 1 / (2*pi): an angle less a whole number of turns,
# exactly enough for the sine and cosine below (Cody-Waite, the products inside FMAs).
TWO_PI_HI = tl.constexpr(6.2831854820251465)
TWO_PI_LO = tl.constexpr(-1.7484555314695172e-07)
INV_TWO_PI = tl.constexpr(0.15915494309189535)


@triton.jit
def _sin_cos(angle, FAST: tl.constexpr):
    """(sin, cos) of fp32 or fp64 ``angle``. FAST (2-byte tables): the angle reduced to
    [-pi, pi] in fp32, then the SFU's approximations (sin.approx / cos.approx: an absolute
    error below 2^-21.4 there, against a bf16 / fp16 output's half ulp of 2^-9 / 2^-12 at
    1): a handful of instructions a pair where libdevice's sin and cos, each with its own
    reduction, are ~30 -- with them a bf16 sinusoidal forward compiled to 856 SASS
    instructions a thread at d = 4096 on sm_90, 296 with learned positions (python
    tests/triton_aot.py --sass). The interpreter, which has no SFU, takes the accurate
    functions of the reduced angle (so the reduction is what the CPU tests check)."""
    if FAST:
        turns = tl.floor(angle * INV_TWO_PI + 0.5)
        reduced = tl.fma(-turns, TWO_PI_LO, tl.fma(-turns, TWO_PI_HI, angle))
        if INTERPRETED:
            return tl.sin(reduced), tl.cos(reduced)
        else:
            return libdevice.fast_sinf(reduced), libdevice.fast_cosf(reduced)
    else:
        return tl.sin(angle), tl.cos(angle)


@triton.jit
def _dropout_keep(key_ptr, tok, threshold, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """(ROWS, BLOCK_D) keep mask of the tokens ``tok`` (a (ROWS, 1) column of int64 flat
    token indices) over this program's column tile (axis 1 of the grid; pyembed/reference.py,
    csrc/dropout.h): element (n, j) is word j % 4 of Philox4x32-10 keyed by seed with
    counter (offset + j // 4, n) -- one Philox call per group of four columns."""
    seed = tl.load(key_ptr)
    group = tl.load(key_ptr + 1) + tl.program_id(1).to(tl.int64) * (BLOCK_D // 4) + tl.arange(0, BLOCK_D // 4)
    shape: tl.constexpr = (ROWS, BLOCK_D // 4)
    r0, r1, r2, r3 = tl.philox(
        seed,
        tl.broadcast_to((group & 0xFFFFFFFF).to(tl.uint32)[None, :], shape),
        tl.broadcast_to((group >> 32).to(tl.uint32)[None, :], shape),
        tl.broadcast_to((tok & 0xFFFFFFFF).to(tl.uint32), shape),
        tl.broadcast_to((tok >> 32).to(tl.uint32), shape),
    )
    words = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # r0 r1 r2 r3 of each group, in column order
    return words.to(tl.int64) >= threshold


@triton.jit
def _dout_rows(dout_ptr, token, cols, mask, dim, dropout_key_ptr, dropout_threshold, dropout_scale,
               HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The output gradient's rows ``token`` (a (ROWS, 1) column) at ``cols`` (this program's
    column tile, (1, BLOCK_D)), in the compute dtype. HAS_DROPOUT: as the forward's mask
    pass would store them -- the kept x / (1 - p) rounded to dout's dtype, +0 where dropped
    -- from each element's keep bit, regenerated here: the bits of masking first, without
    that pass over (N, d) or its buffer (csrc/cuda's Dout does the same)."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    x = tl.load(dout_ptr + token * dim + cols, mask=mask, other=0.0).to(acc_dtype)
    if HAS_DROPOUT:
        kept = _rounded(x * tl.full([], dropout_scale, acc_dtype), dout_ptr).to(acc_dtype)
        x = tl.where(_dropout_keep(dropout_key_ptr, token, dropout_threshold, ROWS, BLOCK_D), kept, 0.0)
    return x


@triton.jit
def _token_of_slot(slot, num_tokens, seq_len, POS_MODE: tl.constexpr, HAS_POSITION_IDS: tl.constexpr):
    """(token, t) of each of the forward's token slots ``slot`` (launch order), t the
    token's index in its sequence. With learned positions offset + t (no position_ids:
    the rows share their positions) the slots run position-major -- the batch's tokens at
    position t one after another -- so the B reads of a positional row meet in L2
    (csrc/cuda's token_of_slot: in token order a row comes back only after seq_len tokens'
    rows, which at long sequences and wide rows is past the L2). Given position_ids
    (packed sequences restart them inside a row) and in the other modes: token order."""
    if POS_MODE == 1 and not HAS_POSITION_IDS:
        batch = tl.maximum(num_tokens // seq_len, 1)  # ids are (B, T) or (T,) with a positional encoding
        t = slot // batch
        return (slot - t * batch) * seq_len + t, t
    else:
        return slot, slot % seq_len


@triton.jit
def _record_bad_ranges(record_high, record_low, tok_ok, ids, id_ok, pos, num_embeddings, num_positions,
                       POS_MODE: tl.constexpr, HAS_POSITION_IDS: tl.constexpr, BLOCK_T: tl.constexpr):
    """validate=True on a GPU: write what is out of range into the error record (layout in
    pyembed/checks.py) instead of making the host wait for the answer. The record is host
    memory the GPU writes directly, passed as an integer address in two parts below 2^31
    (embedding_forward says why). Plain stores (no atomics): any one offender serves the
    message. One column block writes."""
    # tl.cast, not .to: torch.compile's mutation analysis may pass the ints as constants.
    address = tl.cast(record_high, tl.int64) * 2147483648 + tl.cast(record_low, tl.int64)  # error_record_parts
    record = address.to(tl.pointer_type(tl.int64))
    first = tl.program_id(1) == 0
    at = tl.zeros([BLOCK_T], dtype=tl.int64)  # every token's lane stores to the same slot
    bad_id = tok_ok & ~id_ok & first
    tl.store(record + 1 + at, ids, mask=bad_id)
    tl.store(record + 2 + at, at + num_embeddings, mask=bad_id)
    tl.store(record + at, at + 1, mask=bad_id)
    if POS_MODE != 0 and HAS_POSITION_IDS:  # positions offset + t are checked on the host, from shapes
        if POS_MODE == 1:  # learned: a row of the table
            bad_pos = tok_ok & first & ((pos < 0) | (pos >= num_positions))
            limit = at + num_positions
        else:  # sinusoidal: any position >= 0
            bad_pos = tok_ok & first & (pos < 0)
            limit = at - 1
        tl.store(record + 4 + at, pos, mask=bad_pos)
        tl.store(record + 5 + at, limit, mask=bad_pos)
        tl.store(record + 3 + at, at + 1, mask=bad_pos)


# The error record's address parts are not specialised on (divisible by 16, == 1): they
# differ from process to process, and would key a binary of their own where they happen
# to differ in those -- each test worker, each rank of a job compiling its own; a warmed
# cache (tests/triton_specs.py warm) could not know them.
@triton.jit(do_not_specialize=["error_record_high", "error_record_low"])
def _embedding_forward_kernel(
    ids_ptr,  # (num_tokens,) int32/int64
    weight_ptr,  # (num_embeddings, dim)
    pos_weight_ptr,  # (num_positions, dim), learned only
    position_ids_ptr,  # (num_tokens,) int64, when HAS_POSITION_IDS
    dropout_key_ptr,  # (2,) int64 [seed, offset], when HAS_DROPOUT
    out_ptr,  # (num_tokens, dim)
    num_tokens, seq_len, num_embeddings, num_positions, dim, offset,
    scale: tl.float64,  # multiplies the token rows (rounded to the compute dtype)
    neg_log_base_over_dim: tl.float64,  # -ln(10000) / d_total: w_i = exp(2i * this)
    sinusoid_pair_offset,  # the table's column 0 is column 2 * this of the encoding (a column shard)
    dropout_threshold,  # int64 ceil(p * 2^32): an element is kept iff its Philox word >= this
    dropout_scale: tl.float64,  # 1 / (1 - p), for the kept elements
    error_record_high, error_record_low,  # the range check's record address (pyembed.checks), when CHECK_RANGES
    POS_MODE: tl.constexpr, HAS_POSITION_IDS: tl.constexpr, HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr,
    CHECK_RANGES: tl.constexpr, WIDE_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    # Slots, and their division into (token, t), in 32 bits unless the launch's slots pass
    # 2^31 (WIDE_SLOTS): a 64-bit division is a ~70-instruction subroutine, and a thread
    # divides for each token it holds (sm_90, learned positions, d = 4096: ~830 instructions
    # per thread for 16 bf16 elements with it and the bf16 rounding by hand, ~300 without).
    if WIDE_SLOTS:
        slot = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    else:
        slot = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok, t = _token_of_slot(slot, num_tokens, seq_len, POS_MODE, HAS_POSITION_IDS)
    tok = tok.to(tl.int64)  # row offsets are 64-bit: token * dim passes 2^31 on large batches
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    tok_ok = slot < num_tokens
    col_ok = cols < dim
    ids = tl.load(ids_ptr + tok, mask=tok_ok, other=0).to(tl.int64)
    id_ok = tok_ok & (ids >= 0) & (ids < num_embeddings)
    if HAS_POSITION_IDS:
        pos = tl.load(position_ids_ptr + tok, mask=tok_ok, other=0)
    else:
        pos = offset + t  # (unused, so not computed, without a positional encoding)
    if CHECK_RANGES:  # before the row is loaded: fewer registers live (no spill at d=100 bf16)
        _record_bad_ranges(error_record_high, error_record_low, tok_ok, ids, id_ok, pos, num_embeddings,
                           num_positions, POS_MODE, HAS_POSITION_IDS, BLOCK_T)
    x = tl.load(weight_ptr + ids[:, None] * dim + cols[None, :], mask=id_ok[:, None] & col_ok[None, :], other=0.0)
    # tl.full rounds the fp64 scalars once, to the compute dtype (and keeps a Python
    # float exact under the interpreter, where arguments stay Python objects).
    x = x.to(acc_dtype) * tl.full([], scale, acc_dtype)
    if POS_MODE != 0:
        if POS_MODE == 1:
            pos_ok = id_ok & (pos >= 0) & (pos < num_positions)
            pe = tl.load(pos_weight_ptr + pos[:, None] * dim + cols[None, :], mask=pos_ok[:, None] & col_ok[None, :],
                         other=0.0)
            x += pe.to(acc_dtype)
        else:
            # One angle, one sine and one cosine per (sin, cos) pair of columns, then
            # interleaved: columns 2i, 2i+1 of this tile are sin, cos of its pair i.
            pair = sinusoid_pair_offset + tl.program_id(1).to(tl.int64) * (BLOCK_D // 2) + tl.arange(0, BLOCK_D // 2)
            freq = tl.exp((2 * pair).to(acc_dtype) * tl.full([], neg_log_base_over_dim, acc_dtype))
            angle = pos.to(acc_dtype)[:, None] * freq[None, :]
            sin, cos = _sin_cos(angle, FAST=out_ptr.dtype.element_ty.primitive_bitwidth == 16 and not COMPUTE_F64)
            pe = tl.interleave(sin, cos)
            x += tl.where(id_ok[:, None], pe, 0.0)
    if HAS_DROPOUT:
        x = tl.where(_dropout_keep(dropout_key_ptr, tok[:, None], dropout_threshold, BLOCK_T, BLOCK_D),
                     x * tl.full([], dropout_scale, acc_dtype), 0.0)
    tl.store(out_ptr + tok[:, None] * dim + cols[None, :], _rounded(x, out_ptr),
             mask=tok_ok[:, None] & col_ok[None, :])


# A radix sort makes one pass per 8 bits of its keys, and PyTorch's sort takes every bit of
# the dtype: so the sort keys are the narrowest type that holds every row and the unused
# mark (num_rows). int16 keys are stored less 2^15, which keeps [0, 2^16) in order as a
# signed sort sees it: a GPT-2 table (50257 rows) sorts in 2 passes, not 4.
INT16_KEY_BIAS = tl.constexpr(2**15)


def sort_key_dtype(num_rows: int) -> torch.dtype:
    """The narrowest sort key for keys in [0, num_rows] (num_rows: unused)."""
    if num_rows < 2**16:
        return torch.int16
    return torch.int32 if num_rows < 2**31 else torch.long


@triton.jit
def _used_key(key, num_rows, skip):
    """A key names a row of the table other than the skipped one (the padding row)."""
    return (key >= 0) & (key < num_rows) & (key != skip)


@triton.jit
def _sort_inputs_kernel(
    keys_ptr,  # (n,) int32/int64 ids or positions
    out_ptr,  # (n,) sort_key_dtype(num_rows) out: the key, or num_rows if unused
    bounds_ptr,  # (num_bounds,) int64 out: the segment bounds' starting values
    n, num_zeros, num_bounds, num_rows, skip,
    BLOCK: tl.constexpr,
):
    """What the sort needs, in one launch: the keys it sees -- used ones as they are, the
    rest as num_rows (after every used key), in the narrowest type that holds them
    (sort_key_dtype) -- and the values the segment bounds start from: num_zeros zeros
    (begin, end, first token: empty ranges where no segment lands), then -1 (the slots'
    keys: a slot no segment lands in)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n
    _store_sort_key(out_ptr, r, _compacted_key(tl.load(keys_ptr + r, mask=ok, other=0), num_rows, skip), ok)
    _start_bounds(bounds_ptr, r, num_zeros, num_bounds)


@triton.jit
def _compacted_key(loaded, num_rows, skip):
    """The key the sort sees for a loaded key, as int64: itself if used, else num_rows (after
    every used key). It takes the loaded value, not the pointer (_sorted_key says why)."""
    key = loaded.to(tl.int64)
    return tl.where(_used_key(key, num_rows, skip), key, num_rows)


@triton.jit
def _store_sort_key(out_ptr, at, key, mask):
    """A compacted key (int64) stored in the sort's key type: int16 keys less INT16_KEY_BIAS."""
    if out_ptr.dtype.element_ty == tl.int16:
        key -= INT16_KEY_BIAS
    tl.store(out_ptr + at, key.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _start_bounds(bounds_ptr, b, num_zeros, num_bounds):
    """The segment bounds' starting values (_sort_inputs_kernel) at b."""
    tl.store(bounds_ptr + b, tl.where(b < num_zeros, 0, -1).to(tl.int64), mask=b < num_bounds)


# The tile sort, for batches of at most 2^TILE_SORT_POSITION_BITS tokens over tables of
# fewer than 2^TILE_SORT_KEY_BITS rows (GPT-2, BERT, Llama-2, Llama-3): token r's compacted
# key k and r itself travel as one 32-bit word (k << 14) | r. The words are distinct, so
# ordering them orders the keys stably, with no values beside them, and a word's sorted
# position is the number of words below it: no comparison network, no barrier, two
# launches where torch's sort is seven GPU operations (a histogram, a onesweep pass per 8
# bits, four memsets: ~23 us of GPU and ~41 us of host time on the H200 at 79bdffb).
# _tile_rank_kernel places each word within its tile of TILE_SORT_TILE by counting the
# tile's words below it; _merge_tiles_kernel places it among all of them by adding its
# lower bounds in the other (sorted) tiles. One tile (n <= TILE_SORT_TILE) is one launch.
# The same words, key width and position bits as csrc/cuda's tile sort.
TILE_SORT_POSITION_BITS = tl.constexpr(14)
TILE_SORT_POSITION_MASK = tl.constexpr(2**14 - 1)
TILE_SORT_KEY_BITS = 18
TILE_SORT_TILE = 512
TILE_SORT_MAX_TILES = 32  # 2^14 tokens
RANK_ROWS = 64  # words ranked per program of _tile_rank_kernel (eight programs a tile), against
RANK_COLUMNS = 64  # this many of the tile's words at a time: 64 x 64 comparisons, 32 per thread


@triton.jit
def _tile_sort_word(loaded, r, num_rows, skip):
    """Token r's word (uint32) from its loaded key: the compacted key above the position."""
    key = _compacted_key(loaded, num_rows, skip)
    return (key.to(tl.uint32) << TILE_SORT_POSITION_BITS) | r.to(tl.uint32)


@triton.jit
def _store_sorted_words(sorted_ptr, order_ptr, at, word, mask):
    """Words stored at their sorted positions ``at``: the compacted key and the token."""
    _store_sort_key(sorted_ptr, at, (word >> TILE_SORT_POSITION_BITS).to(tl.int64), mask)
    tl.store(order_ptr + at, (word & TILE_SORT_POSITION_MASK).to(tl.int64), mask=mask)


@triton.jit
def _tile_rank_kernel(
    keys_ptr,  # (n,) int32/int64 ids or positions
    words_ptr,  # (n,) int32 out, unless ONE_TILE: each tile's words (uint32 bits), sorted within the tile
    sorted_ptr,  # (n,) sort_key_dtype(num_rows) out, if ONE_TILE: the sorted compacted keys
    order_ptr,  # (n,) int64 out, if ONE_TILE: the token of each sorted position
    bounds_ptr,  # (num_bounds,) int64 out: the segment bounds' starting values (_sort_inputs_kernel)
    n, rank_programs, num_zeros, num_bounds, num_rows, skip,
    ONE_TILE: tl.constexpr, TILE: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr, BLOCK: tl.constexpr,
):
    """Programs [0, rank_programs): ROWS words of a tile, each stored at its tile's start
    plus the count of the tile's words below it -- with one tile (n <= TILE) that is the
    sort, stored as keys and tokens. The programs after set BLOCK bound values each, as
    _sort_inputs_kernel does."""
    program = tl.program_id(0)
    if program < rank_programs:
        tile_start = program // (TILE // ROWS) * TILE  # int32: positions < 2^14
        r = tile_start + program % (TILE // ROWS) * ROWS + tl.arange(0, ROWS)
        ok = r < n
        word = _tile_sort_word(tl.load(keys_ptr + r, mask=ok, other=0), r, num_rows, skip)
        below = tl.zeros([ROWS, COLUMNS], dtype=tl.int32)  # summed across a row once, at the end
        for c in range(0, TILE, COLUMNS):  # a loop, not unrolled: note on _merge_tiles_kernel's
            other = tile_start + c + tl.arange(0, COLUMNS)
            in_tile = other < n
            other_word = _tile_sort_word(tl.load(keys_ptr + other, mask=in_tile, other=0), other, num_rows, skip)
            below += (in_tile[None, :] & (other_word[None, :] < word[:, None])).to(tl.int32)
        rank = tl.sum(below, axis=1)
        if ONE_TILE:
            _store_sorted_words(sorted_ptr, order_ptr, rank, word, ok)
        else:
            tl.store(words_ptr + tile_start + rank, word.to(tl.int32, bitcast=True), mask=ok)
    else:
        _start_bounds(bounds_ptr, (program - rank_programs).to(tl.int64) * BLOCK + tl.arange(0, BLOCK), num_zeros,
                      num_bounds)


@triton.jit
def _merge_tiles_kernel(
    words_ptr,  # (n,) int32: each tile's words (uint32 bits), sorted within the tile (_tile_rank_kernel)
    sorted_ptr,  # (n,) sort_key_dtype(num_rows) out: the sorted compacted keys
    order_ptr,  # (n,) int64 out: the token of each sorted position
    n,
    TILE: tl.constexpr, MAX_TILES: tl.constexpr, BLOCK: tl.constexpr,
):
    """Words i, each stored at its sorted position: the number of words below it, the sum
    of its lower bounds in every tile (in its own, its index there). Each lower bound is a
    binary search of at most TILE words (L2-resident: 4 bytes per token), a program's
    MAX_TILES x BLOCK searches at once."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    word = tl.load(words_ptr + i, mask=ok, other=0).to(tl.uint32, bitcast=True)
    # Tiles down, words across: a warp's threads take neighbouring words (one tile's, BLOCK
    # dividing TILE), whose searches in another tile probe the same or neighbouring words,
    # a cache line or few per load. Words down and tiles across, a warp's 32 probes lay in
    # 32 tiles, 32 lines per load: the H200 at 1b594a4 ran that form in ~22 us at GPT-2's
    # 8x2048 tokens, most of the tile sort's 28.
    tile_start = tl.arange(0, MAX_TILES) * TILE
    searched = (tile_start < n)[:, None] & ok[None, :]
    # Each tile's words (its length: the last one may be short), searched with one bound
    # that steps past smaller words, in a loop, not unrolled: Inductor's
    # mutation analysis walks every path through a kernel's ops, and unrolled steps multiply
    # them (a two-bound search, unrolled, took tracing a backward past five minutes).
    # A probe outside its tile reads as all ones, below no word (a word is at most 2^32 - 1),
    # so the step is taken on the loaded value alone: no mask kept live past the loads, which
    # then all leave before any compare where registers allow (MERGE_OPTIONS).
    length = tl.minimum(n - tile_start, TILE)[:, None]
    lo = tl.zeros([MAX_TILES, BLOCK], dtype=tl.int32)
    for s in range(TILE.bit_length() - 1, -1, -1):
        step = lo + (1 << s)
        inside = searched & (step <= length)
        probe = tl.load(words_ptr + tile_start[:, None] + step - 1, mask=inside, other=-1).to(tl.uint32, bitcast=True)
        lo = tl.where(probe < word[None, :], step, lo)
    _store_sorted_words(sorted_ptr, order_ptr, tl.sum(tl.where(searched, lo, 0), axis=0), word, ok)


@triton.jit
def _sorted_key(stored):
    """A compacted key as loaded from the sorted keys, as int64 (int16 keys are stored less
    INT16_KEY_BIAS). It takes the loaded value, not the pointer: Inductor's mutation
    analysis skips loads, but would take a pointer passed to a function that the kernel's
    stores depend on as written. Masked-off loads are garbage: every use is masked too."""
    key = stored.to(tl.int64)
    if stored.dtype == tl.int16:
        key += INT16_KEY_BIAS
    return key


@triton.jit
def _segment_starts_kernel(
    sorted_ptr,  # (n,) sorted compacted keys (num_rows: unused)
    starts_ptr,  # (n,) int64 out: 1 where a segment starts; its inclusive scan numbers the segments
    n, num_rows,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = r < n
    key = _sorted_key(tl.load(sorted_ptr + r, mask=ok))
    prev = _sorted_key(tl.load(sorted_ptr + r - 1, mask=ok & (r > 0)))
    starts = (key < num_rows) & ((r == 0) | (prev != key))
    tl.store(starts_ptr + r, starts.to(tl.int64), mask=ok)


@triton.jit
def _chunk_kernel(
    sorted_ptr,  # (n,) sorted compacted keys (num_rows: unused)
    scan_ptr,  # (n,) int64 inclusive scan of the segment starts: scan - 1 is r's slot, when BY_SLOT
    bounds_ptr,  # int64 out, as _sort_inputs_kernel filled it: Segments.bounds, `entries` a part
    dout_ptr,  # (n, dim) the output gradient
    order_ptr,  # (n,) int64 its row for sorted position r
    partials_ptr,  # (2 * chunks, dim) compute dtype out: the long segments' pieces, when HAS_PARTIALS
    n, num_rows, entries, dim,
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    BY_SLOT: tl.constexpr, HAS_PARTIALS: tl.constexpr, HAS_SOLO: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    COMPUTE_F64: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Chunk c of the sorted positions (program (c, column block)): (1) the segment
    bounds of its positions, each written by the position at the segment's edge, by slot
    or by table row, and the segment's first token, which _finish_segments_kernel reads
    beside the bounds, not after them, and (HAS_SOLO, by row only) the key of each token alone
    in its segment, by token (_position_sums) (the first column block does this); (2) the partial
    sums of the pieces of segments longer than a chunk -- a chunk holds at most two: the
    one at its first position (partial row 2c) and, if another reaches its last position,
    that one's (row 2c + 1). A segment [b, e) of more than CHUNK rows thus has its pieces
    in row 2c of every chunk c it touches, except the first when it starts inside it
    (2c + 1)."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    c = tl.program_id(0).to(tl.int64)
    c0 = c * CHUNK
    r = c0 + tl.arange(0, CHUNK)
    in_chunk = r < n
    key = _sorted_key(tl.load(sorted_ptr + r, mask=in_chunk))
    used = in_chunk & (key < num_rows) & (tl.program_id(1) == 0)
    prev = _sorted_key(tl.load(sorted_ptr + r - 1, mask=used & (r > 0)))
    nxt = _sorted_key(tl.load(sorted_ptr + r + 1, mask=used & (r + 1 < n)))
    first = used & ((r == 0) | (prev != key))
    last = used & ((r == n - 1) | (nxt != key))
    # Segments.bounds: begin, end, first token, then by slot the keys, by row (HAS_SOLO) the solo marks
    end_ptr = bounds_ptr + entries
    first_ptr = end_ptr + entries
    if BY_SLOT:
        slot = tl.load(scan_ptr + r, mask=used, other=1) - 1
        tl.store(first_ptr + entries + slot, key, mask=first)
    else:
        slot = key
    tl.store(bounds_ptr + slot, r, mask=first)
    tl.store(end_ptr + slot, r + 1, mask=last)
    lead = tl.load(order_ptr + r, mask=first)
    tl.store(first_ptr + slot, lead, mask=first)
    if HAS_SOLO:
        tl.store(first_ptr + entries + lead, key, mask=first & last)
    if HAS_PARTIALS:
        c1 = tl.minimum(c0 + CHUNK, n)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
        col_ok = cols < dim
        # Where the chunk's first run stops and its last run starts: its first and last key
        # change, reductions over the keys it holds; whether their segments are longer than
        # CHUNK, from one key outside each run. (Two binary searches did this: 16 dependent
        # loads before any piece's first, in every chunk -- a launch of one wave at 8x2048.)
        inner = in_chunk & (r > c0)
        changes = inner & (_sorted_key(tl.load(sorted_ptr + r - 1, mask=inner)) != key)
        head_stop = tl.min(tl.where(changes, r, c1))
        tail_start = tl.max(tl.where(changes, r, c0))
        head = _sorted_key(tl.load(sorted_ptr + c0))
        tail = _sorted_key(tl.load(sorted_ptr + c1 - 1))
        has_after, has_before, has_past = c1 < n, head_stop > CHUNK, tail_start + CHUNK < n
        after = _sorted_key(tl.load(sorted_ptr + c1, mask=has_after))
        before = _sorted_key(tl.load(sorted_ptr + head_stop - CHUNK - 1, mask=has_before))
        head_long = (head < num_rows) & ((has_after & (head_stop == c1) & (after == head)) |
                                         (has_before & (before == head)))
        past_tail = _sorted_key(tl.load(sorted_ptr + tail_start + CHUNK, mask=has_past))
        tail_long = (tail != head) & (tail < num_rows) & has_past & (past_tail == tail)
        piece = tl.arange(0, 2)  # 0: the first run's piece, 1: the last run's
        start = tl.where(piece == 0, c0, tail_start)
        rows = tl.where(piece == 0, tl.where(head_long, head_stop - c0, 0), tl.where(tail_long, c1 - tail_start, 0))
        acc = tl.zeros([2, BLOCK_D], dtype=acc_dtype)
        # Pipelined (num_stages): each row's token and then its dout row are loaded ~6 rows
        # ahead of its add (cp.async through shared memory), the adds still in order. Row
        # by row, a piece of CHUNK rows was as many round trips to memory: the H200 at
        # e204d9e (ncu, GPT-2 8x2048 fp32, a 12000-use row) ran this kernel in 64 us.
        for k in tl.range(0, tl.max(rows, 0), num_stages=8):
            take = k < rows
            token = tl.load(order_ptr + start + k, mask=take, other=0)
            acc += _dout_rows(dout_ptr, token[:, None], cols[None, :], take[:, None] & col_ok[None, :], dim,
                              dropout_key_ptr, dropout_threshold, dropout_scale, HAS_DROPOUT, COMPUTE_F64, 2, BLOCK_D)
        tl.store(partials_ptr + (2 * c + piece)[:, None] * dim + cols[None, :], acc,
                 mask=(rows > 0)[:, None] & col_ok[None, :])


@triton.jit
def _batch_sums(dout_ptr, p, cols, col_ok, batch, seq_len, steps, offset, dim, table_ptr, solo_ptr, scale,
                dropout_key_ptr, dropout_threshold, dropout_scale, SOLO: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                COMPUTE_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The learned positions' gradient rows ``p`` (a (BLOCK_R, 1) column) with
    p = offset + t, at ``cols``, in the compute dtype: the sum over b of dout[b, t], b
    ascending, for the ``steps`` positions the sequence reaches, zeros for every other row.
    SOLO (every token's position reached): also the token table's rows used by one token
    (solo_ptr, by token: the row, or -1), from the dout rows read here, so the table's
    programs do not read those dout rows a second time (csrc/cuda's PositionSums says
    why); the same expression as _finish_segments_kernel's, so the same bits."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    t = p - offset
    reached = (t >= 0) & (t < steps)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_dtype)
    token = t  # (BLOCK_R, 1): token b * seq_len + t, whose dout row is at token * dim (+ cols)
    for b in range(0, batch * tl.max(tl.max(reached.to(tl.int32), 1), 0)):
        if SOLO:  # its table row, if the token is that row's only one
            solo = tl.load(solo_ptr + token, mask=reached, other=-1)
        x = _dout_rows(dout_ptr, token, cols, reached & col_ok, dim, dropout_key_ptr, dropout_threshold, dropout_scale,
                       HAS_DROPOUT, COMPUTE_F64, BLOCK_R, BLOCK_D)
        acc += x
        if SOLO:  # as _finish_segments_kernel writes it: a sum from +0, scaled, rounded once
            one = (tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_dtype) + x) * tl.full([], scale, acc_dtype)
            tl.store(table_ptr + solo * dim + cols, _rounded(one, table_ptr), mask=(solo >= 0) & col_ok)
        token += seq_len  # 64-bit: batch * seq_len * dim passes 2^31
    return acc


@triton.jit
def _position_sums(dout_ptr, out_ptr, program, rows, batch, seq_len, steps, offset, dim, table_ptr, solo_ptr, scale,
                   dropout_key_ptr, dropout_threshold, dropout_scale, SOLO: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                   COMPUTE_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows program * BLOCK_R + [0, BLOCK_R) of the learned positions' gradient
    (_batch_sums), stored. Run by extra programs of the token table's last kernel (one
    launch less per backward), or by _batch_sum_kernel alone."""
    p = (program.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]  # (BLOCK_R, 1), as the segments' rows
    cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    col_ok = cols < dim
    acc = _batch_sums(dout_ptr, p, cols, col_ok, batch, seq_len, steps, offset, dim, table_ptr, solo_ptr, scale,
                      dropout_key_ptr, dropout_threshold, dropout_scale, SOLO, HAS_DROPOUT, COMPUTE_F64, BLOCK_R,
                      BLOCK_D)
    tl.store(out_ptr + p * dim + cols, _rounded(acc, out_ptr), mask=(p < rows) & col_ok)


@triton.jit
def _segment_bounds(bounds_ptr, g, g_ok, entries):
    """(first sorted position, token count) of segments ``g`` (a (BLOCK_R, 1) column); 0
    tokens past the segments."""
    begin = tl.load(bounds_ptr + g, mask=g_ok, other=0)
    return begin, tl.load(bounds_ptr + entries + g, mask=g_ok, other=0) - begin


@triton.jit
def _segment_sums(dout_ptr, order_ptr, partials_ptr, bounds_ptr, g, g_ok, begin, length, cols, col_ok, entries, dim,
                  dropout_key_ptr, dropout_threshold, dropout_scale, HAS_PARTIALS: tl.constexpr,
                  HAS_SOLO: tl.constexpr, HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr,
                  CHUNK: tl.constexpr, SUM_STAGES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """The sums of the dout rows of segments ``g`` (a (BLOCK_R, 1) column; ``begin``,
    ``length``: _segment_bounds) at ``cols``: each summed from +0 in sorted (= token)
    order, a segment longer than CHUNK from its pieces' partial sums (_chunk_kernel); an
    empty segment's is +0. HAS_SOLO: one-token segments are left at 0 (the position
    programs write their rows, _position_sums). Shared by the dense gradient's last pass
    and the optimizer's (_segment_update_kernel): the same sums, so the same bits.
    SUM_STAGES > 1 pipelines the rows' loop (finish_sum_stages); the adds keep their order.

    Every per-segment value is a (BLOCK_R, 1) column of the tile, not a vector broadcast
    into it: with vectors, Triton 3.6's layout pass fails to compile the direct loop for
    BLOCK_D 16-64 (the mask and the load it guards end up in different layouts)."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    direct = tl.where(length <= CHUNK, length, 0)
    if HAS_SOLO:  # rows of one token: written by the position programs (_position_sums)
        direct = tl.where(length == 1, 0, direct)
    # The first token comes with the bounds (_chunk_kernel): a row of one token -- most
    # touched rows -- is two dependent loads away, not three (its order entry first).
    lead = tl.load(bounds_ptr + entries + entries + g, mask=g_ok, other=0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_dtype)  # + x: a sum from +0, as every backend's
    acc += _dout_rows(dout_ptr, lead, cols, (direct > 0) & col_ok, dim, dropout_key_ptr, dropout_threshold,
                      dropout_scale, HAS_DROPOUT, COMPUTE_F64, BLOCK_R, BLOCK_D)
    # Row by row, each a chain of two dependent loads (its order entry, then its dout row):
    # a tile's time is its longest segment's, 2L round trips for L tokens. Real text's
    # frequent rows have 100-128 uses (Zipf ids at GPT-2 8x2048), and the H200 at 1b594a4
    # ran the op in 193 us with Zipf ids, 106 with uniform ones. Pipelined (SUM_STAGES > 1),
    # a row's entry and then its dout row are copied (cp.async, through shared memory) an
    # iteration or more ahead of its add: ~one round trip a row. Not by loading ahead into
    # registers: ptxas then reused the rows' registers for the entries, issued after the
    # first add's wait, and the chain stayed two round trips a row (SASS, sm_90).
    for k in tl.range(1, tl.max(tl.max(direct, 1), 0), num_stages=SUM_STAGES):
        take = k < direct
        token = tl.load(order_ptr + begin + k, mask=take, other=0)
        acc += _dout_rows(dout_ptr, token, cols, take & col_ok, dim, dropout_key_ptr, dropout_threshold,
                          dropout_scale, HAS_DROPOUT, COMPUTE_F64, BLOCK_R, BLOCK_D)
    if HAS_PARTIALS:
        first_chunk = begin // CHUNK
        pieces = tl.where(length > CHUNK, (begin + length - 1) // CHUNK - first_chunk + 1, 0)
        for k in range(0, tl.max(tl.max(pieces, 1), 0)):
            slot = 2 * (first_chunk + k) + ((k == 0) & (begin % CHUNK != 0)).to(tl.int64)
            acc += tl.load(partials_ptr + slot * dim + cols, mask=(k < pieces) & col_ok, other=0.0)
    return acc


@triton.jit
def _segment_factor(scale, length, DIVIDE_BY_COUNT: tl.constexpr, acc_dtype: tl.constexpr):
    """What segments of ``length`` tokens multiply their sums by: scale, or scale / the
    count; +0 for an empty segment, whose sum is +0, so that its row is +0.0 as a zero fill
    (+0 * a negative scale is -0.0) -- chosen by segment, not by element (a select of each
    element took ~2 instructions more an element)."""
    factor = tl.full([], scale, acc_dtype)
    if DIVIDE_BY_COUNT:
        factor = factor / tl.maximum(length, 1).to(acc_dtype)
    return tl.where(length > 0, factor, 0.0)


@triton.jit
def _finish_segments_kernel(
    dout_ptr,  # (n, dim) the output gradient
    order_ptr,  # (n,) int64 its row for sorted position r
    partials_ptr,  # (2 * chunks, dim) compute dtype: the long segments' pieces, when HAS_PARTIALS
    bounds_ptr,  # int64 Segments.bounds, `entries` a part: segment g sums sorted positions [begin, end), its
                 # first token is order[begin]; HAS_SOLO: by token, its row if its segment's only token, else -1
    out_ptr,  # (num_segments, dim) out: row g
    scale: tl.float64, num_segments, entries, dim,
    table_programs,  # programs (along axis 0) that write out; those after write pos_out, when HAS_POSITIONS
    pos_out_ptr, pos_rows, batch, seq_len, steps, offset,  # the learned positions' gradient (_position_sums)
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    DIVIDE_BY_COUNT: tl.constexpr, ZERO_EMPTY: tl.constexpr, HAS_PARTIALS: tl.constexpr, HAS_POSITIONS: tl.constexpr,
    HAS_SOLO: tl.constexpr, HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr, CHUNK: tl.constexpr,
    SUM_STAGES: tl.constexpr, ROW_TILES: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """out[g] = factor * (sum of the dout rows of segment g), summed in sorted (= token)
    order, rounded once; factor = scale, or scale / the segment's token count. A segment
    longer than CHUNK adds its pieces' partial sums (_chunk_kernel) instead. An empty
    segment is written as zeros with ZERO_EMPTY (a dense gradient by table row: every row
    written once, no fill before), else not at all. ROW_TILES tiles of BLOCK_R segments
    per program, summed one tile at a time; the programs after table_programs write the
    learned positions' gradient (HAS_POSITIONS), BLOCK_R rows each, and with HAS_SOLO the
    one-token segments' rows too, which these programs then skip."""
    if tl.program_id(0) >= table_programs:
        if HAS_POSITIONS:  # solo: a dense gradient's bounds, by table row (three parts), then by token
            _position_sums(dout_ptr, pos_out_ptr, tl.program_id(0) - table_programs, pos_rows, batch, seq_len, steps,
                           offset, dim, out_ptr, bounds_ptr + entries + entries + entries, scale, dropout_key_ptr,
                           dropout_threshold, dropout_scale, HAS_SOLO, HAS_DROPOUT, COMPUTE_F64, BLOCK_R, BLOCK_D)
    else:
        acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
        cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
        col_ok = cols < dim
        # Streaming stores (evict-first in L2): the table is written once and never read
        # back here, and a 1 GB gradient (Llama-3 bf16) stored normally pushes the 3 MB of
        # bounds out of L2, so that each program's first load -- the chain every tile waits
        # on, written ones and zero ones alike -- queues for DRAM behind the writes.
        #
        # A tile with no segment to sum -- each empty, or (HAS_SOLO) of one token, whose row
        # the position programs write -- only writes its empty rows' zeros, in a branch of
        # its own: most tiles, at 8x2048 uniform ids with learned positions 97% of Llama-3's
        # 4-row tiles and 70% of GPT-2's 8-row ones. Before it (H200) every tile ran the
        # summing code on masked loads, ~356 SASS instructions a thread (sm_90, bf16,
        # d = 4096) for 16 zeros, and the kernel was issue-bound (ncu at 1b594a4: 67% SM, 48%
        # DRAM; the op at de2aee7: Llama-3 bf16 565 us, `cuda` 403); ~100 in this branch
        # (test_triton_aot checks it).
        # With ROW_TILES > 1 (finish_row_tiles) a program first loads all its rows' bounds
        # and, with nothing to sum among them, stores their zeros at once and ends: 4 tiles
        # of 4 KB stored after one bounds round trip, not one.
        first = tl.program_id(0).to(tl.int64) * (ROW_TILES * BLOCK_R)
        to_sum = 1
        if ROW_TILES > 1:
            rows = (first + tl.arange(0, ROW_TILES * BLOCK_R))[:, None]
            rows_ok = rows < num_segments
            _, rows_length = _segment_bounds(bounds_ptr, rows, rows_ok, entries)
            to_sum = tl.max(tl.max(_summed(rows_length, HAS_SOLO).to(tl.int32), 1), 0)
            if ZERO_EMPTY and to_sum == 0:
                tl.store(out_ptr + rows * dim + cols,
                         tl.zeros([ROW_TILES * BLOCK_R, BLOCK_D], out_ptr.dtype.element_ty),
                         mask=rows_ok & (rows_length == 0) & col_ok, cache_modifier=".cs")
        if to_sum > 0:
            for tile in range(0, ROW_TILES):  # the bounds again, from L1: held, they cost registers
                g = (first + tile * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
                g_ok = g < num_segments
                begin, length = _segment_bounds(bounds_ptr, g, g_ok, entries)
                summed = _summed(length, HAS_SOLO)
                empty = g_ok & (length == 0) & ZERO_EMPTY
                if tl.max(tl.max(summed.to(tl.int32), 1), 0) > 0:
                    acc = _segment_sums(dout_ptr, order_ptr, partials_ptr, bounds_ptr, g, g_ok, begin, length, cols,
                                        col_ok, entries, dim, dropout_key_ptr, dropout_threshold, dropout_scale,
                                        HAS_PARTIALS, HAS_SOLO, HAS_DROPOUT, COMPUTE_F64, CHUNK, SUM_STAGES, BLOCK_R,
                                        BLOCK_D)
                    acc = acc * _segment_factor(scale, length, DIVIDE_BY_COUNT, acc_dtype)  # +0 where empty
                    tl.store(out_ptr + g * dim + cols, _rounded(acc, out_ptr), mask=((g_ok & summed) | empty) & col_ok,
                             cache_modifier=".cs")
                elif ZERO_EMPTY:
                    tl.store(out_ptr + g * dim + cols, tl.zeros([BLOCK_R, BLOCK_D], out_ptr.dtype.element_ty),
                             mask=empty & col_ok, cache_modifier=".cs")


@triton.jit
def _summed(length, HAS_SOLO: tl.constexpr):
    """Whether segments of ``length`` tokens are summed by the table's programs: not empty,
    and with HAS_SOLO not of one token (the position programs write those rows)."""
    summed = length > 0
    if HAS_SOLO:
        summed = summed & (length != 1)
    return summed


@triton.jit
def _few_tokens_gradient_kernel(
    keys_ptr,  # (n,) int32/int64 ids or positions, n <= FEW_TOKENS
    dout_ptr,  # (n, dim) the output gradient
    out_ptr,  # (num_rows, dim) out: every row
    scale: tl.float64, n, num_rows, skip, dim,
    table_programs,  # programs (along axis 0) that write out; those after write pos_out, when HAS_POSITIONS
    pos_out_ptr, pos_rows, batch, seq_len, steps, offset,  # the learned positions' gradient (_position_sums)
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    DIVIDE_BY_COUNT: tl.constexpr, HAS_POSITIONS: tl.constexpr, HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr,
    FEW: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """A dense gradient of a few tokens without the sort: a program owns BLOCK_R rows,
    reads every token's key and sums the dout rows of its own rows' tokens in token order
    -- the order the sorted path sums a segment in, with the same factor, so both give the
    same bits. Every row written once (untouched rows as zeros); the programs after
    table_programs write the learned positions' gradient (HAS_POSITIONS)."""
    if tl.program_id(0) >= table_programs:
        if HAS_POSITIONS:
            _position_sums(dout_ptr, pos_out_ptr, tl.program_id(0) - table_programs, pos_rows, batch, seq_len, steps,
                           offset, dim, out_ptr, keys_ptr, scale, dropout_key_ptr, dropout_threshold, dropout_scale,
                           False, HAS_DROPOUT, COMPUTE_F64, BLOCK_R, BLOCK_D)
    else:
        acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
        g0 = tl.program_id(0).to(tl.int64) * BLOCK_R
        g = (g0 + tl.arange(0, BLOCK_R))[:, None]  # (BLOCK_R, 1) columns, as _finish_segments_kernel
        cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
        col_ok = cols < dim
        acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=acc_dtype)
        count = tl.zeros([BLOCK_R, 1], dtype=tl.int32)
        # Every key in one load; the token loop runs only in a program that owns a token's row:
        # most programs of a large table own none, and skip it.
        t_all = tl.arange(0, FEW)
        k_all = tl.load(keys_ptr + t_all, mask=t_all < n, other=-1).to(tl.int64)
        owns_any = tl.max(((k_all >= g0) & (k_all < g0 + BLOCK_R)).to(tl.int32), 0)
        for t in range(0, n * owns_any):
            key = tl.load(keys_ptr + t).to(tl.int64)
            if _used_key(key, num_rows, skip) & (key >= g0) & (key < g0 + BLOCK_R):  # dout read by its row's program only
                hit = g == key
                row = _dout_rows(dout_ptr, tl.zeros([1, 1], dtype=tl.int64) + t, cols, col_ok, dim, dropout_key_ptr,
                                 dropout_threshold, dropout_scale, HAS_DROPOUT, COMPUTE_F64, 1, BLOCK_D)
                acc += tl.where(hit, row, 0.0)  # + 0.0 elsewhere: a sum of this kind is never -0.0, so no bit changes
                count += hit.to(tl.int32)
        if DIVIDE_BY_COUNT:
            acc = acc * (tl.full([], scale, acc_dtype) / tl.maximum(count, 1).to(acc_dtype))
        else:
            acc = acc * tl.full([], scale, acc_dtype)
        acc = tl.where(count > 0, acc, 0.0)
        tl.store(out_ptr + g * dim + cols, _rounded(acc, out_ptr), mask=(g < num_rows) & col_ok)


@triton.jit
def _few_tokens_slots_kernel(
    keys_ptr,  # (n,) int32/int64 ids, n <= FEW
    dout_ptr,  # (n, dim) the output gradient
    rows_ptr,  # (slots,) int64 out: slot s's row, -1 past the used ones
    values_ptr,  # (slots, dim) out: the used rows' scaled sums (the slots past them not written)
    scale: tl.float64, n, slots, num_rows, skip, dim,
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    DIVIDE_BY_COUNT: tl.constexpr, HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr, FEW: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """A sparse gradient's rows (touched_rows, the sparse backward) of a few tokens without
    the sort: slot s is the s-th smallest used key -- the sorted path's numbering -- with
    the sum of its tokens' dout rows in token order and the same factor, so the same bits.
    A token's slot is the number of distinct used keys below its own (an n x n comparison).
    Each program holds every slot's sums for BLOCK_D columns."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    i = tl.arange(0, FEW)
    k = tl.load(keys_ptr + i, mask=i < n, other=-1).to(tl.int64)
    used = _used_key(k, num_rows, skip) & (i < n)
    # The first token of each used key, then each token's slot: the first tokens' keys below its key.
    earlier_same = (k[None, :] == k[:, None]) & used[None, :] & (i[None, :] < i[:, None])
    first = used & (tl.sum(earlier_same.to(tl.int32), 1) == 0)
    slot = tl.sum(((k[None, :] < k[:, None]) & first[None, :]).to(tl.int32), 1)
    distinct = tl.sum(first.to(tl.int32), 0)
    s = i[:, None]  # (FEW, 1): the slots, as rows of the tile
    cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]  # axis 1, as _dropout_keep's
    col_ok = cols < dim
    acc = tl.zeros([FEW, BLOCK_D], dtype=acc_dtype)
    count = tl.zeros([FEW, 1], dtype=tl.int32)
    for t in range(0, n):
        key = tl.load(keys_ptr + t).to(tl.int64)
        if _used_key(key, num_rows, skip):
            hit = s == tl.sum(tl.where(i == t, slot, 0), 0)  # token t's slot
            row = _dout_rows(dout_ptr, tl.zeros([1, 1], dtype=tl.int64) + t, cols, col_ok, dim, dropout_key_ptr,
                             dropout_threshold, dropout_scale, HAS_DROPOUT, COMPUTE_F64, 1, BLOCK_D)
            acc += tl.where(hit, row, 0.0)  # + 0.0 elsewhere: as _few_tokens_gradient_kernel, no bit changes
            count += hit.to(tl.int32)
    if DIVIDE_BY_COUNT:
        acc = acc * (tl.full([], scale, acc_dtype) / tl.maximum(count, 1).to(acc_dtype))
    else:
        acc = acc * tl.full([], scale, acc_dtype)
    tl.store(values_ptr + s * dim + cols, _rounded(acc, values_ptr), mask=(s < distinct) & col_ok)
    if tl.program_id(1) == 0:
        slot_row = tl.max(tl.where((slot[None, :] == s) & first[None, :], k[None, :], -1), 1)  # -1: no such slot
        tl.store(rows_ptr + i, slot_row, mask=i < slots)


@triton.jit
def _batch_sum_kernel(
    dout_ptr,  # (batch, seq_len, dim)
    out_ptr,  # (rows, dim): the learned positions' gradient (_position_sums)
    rows, batch, seq_len, steps, offset, dim,
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    HAS_DROPOUT: tl.constexpr, COMPUTE_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The learned positions' gradient alone (when the token table needs none)."""
    _position_sums(dout_ptr, out_ptr, tl.program_id(0), rows, batch, seq_len, steps, offset, dim, out_ptr, dout_ptr,
                   1.0, dropout_key_ptr, dropout_threshold, dropout_scale, False, HAS_DROPOUT, COMPUTE_F64, BLOCK_R,
                   BLOCK_D)


@triton.jit
def _slots_of(rows_ptr, touched, row):
    """The slot of each table row ``row`` in rows -- ascending, unused slots (-1) last, as
    used_row_sums and the sparse backward give them --, -1 where absent: a binary search
    (the branch-free lower bound: the length halves alike for every row, so only the base
    differs), so an update of every row needs no (V,) map from table row to slot built
    per step (a fill and a launch). Slots in int32 (touched < 2^31). A first form carrying
    two bounds a row (lo, hi) spilled 8 bytes (SGD, bf16, d=4096, sm_90, Triton 3.8)."""
    base = tl.zeros(row.shape, tl.int32)
    n = touched
    while n > 1:  # base + n <= touched throughout: every load is in bounds
        half = n // 2
        key = tl.load(rows_ptr + base + half)
        base = tl.where((key >= 0) & (key < row), base + half, base)  # an unused slot sorts last
        n -= half
    key = tl.load(rows_ptr + base, mask=base < touched, other=-1)
    base += ((key >= 0) & (key < row)).to(tl.int32)
    found = tl.load(rows_ptr + base, mask=base < touched, other=-1)
    return tl.where(found == row, base.to(tl.int64), -1)


@triton.jit
def _apply_rule(p, g, s1, s2, lr, beta1, beta2, eps, weight_decay, momentum, dampening, bias_correction1,
                bias_correction2_sqrt, RULE: tl.constexpr, DECOUPLED: tl.constexpr, NESTEROV: tl.constexpr,
                MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, HAS_STATE1: tl.constexpr, COMPUTE_F64: tl.constexpr):
    """(p, state1, state2) after one step of csrc/optim.h's rule RULE (0 SGD, 1 Adam/AdamW,
    2 Adagrad, 3 SparseAdam) on gradient g, in the compute dtype; the scalars as the host
    gives them (pyembed/optim.py).

    Every product that meets a sum is an explicit fma: left to the compiler, the
    contraction differed between kernels that inline this rule (Triton 3.6, sm_90: v =
    v*beta2 + (1-beta2)*g*g fused its first product in _segment_update_kernel, its second
    in _optimizer_update_kernel), so the fused optimizer_backward and the two-op form it
    replaces rounded AdamW's state differently on a GPU."""
    acc = tl.float64 if COMPUTE_F64 else tl.float32
    lr, beta1, beta2 = tl.full([], lr, acc), tl.full([], beta1, acc), tl.full([], beta2, acc)
    eps, wd = tl.full([], eps, acc), tl.full([], weight_decay, acc)
    if MAXIMIZE:
        g = -g
    # A zero weight decay adds nothing, not 0 * p (NaN for an infinite p), as torch skips it.
    if RULE == 0:  # SGD
        if weight_decay != 0:
            g = tl.fma(wd, p, g)
        if HAS_STATE1:
            m = tl.full([], momentum, acc)
            if FIRST:
                s1 = g
            else:
                s1 = tl.fma(m, s1, (1 - tl.full([], dampening, acc)) * g)
            if NESTEROV:
                g = tl.fma(m, s1, g)
            else:
                g = s1
        p = tl.fma(-lr, g, p)
    elif RULE == 1:  # Adam / AdamW
        if weight_decay != 0:
            if DECOUPLED:
                # fma(lr, -wd, 1), the same value as fma(-lr, wd, 1), which spilled 32 B (Triton 3.6, sm_90, bf16 d=768)
                p = p * tl.fma(lr, -wd, tl.full([], 1.0, acc))
            else:
                g = tl.fma(wd, p, g)
        s1 = tl.fma(1 - beta1, g - s1, s1)
        s2 = tl.fma(1 - beta2, g * g, s2 * beta2)
        denom = tl.sqrt(s2) / tl.full([], bias_correction2_sqrt, acc) + eps
        p = tl.fma(-(lr / tl.full([], bias_correction1, acc)), s1 / denom, p)
    elif RULE == 2:  # Adagrad (lr: clr)
        if weight_decay != 0:
            g = tl.fma(wd, p, g)
        s1 = tl.fma(g, g, s1)
        p = tl.fma(-lr, g / (tl.sqrt(s1) + eps), p)
    else:  # SparseAdam (lr: step_size)
        s1 = tl.fma(1 - beta1, g - s1, s1)
        s2 = tl.fma(1 - beta2, tl.fma(g, g, -s2), s2)
        p = tl.fma(-lr, s1 / (tl.sqrt(s2) + eps), p)
    return p, s1, s2


@triton.jit
def _update_rows(param_ptr, state1_ptr, state2_ptr, at, ok, g, lr, beta1, beta2, eps, weight_decay, momentum,
                 dampening, bias_correction1, bias_correction2_sqrt, RULE: tl.constexpr, DECOUPLED: tl.constexpr,
                 NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, HAS_STATE1: tl.constexpr,
                 HAS_STATE2: tl.constexpr, COMPUTE_F64: tl.constexpr):
    """The table's elements ``at`` (where ``ok``) and their state, read, stepped by
    gradient g (_apply_rule) and written back, each rounded once. Shared by the three
    update kernels."""
    acc = tl.float64 if COMPUTE_F64 else tl.float32
    p = tl.load(param_ptr + at, mask=ok, other=0.0).to(acc)
    s1 = tl.load(state1_ptr + at, mask=ok, other=0.0).to(acc) if HAS_STATE1 else tl.zeros_like(p)
    s2 = tl.load(state2_ptr + at, mask=ok, other=0.0).to(acc) if HAS_STATE2 else tl.zeros_like(p)
    p, s1, s2 = _apply_rule(p, g, s1, s2, lr, beta1, beta2, eps, weight_decay, momentum, dampening, bias_correction1,
                            bias_correction2_sqrt, RULE, DECOUPLED, NESTEROV, MAXIMIZE, FIRST, HAS_STATE1, COMPUTE_F64)
    tl.store(param_ptr + at, _rounded(p, param_ptr), mask=ok)
    if HAS_STATE1:
        tl.store(state1_ptr + at, _rounded(s1, state1_ptr), mask=ok)
    if HAS_STATE2:
        tl.store(state2_ptr + at, _rounded(s2, state2_ptr), mask=ok)


# touched is not specialised: Triton 3.6 (the GPU machine's) crashed compiling the every-row
# update (ALL_ROWS) with touched == 1 as a constant (an LLVM assertion in its coalescing
# pass: a one-token AdamW step's positional table); one binary for every count loses nothing.
@triton.jit(do_not_specialize=["touched"])
def _optimizer_update_kernel(
    param_ptr,  # (num_rows, dim) the table, updated in place
    state1_ptr, state2_ptr,  # (num_rows, dim) its optimizer state, when HAS_STATE1 / HAS_STATE2
    rows_ptr,  # (touched,) int64: the table row of gradient row k; ascending, -1 (unused) last, when ALL_ROWS
    values_ptr,  # (touched, dim) the gradient rows
    num_rows, touched, dim,
    lr: tl.float64, beta1: tl.float64, beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64,
    momentum: tl.float64, dampening: tl.float64, bias_correction1: tl.float64, bias_correction2_sqrt: tl.float64,
    RULE: tl.constexpr, DECOUPLED: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    FIRST: tl.constexpr, HAS_STATE1: tl.constexpr, HAS_STATE2: tl.constexpr, ALL_ROWS: tl.constexpr,
    COMPUTE_F64: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The optimizer inside the backward: csrc/optim.h's rules (RULE 0 SGD, 1 Adam/AdamW,
    2 Adagrad, 3 SparseAdam) on a (BLOCK_R rows x BLOCK_D) tile -- every table row when
    ALL_ROWS (g = 0 where untouched: dense semantics), else the touched rows; p and each
    state read and written once, rounded once. A row outside the table is masked."""
    acc = tl.float64 if COMPUTE_F64 else tl.float32
    i = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D)
    if ALL_ROWS:
        row = i
        slot = _slots_of(rows_ptr, touched, i)
    else:
        slot = i
        row = tl.load(rows_ptr + i, mask=i < touched, other=-1)
    ok = ((row >= 0) & (row < num_rows))[:, None] & (cols < dim)[None, :]
    at = row[:, None] * dim + cols[None, :]
    g = tl.load(values_ptr + slot[:, None] * dim + cols[None, :], mask=ok & (slot >= 0)[:, None], other=0.0).to(acc)
    _update_rows(param_ptr, state1_ptr, state2_ptr, at, ok, g, lr, beta1, beta2, eps, weight_decay, momentum,
                 dampening, bias_correction1, bias_correction2_sqrt, RULE, DECOUPLED, NESTEROV, MAXIMIZE, FIRST,
                 HAS_STATE1, HAS_STATE2, COMPUTE_F64)


@triton.jit
def _segment_update_kernel(
    dout_ptr, order_ptr, partials_ptr, bounds_ptr,  # as _finish_segments_kernel's; the segments by table row
    param_ptr,  # (num_rows, dim) the table, updated in place
    state1_ptr, state2_ptr,  # (num_rows, dim) its optimizer state, when HAS_STATE1 / HAS_STATE2
    scale: tl.float64, num_rows, dim,
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    lr: tl.float64, beta1: tl.float64, beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64,
    momentum: tl.float64, dampening: tl.float64, bias_correction1: tl.float64, bias_correction2_sqrt: tl.float64,
    DIVIDE_BY_COUNT: tl.constexpr, HAS_PARTIALS: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    RULE: tl.constexpr, DECOUPLED: tl.constexpr, NESTEROV: tl.constexpr, MAXIMIZE: tl.constexpr,
    FIRST: tl.constexpr, HAS_STATE1: tl.constexpr, HAS_STATE2: tl.constexpr, ALL_ROWS: tl.constexpr,
    COMPUTE_F64: tl.constexpr, CHUNK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The optimizer inside the backward for a dense token table, its gradient never in
    memory (FBGEMM's fused backward; csrc/cuda's segment_update_kernel): row r's gradient
    is its segment's sum (_segment_sums, as _finish_segments_kernel sums it), times the
    factor, rounded to the table's dtype as the stored gradient would be -- the same bits
    -- and the rule applied to the row at once (_apply_rule). Every row when ALL_ROWS
    (g = 0 where untouched: dense semantics), else only the touched ones."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    row = (tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R))[:, None]
    cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    row_ok = row < num_rows
    col_ok = cols < dim
    begin, length = _segment_bounds(bounds_ptr, row, row_ok, num_rows)
    acc = _segment_sums(dout_ptr, order_ptr, partials_ptr, bounds_ptr, row, row_ok, begin, length, cols, col_ok,
                        num_rows, dim, dropout_key_ptr, dropout_threshold, dropout_scale, HAS_PARTIALS, False,
                        HAS_DROPOUT, COMPUTE_F64, CHUNK, 1, BLOCK_R, BLOCK_D)  # 1: as written (finish_sum_stages)
    acc = acc * _segment_factor(scale, length, DIVIDE_BY_COUNT, acc_dtype)
    # The gradient as stored. The select is not for the value (an empty row's is +0
    # already): it keeps the NVPTX backend from fusing the fp32 product into the rule's first
    # sum (g - s1) -- a g without the stored gradient's rounding (test_triton_aot's rule test).
    g = tl.where(length > 0, _rounded(acc, param_ptr).to(acc_dtype), 0.0)
    ok = row_ok & col_ok
    if not ALL_ROWS:
        ok = ok & (length > 0)
    _update_rows(param_ptr, state1_ptr, state2_ptr, row * dim + cols, ok, g, lr, beta1, beta2, eps, weight_decay,
                 momentum, dampening, bias_correction1, bias_correction2_sqrt, RULE, DECOUPLED, NESTEROV, MAXIMIZE,
                 FIRST, HAS_STATE1, HAS_STATE2, COMPUTE_F64)


@triton.jit
def _position_update_kernel(
    dout_ptr,  # (batch, seq_len, dim) the output gradient
    param_ptr,  # (rows, dim) the learned positions' table, updated in place
    state1_ptr, state2_ptr,  # (rows, dim) its optimizer state, when HAS_STATE1 / HAS_STATE2
    rows, batch, seq_len, steps, offset, dim,
    dropout_key_ptr, dropout_threshold, dropout_scale: tl.float64,  # the forward's dropout (_dout_rows)
    lr: tl.float64, beta1: tl.float64, beta2: tl.float64, eps: tl.float64, weight_decay: tl.float64,
    momentum: tl.float64, dampening: tl.float64, bias_correction1: tl.float64, bias_correction2_sqrt: tl.float64,
    HAS_DROPOUT: tl.constexpr, RULE: tl.constexpr, DECOUPLED: tl.constexpr, NESTEROV: tl.constexpr,
    MAXIMIZE: tl.constexpr, FIRST: tl.constexpr, HAS_STATE1: tl.constexpr, HAS_STATE2: tl.constexpr,
    COMPUTE_F64: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The optimizer inside the backward for the learned positions (p = offset + t), their
    gradient never in memory: row p's gradient is its sum over the batch (_batch_sums, as
    _batch_sum_kernel sums it), rounded to the table's dtype as the stored gradient would
    be -- the same bits -- and the rule applied to the row at once (_apply_rule); every row
    (dense semantics: g = 0 for the rows the sequence does not reach). One row per program,
    as _batch_sum_kernel."""
    acc_dtype = tl.float64 if COMPUTE_F64 else tl.float32
    p = tl.program_id(0).to(tl.int64) + tl.zeros([1, 1], dtype=tl.int64)
    cols = (tl.program_id(1).to(tl.int64) * BLOCK_D + tl.arange(0, BLOCK_D))[None, :]
    col_ok = cols < dim
    acc = _batch_sums(dout_ptr, p, cols, col_ok, batch, seq_len, steps, offset, dim, dout_ptr, dout_ptr, 1.0,
                      dropout_key_ptr, dropout_threshold, dropout_scale, False, HAS_DROPOUT, COMPUTE_F64, 1, BLOCK_D)
    g = _rounded(acc, param_ptr).to(acc_dtype)  # the gradient as stored
    _update_rows(param_ptr, state1_ptr, state2_ptr, p * dim + cols, (p < rows) & col_ok, g, lr, beta1, beta2, eps,
                 weight_decay, momentum, dampening, bias_correction1, bias_correction2_sqrt, RULE, DECOUPLED, NESTEROV,
                 MAXIMIZE, FIRST, HAS_STATE1, HAS_STATE2, COMPUTE_F64)

# --------------------------------------------------------------------------- launchers
def _direct(kernel):
    """The default ``launch``: the kernel's cached launcher (kernels/launch.py), or
    torch.library.wrap_triton when a compiled graph is being traced (pyembed/_triton.py)."""
    return cached(kernel)


def _rule_args(rule: int, hyper, param, state1, state2) -> tuple[tuple, tuple, dict]:
    """(the update kernels' state pointers -- the table's in place of a state the rule keeps
    none of, never read --, their nine scalars, their rule constexprs) from the rule's tuple
    as pyembed/optim.py builds it (csrc/optim.h, Scalars::from); the scalars a rule does not
    use are 0 (1 for the bias corrections)."""
    lr = beta1 = beta2 = eps = wd = momentum = dampening = 0.0
    bc1 = bc2_sqrt = 1.0
    decoupled = nesterov = maximize = first = False
    if rule == 0:
        lr, momentum, dampening, wd, nesterov, maximize, first = hyper[:7]
    elif rule == 1:
        lr, beta1, beta2, eps, wd, decoupled, maximize, bc1, bc2_sqrt = hyper[:9]
    elif rule == 2:
        lr, wd, eps, maximize = hyper[:4]
    else:
        lr, beta1, beta2, eps, maximize = hyper[:5]
    has1, has2 = state1.numel() > 0, state2.numel() > 0
    states = (state1 if has1 else param, state2 if has2 else param)
    return (states, (lr, beta1, beta2, eps, wd, momentum, dampening, bc1, bc2_sqrt),
            dict(RULE=rule, DECOUPLED=bool(decoupled), NESTEROV=bool(nesterov), MAXIMIZE=bool(maximize),
                 FIRST=bool(first), HAS_STATE1=has1, HAS_STATE2=has2))


def optimizer_update(param, state1, state2, rows, values, rule: int, hyper, all_rows: bool, launch=_direct):
    """torch.ops.pyembed.optimizer_update's schema (csrc/pyembed.cpp) on the Triton kernel:
    rows (touched,) int64 got gradient rows values (touched, d); hyper as pyembed/optim.py
    builds it per rule; rows outside the table (-1: touched_rows's unused slots) are
    skipped. With all_rows every table row is updated, its gradient row found in rows
    (ascending, unused slots last: as touched_rows and the sparse backward give them) by
    a binary search in the kernel."""
    num_rows, dim = param.shape
    touched = rows.numel()
    count = num_rows if all_rows else touched
    if count == 0 or dim == 0:
        return
    states, scalars, rule_flags = _rule_args(rule, hyper, param, state1, state2)
    _, block_d = _blocks(dim)
    block_r = max(1, TILE_ELEMENTS // 2 // block_d)  # five tiles live: p, g, two states, a temporary
    launch(_optimizer_update_kernel)[(_cdiv(count, block_r), _cdiv(dim, block_d))](
        param, *states, rows, values, num_rows, touched, dim, *scalars, **rule_flags, ALL_ROWS=all_rows,
        COMPUTE_F64=param.dtype == torch.float64, BLOCK_R=block_r, BLOCK_D=block_d,
    )


def error_record_parts(address: int) -> tuple[int, int]:
    """The error record's address as the forward kernel takes it: the bits above the low 31
    and the low 31, two ints below 2^31 (embedding_forward says why)."""
    return address >> 31, address & 0x7FFFFFFF


def wide_slots(num_tokens: int, block_t: int) -> bool:
    """Whether the forward's slots (cdiv(num_tokens, BLOCK_T) * BLOCK_T of them) pass int32."""
    return num_tokens + block_t > 2**31


def embedding_forward(ids, weight, pos_weight, position_ids, pos_mode: int, scale: float, offset: int,
                      dropout_key, dropout_threshold: int, dropout_scale: float, sinusoid_column_offset: int,
                      sinusoid_dim: int, out, launch=_direct, error_record: int = 0):
    """Fill out (ids.numel(), d) in place; dropout_key None: no dropout; the sinusoid of
    column j is column sinusoid_column_offset + j (even) of a sinusoid_dim-wide one;
    error_record: the address the range check records into (0: no check), which the kernel
    takes as its high bits and low 31 bits: Inductor of torch 2.11 fails to compile a user
    kernel given an int beyond int32 ('int' object has no attribute 'xreplace', seen on the
    H100). ``launch`` wraps the kernel (torch.library's wrap_triton when torch.compile traces
    the op: pyembed/_triton.py; a launch.Binding with FORWARD_REPLAYED(_ALL), which keeps it)."""
    num_tokens, dim = ids.numel(), weight.shape[1]
    if num_tokens == 0 or dim == 0:
        return
    block_t, block_d = _blocks(dim, pos_mode, dropout_key is not None)
    grid = (_cdiv(num_tokens, block_t), _cdiv(dim, block_d))
    launch(_embedding_forward_kernel)[grid](
        ids, weight, pos_weight if pos_weight is not None else weight,
        position_ids if position_ids is not None else ids, dropout_key if dropout_key is not None else ids, out,
        num_tokens, ids.shape[-1] if ids.dim() else 1, weight.shape[0],
        pos_weight.shape[0] if pos_weight is not None else 0, dim, offset, scale, -math.log(10000.0) / sinusoid_dim,
        sinusoid_column_offset // 2,
        dropout_threshold, dropout_scale, *error_record_parts(error_record),
        POS_MODE=pos_mode, HAS_POSITION_IDS=position_ids is not None, HAS_DROPOUT=dropout_key is not None,
        COMPUTE_F64=weight.dtype == torch.float64, CHECK_RANGES=error_record != 0,
        WIDE_SLOTS=wide_slots(num_tokens, block_t), BLOCK_T=block_t, BLOCK_D=block_d,
    )


# The forward's parameters that change between lookups of the same metadata (shapes,
# dtypes, positional encoding, scale, error record, whether position_ids and a dropout key
# are given, the dropout's p): the tensors -- the unused pointers take the ids, and the
# positional table's the table when there is none, as embedding_forward passes them -- and
# the offset (a decoder's position). FORWARD_REPLAYED for a lookup without position_ids or
# dropout; FORWARD_REPLAYED_ALL with either: its replay takes both (the ids where one is not given).
FORWARD_REPLAYED = dict(tensors=(("ids_ptr", "position_ids_ptr", "dropout_key_ptr"), "weight_ptr", "pos_weight_ptr",
                                 "out_ptr"), ints=("offset",))
FORWARD_REPLAYED_ALL = dict(tensors=("ids_ptr", "position_ids_ptr", "dropout_key_ptr", "weight_ptr", "pos_weight_ptr",
                                     "out_ptr"), ints=("offset",))


BOUNDS_BLOCK = 1024  # sorted positions per program of the sort-input and segment-start kernels
MERGE_BLOCK = 64  # words per program of _merge_tiles_kernel: 64 x 32 lower bounds searched at once
# _merge_tiles_kernel's launch options (kernels.launch.LAUNCH_OPTIONS): registers a thread
# may take. Left to its own budget, ptxas issued each of a thread's 16 probes of a search
# step right after the previous one's compare -- one load in flight with the GPU machine's
# Triton 3.6, three with 3.8 (sm_90 SASS, nvdisasm; tests/test_triton_aot.py) -- where the
# cuda backend's merge issues its 32 before any compare (8.3 us against this kernel's 20.7
# on the H200 at 26f0ba6, GPT-2 8x2048). Given 80, both issue all 16 first (72 registers).
MERGE_OPTIONS = {"maxnreg": 80}
CHUNK_ROWS = 128  # sorted positions per chunk: the longest segment summed directly
# A dense gradient of at most this many tokens skips the sort: one kernel, in which a
# program reads every key per tile of rows it writes (csrc/cuda's kFewTokens). The sorted
# path is three or four launches -- all host cost for a one-token step.
FEW_TOKENS = 32


class Segments(NamedTuple):
    """The segments of equal used keys among the stably sorted keys, numbered by table row
    (a dense gradient: num_rows entries, [0, 0) where untouched) or by slot (sparse
    gradients: slot s is the s-th segment in key order, with its key; min(tokens,
    num_rows) entries, a size the host knows without asking the device; ``count`` on the
    device says how many are real), and the partial sums of the pieces of segments longer
    than a chunk (``_chunk_kernel``; None when no segment can be).

    The bounds are one tensor the kernels index in parts, not a view per part: each view
    costs the host about a microsecond, which a GPU backward pays on every call."""

    order: torch.Tensor  # (tokens,) token index of each sorted position
    # int64, in parts of `entries`: sorted positions [begin, end) of each segment, its first
    # token order[begin] (0 where empty); then by slot the key of slot s (-1 when empty), or
    # by row with_solo, per token (tokens entries), its key if it is its segment's only token, else -1
    bounds: torch.Tensor
    entries: int
    with_solo: bool
    count: Optional[torch.Tensor]  # by slot: () int64 on the device
    partials: Optional[torch.Tensor]  # (2 * chunks, d) in the compute dtype

    @property
    def keys(self) -> torch.Tensor:
        """By slot: the key of each slot (-1 when empty)."""
        return self.bounds[3 * self.entries:4 * self.entries]

    @property
    def solo(self) -> torch.Tensor:
        """By row, with_solo: per token, its key if it is its segment's only token, else -1."""
        return self.bounds[3 * self.entries:]


class DoutDropout(NamedTuple):
    """The forward's dropout, which the dense backward's kernels apply to dout as they read
    it (_dout_rows): its key and the forward kernel's threshold and 1 / (1 - p)."""

    key: torch.Tensor  # (2,) int64 [seed, offset]
    threshold: int
    scale: float

    @staticmethod
    def launch_args(dropout: Optional["DoutDropout"], unused: torch.Tensor) -> tuple:
        """The kernels' (dropout_key_ptr, dropout_threshold, dropout_scale); ``unused`` stands
        for the key without dropout (HAS_DROPOUT=False: never read)."""
        return (unused, 0, 1.0) if dropout is None else (dropout.key, dropout.threshold, dropout.scale)


def tile_sorts(n: int, num_rows: int) -> bool:
    """The tile sort takes these keys (n tokens over num_rows rows): it fits them, and
    PYEMBED_TRITON_TILE_SORT=0 (read by each call: how tests reach torch's sort, the one past
    2^14 tokens, with few) does not ask for torch's sort."""
    return (0 < n <= TILE_SORT_TILE * TILE_SORT_MAX_TILES and num_rows < 2**TILE_SORT_KEY_BITS
            and os.environ.get("PYEMBED_TRITON_TILE_SORT") != "0")


def tile_sort(keys, sorted_keys, order, bounds, num_zeros: int, num_rows: int, skip: int, launch=_direct,
              blocks: Optional[tuple[int, int, int]] = None):
    """The keys' compacted values sorted stably into sorted_keys, their tokens into order,
    and the bounds' starting values set: _tile_rank_kernel, then _merge_tiles_kernel
    unless one tile holds every key. blocks: (ROWS, COLUMNS, merge BLOCK), by default the
    GPU's, or under the interpreter (CPU tensors) whole tiles, which it runs as one NumPy
    operation each rather than as eight programs of eight steps (tests/test_triton_sort.py
    runs the GPU's blocks there too)."""
    n = keys.numel()
    rows, columns, merge_block = blocks or ((RANK_ROWS, RANK_COLUMNS, MERGE_BLOCK) if keys.is_cuda else
                                            (TILE_SORT_TILE, TILE_SORT_TILE, 1024))
    one_tile = n <= TILE_SORT_TILE
    # One tile writes no words: the keys stand in for them (an output would alias two outputs).
    words = keys if one_tile else torch.empty(n, dtype=torch.int32, device=keys.device)
    rank_programs = _cdiv(n, rows)
    launch(_tile_rank_kernel)[(rank_programs + _cdiv(bounds.numel(), BOUNDS_BLOCK),)](
        keys, words, sorted_keys, order, bounds, n, rank_programs, num_zeros, bounds.numel(), num_rows, skip,
        ONE_TILE=one_tile, TILE=TILE_SORT_TILE, ROWS=rows, COLUMNS=columns, BLOCK=BOUNDS_BLOCK)
    if not one_tile:
        launch(_merge_tiles_kernel)[(_cdiv(n, merge_block),)](
            words, sorted_keys, order, n, TILE=TILE_SORT_TILE, MAX_TILES=TILE_SORT_MAX_TILES, BLOCK=merge_block,
            **MERGE_OPTIONS)


def sorted_segments(dout2d, keys, num_rows: int, skip: int, by_row: bool, launch=_direct,
                    with_solo: bool = False, dropout: Optional[DoutDropout] = None) -> Segments:
    """Segments of the keys in [0, num_rows) other than ``skip`` (out-of-range ids and the
    padding row are left out), without a device->host sync. Launches: the tile sort's one
    or two (else the sort's inputs and torch's sort), [by slot: the segment starts and their
    scan], one pass over the chunks.
    with_solo (by row only): mark the tokens alone in their segments (Segments.solo).
    dropout: the partial sums read dout through the forward's mask."""
    keys = keys.reshape(-1)
    n, dim, device = keys.numel(), dout2d.shape[1], keys.device
    num_rows = max(num_rows, 0)
    entries = num_rows if by_row else min(n, num_rows)
    # begin, end, first token (zeros), [by slot: keys (-1)], [with_solo: solo (-1), by token]:
    # set by _sort_inputs_kernel
    bounds = torch.empty(3 * entries + (0 if by_row else entries) + (n if with_solo else 0), dtype=torch.long,
                         device=device)
    compact = torch.empty(n, dtype=sort_key_dtype(num_rows), device=device)
    if tile_sorts(n, num_rows):
        sorted_keys, order = compact, torch.empty(n, dtype=torch.long, device=device)
        tile_sort(keys, sorted_keys, order, bounds, 3 * entries, num_rows, skip, launch)
    else:
        if n + bounds.numel():
            launch(_sort_inputs_kernel)[(_cdiv(max(n, bounds.numel()), BOUNDS_BLOCK),)](
                keys, compact, bounds, n, 3 * entries, bounds.numel(), num_rows, skip, BLOCK=BOUNDS_BLOCK)
        if n == 0:
            return Segments(torch.empty(0, dtype=torch.long, device=device), bounds, entries, with_solo,
                            torch.zeros((), dtype=torch.long, device=device), None)
        sorted_keys, order = compact.sort(stable=True)  # unused keys (num_rows) sort last
    scan = count = None
    if not by_row:
        scan = torch.empty(n, dtype=torch.long, device=device)
        launch(_segment_starts_kernel)[(_cdiv(n, BOUNDS_BLOCK),)](sorted_keys, scan, n, num_rows, BLOCK=BOUNDS_BLOCK)
        scan.cumsum_(0)
        count = scan[-1]
    chunks = _cdiv(n, CHUNK_ROWS)
    acc = torch.float64 if dout2d.dtype == torch.float64 else torch.float32
    partials = torch.empty(2 * chunks, dim, dtype=acc, device=device) if n > CHUNK_ROWS and dim else None
    _, block_d = _blocks(dim, dropout=dropout is not None)
    launch(_chunk_kernel)[(chunks, _cdiv(dim, block_d) if partials is not None else 1)](
        sorted_keys, scan if scan is not None else order, bounds, dout2d, order,
        partials if partials is not None else dout2d, n, num_rows, entries, dim,
        *DoutDropout.launch_args(dropout, order), BY_SLOT=not by_row, HAS_PARTIALS=partials is not None,
        HAS_SOLO=with_solo, HAS_DROPOUT=dropout is not None, COMPUTE_F64=acc == torch.float64, CHUNK=CHUNK_ROWS,
        BLOCK_D=block_d,
    )
    return Segments(order, bounds, entries, with_solo, count, partials)


class PositionSums(NamedTuple):
    """The learned positions' gradient with p = offset + t (no position_ids): row p sums
    dout[b, t] over the batch for the ``steps`` positions the sequence reaches, the other
    rows zeros (_position_sums). Written by the programs after the token table's in that
    table's last kernel (one launch less per backward), or by batch_sum alone."""

    out: torch.Tensor  # (num_positions, d), num_positions and d > 0
    batch: int
    seq_len: int
    steps: int
    offset: int

    def launch_args(self) -> tuple:
        return (self.out, self.out.shape[0], self.batch, self.seq_len, self.steps, self.offset)


def _position_args(positions: Optional[PositionSums], dout2d) -> tuple:
    """The kernels' (pos_out_ptr, pos_rows, batch, seq_len, steps, offset): unused without positions."""
    return positions.launch_args() if positions is not None else (dout2d, 0, 0, 0, 0, 0)


def _programs_with_positions(rows: int, block_r: int, positions: Optional[PositionSums],
                             row_tiles: int = 1) -> tuple[int, int]:
    """(the programs over a table's `rows`, row_tiles * block_r each; all programs along
    axis 0): those after the table's write ``positions``' rows, BLOCK_R each (csrc/cuda's
    add_position_blocks)."""
    table_programs = _cdiv(rows, block_r * row_tiles)
    return table_programs, table_programs + (0 if positions is None else _cdiv(positions.out.shape[0], block_r))


def _segment_blocks(dim: int, dtype: torch.dtype, dropout: bool = False) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of _finish_segments_kernel: _blocks' tile, half as many rows in
    float64, whose values take two registers each (with 8 rows of 256 at d = 768 it spilled
    16 bytes on sm_90), and at most MAX_SEGMENT_ROWS (each row's bounds, two 64-bit values,
    are held beside the tile: 64 rows of d = 8 spilled 8 bytes on sm_80)."""
    block_r, block_d = _blocks(dim, dropout=dropout)
    return min(max(1, block_r // 2) if dtype == torch.float64 else block_r, MAX_SEGMENT_ROWS), block_d


def _setting(variable: str, choices: tuple[str, ...]) -> Optional[int]:
    """The value ``variable`` sets, one of ``choices``, or None where it is unset; any other
    value is refused. For the settings a GPU run times against each other (finish_row_tiles,
    finish_sum_stages), read when a call is planned."""
    chosen = os.environ.get(variable)
    if chosen is not None and chosen not in choices:
        allowed = ", ".join(choices[:-1]) + " or " + choices[-1]
        raise ValueError(f"{variable} must be {allowed}, not {chosen!r}")
    return None if chosen is None else int(chosen)


def finish_row_tiles(dtype: torch.dtype, dim, rows, zero_empty: bool) -> int:
    """_finish_segments_kernel's ROW_TILES for a ``rows`` x ``dim`` gradient: 4 for a dense
    one of 2-byte elements in 16-byte rows and 2^16 rows or more (Llama-3's 128256), else 1.
    A 4 KB tile is 32 bytes a thread; a program of four stores 128 (as `cuda`'s blocks do)
    after its one bounds round trip when none of its rows is summed -- most programs of a
    table that large (with learned positions, 8x2048 uniform ids leave 88% of Llama-3's
    programs so, GPT-2's 24%: a program that sums goes tile by tile, four in a row, so for
    GPT-2 four would serialise more than it saves). sm_90 registers at d = 4096: bf16 64 ->
    78 (8 -> 6 blocks an SM), 93 without positions, 109 with dropout; fp32 tiles are 64
    bytes a thread, and four took 80 -> 112. A sparse gradient's rows are all summed.
    PYEMBED_TRITON_ROW_TILES (1, 2 or 4; read when a call is planned) overrides, so that a
    GPU run can time each (tests/gpu/profile_workload.py)."""
    chosen = _setting("PYEMBED_TRITON_ROW_TILES", ("1", "2", "4"))
    if chosen is not None:
        return chosen
    static = type(dim) is int and type(rows) is int  # under torch.compile's dynamic shapes: 1, no guard
    wide = static and dtype.itemsize == 2 and dim * 2 % 16 == 0 and rows >= 2**16
    return 4 if zero_empty and wide else 1


def finish_sum_stages(dtype: torch.dtype, dropout: bool, row_tiles: int = 1) -> int:
    """_finish_segments_kernel's SUM_STAGES: 3 (the rows' loop pipelined) in programs of four
    row tiles of a 2-byte table (finish_row_tiles' default for 2^16 rows or more), else 1 (the
    loop as written); PYEMBED_TRITON_SUM_STAGES (1, 2 or 3; read when a call is planned) overrides,
    so that tests/gpu/profile_workload.py can time each. The H200 at 26f0ba6 (Triton 3.6,
    the dense backward op replayed from a CUDA graph, 8x2048): Llama-3 bf16 (four tiles)
    1 / 2 / 3 stages 373 / 375 / 386 us with uniform ids, 565 / 582 / 500 with Zipf ids --
    real text's; GPT-2 fp32 105 / 119 / 121 and 162 / 162 / 144, bf16 71 / 79 / 79 and 126 /
    130 / 106: there a third more with uniform ids for a seventh less with Zipf ones, so 1.
    Every tile pays in registers, where only the tiles with a long segment gain: sm_90,
    four-tile bf16 d = 4096, 80 -> 109 (Triton 3.6) / 78 -> 96 (3.8), plus 8 KB of shared
    memory. Always 1 with dropout or float64, where the pipelined loop spilled 8-24 bytes."""
    chosen = _setting("PYEMBED_TRITON_SUM_STAGES", ("1", "2", "3"))
    if dropout or dtype == torch.float64:
        return 1
    if chosen is not None:
        return chosen
    return 3 if row_tiles == 4 and dtype.itemsize == 2 else 1


def finish_segments(dout2d, segments: Segments, scale: float, divide_by_count: bool, out, zero_empty: bool,
                    launch=_direct, positions: Optional[PositionSums] = None, dropout: Optional[DoutDropout] = None):
    """out[g] = factor(g) * (sum of the dout rows of segment g) for the first out.shape[0]
    segments, in one launch: factor = scale, or scale / its token count; zero_empty: empty
    segments written as zeros (a dense gradient by row: each row written once). The same
    launch writes ``positions``, if given, and then the one-token segments' rows too when
    ``segments`` has their tokens (``solo``). dropout: dout read through the forward's mask."""
    rows, dim = out.shape
    block_r, block_d = _segment_blocks(dim, dout2d.dtype, dropout is not None)
    row_tiles = finish_row_tiles(out.dtype, dim, rows, zero_empty)
    sum_stages = finish_sum_stages(dout2d.dtype, dropout is not None, row_tiles)
    table_programs, programs = _programs_with_positions(rows, block_r, positions, row_tiles)
    if programs == 0 or dim == 0:
        return
    partials = segments.partials
    launch(_finish_segments_kernel)[(programs, _cdiv(dim, block_d))](
        dout2d, segments.order, partials if partials is not None else dout2d, segments.bounds, out,
        scale, rows, segments.entries, dim, table_programs, *_position_args(positions, dout2d),
        *DoutDropout.launch_args(dropout, segments.order),
        DIVIDE_BY_COUNT=divide_by_count, ZERO_EMPTY=zero_empty, HAS_PARTIALS=partials is not None,
        HAS_POSITIONS=positions is not None, HAS_SOLO=positions is not None and segments.with_solo,
        HAS_DROPOUT=dropout is not None, COMPUTE_F64=dout2d.dtype == torch.float64, CHUNK=CHUNK_ROWS,
        SUM_STAGES=sum_stages, ROW_TILES=row_tiles, BLOCK_R=block_r, BLOCK_D=block_d,
    )


def dense_gradient(dout2d, keys, num_rows: int, skip: int, scale: float, divide_by_count: bool, launch=_direct,
                   positions: Optional[PositionSums] = None, dropout: Optional[DoutDropout] = None):
    """The (num_rows, d) gradient of the rows named by ``keys``, each row written once
    (untouched ones as zeros: no fill before). Two kernels after the sort; one for
    at most FEW_TOKENS tokens. The last one also writes ``positions``, if given. dropout:
    every kernel reads dout through the forward's mask (no pass over dout before)."""
    grad = dout2d.new_empty(num_rows, dout2d.shape[1])
    if keys.numel() <= FEW_TOKENS:
        dim = dout2d.shape[1]
        # Dropout's keep bits here are one token's row at a time, beside the whole tile's
        # sums: the full tile (half of it spilled 16 B for bf16 on sm_80), whole Philox groups.
        block_r, block_d = _blocks(max(dim, 4) if dropout is not None else dim)
        table_programs, programs = _programs_with_positions(num_rows, block_r, positions)
        if programs and dim:
            launch(_few_tokens_gradient_kernel)[(programs, _cdiv(dim, block_d))](
                keys.reshape(-1), dout2d, grad, scale, keys.numel(), num_rows, skip, dim, table_programs,
                *_position_args(positions, dout2d), *DoutDropout.launch_args(dropout, grad),
                DIVIDE_BY_COUNT=divide_by_count, HAS_POSITIONS=positions is not None,
                HAS_DROPOUT=dropout is not None, COMPUTE_F64=dout2d.dtype == torch.float64, FEW=FEW_TOKENS,
                BLOCK_R=block_r, BLOCK_D=block_d,
            )
        return grad
    # The position programs write the one-token rows when they read every token (_position_sums).
    with_solo = positions is not None and positions.steps == positions.seq_len
    segments = sorted_segments(dout2d, keys, num_rows, skip, by_row=True, launch=launch, with_solo=with_solo,
                               dropout=dropout)
    finish_segments(dout2d, segments, scale, divide_by_count, grad, zero_empty=True, launch=launch,
                    positions=positions, dropout=dropout)
    return grad


def used_row_sums(dout2d, keys, num_rows: int, skip: int, scale: float, divide_by_count: bool, exact: bool,
                  dropout: Optional[DoutDropout] = None, launch=_direct):
    """(rows, values) by slot: slot s holds the s-th smallest used key and its tokens'
    scaled sum. exact: the U used rows only (one host sync, for U); else min(tokens, V)
    slots, a size the host knows, those past the used rows marked row -1 (values not
    written). At most FEW_TOKENS tokens: one kernel; else the sort and two kernels around.
    dropout: dout read through the forward's mask."""
    keys = keys.reshape(-1)
    n, dim = keys.numel(), dout2d.shape[1]
    if n <= FEW_TOKENS:
        slots = min(n, max(num_rows, 0))
        rows = torch.empty(slots, dtype=torch.long, device=keys.device)
        values = dout2d.new_empty(slots, dim)
        if slots:
            # A tile holds every slot's sums; whole Philox groups with dropout
            block_d = max(min(_blocks(dim)[1], TILE_ELEMENTS // FEW_TOKENS), 4 if dropout is not None else 1)
            launch(_few_tokens_slots_kernel)[(1, max(_cdiv(dim, block_d), 1))](
                keys, dout2d, rows, values, scale, n, slots, num_rows, skip, dim,
                *DoutDropout.launch_args(dropout, rows), DIVIDE_BY_COUNT=divide_by_count,
                HAS_DROPOUT=dropout is not None, COMPUTE_F64=dout2d.dtype == torch.float64, FEW=FEW_TOKENS,
                BLOCK_D=block_d,
            )
        if exact:
            used = int((rows >= 0).sum())
            return rows[:used], values[:used]
        return rows, values
    segments = sorted_segments(dout2d, keys, num_rows, skip, by_row=False, launch=launch, dropout=dropout)
    values = dout2d.new_empty(int(segments.count) if exact else segments.entries, dim)
    finish_segments(dout2d, segments, scale, divide_by_count, values, zero_empty=False, launch=launch,
                    dropout=dropout)
    if exact:
        return segments.keys[:values.shape[0]].clone(), values
    return segments.keys, values  # -1 where no segment landed


def batch_sum(dout2d, positions: PositionSums, launch=_direct, dropout: Optional[DoutDropout] = None):
    """The learned positions' gradient alone, in one launch (the token table needs none):
    one row per program (a tile of rows spilled 16 B for fp16 on sm_80). dropout: dout
    read through the forward's mask."""
    _, block_d = _blocks(dout2d.shape[1], dropout=dropout is not None)
    launch(_batch_sum_kernel)[(positions.out.shape[0], _cdiv(dout2d.shape[1], block_d))](
        dout2d, *positions.launch_args(), dout2d.shape[1], *DoutDropout.launch_args(dropout, positions.out),
        HAS_DROPOUT=dropout is not None, COMPUTE_F64=dout2d.dtype == torch.float64, BLOCK_R=1, BLOCK_D=block_d,
    )


def segment_update_blocks(dim: int, dtype: torch.dtype, dropout: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of _segment_update_kernel: half the rows of _finish_segments_kernel's
    tile without dropout (the update's tiles live beside the sum's: p, two states, a
    temporary), as many as its tile with dropout, which is half as tall already (a bf16 row
    of a quarter tile, 4 elements a thread at d = 768, loses its 16-byte accesses)."""
    block_r, block_d = _segment_blocks(dim, dtype, dropout)
    return (block_r if dropout else max(1, block_r // 2)), block_d


def optimizer_backward(dout2d, segments: Segments, scale: float, divide_by_count: bool, param, state1, state2,
                       rule: int, hyper, all_rows: bool, dropout: Optional[DoutDropout] = None, launch=_direct):
    """A dense token table's update by the gradient dense_gradient would give it, without
    that gradient (torch.ops.pyembed.optimizer_backward's work, past FEW_TOKENS tokens),
    from the sort and the chunks' pass (``segments``: sorted_segments by table row, which
    the caller plans as the dense backward's launches): one pass over the table's rows that
    sums each row's segment and updates the row (_segment_update_kernel). With the sort,
    three or four launches, no host sync, no (tokens, d) gradient rows in memory: the same
    bits as used_row_sums then optimizer_update (five to six launches, then three)."""
    num_rows, dim = param.shape
    if num_rows == 0 or dim == 0:
        return
    states, scalars, rule_flags = _rule_args(rule, hyper, param, state1, state2)
    block_r, block_d = segment_update_blocks(dim, param.dtype, dropout is not None)
    partials = segments.partials
    launch(_segment_update_kernel)[(_cdiv(num_rows, block_r), _cdiv(dim, block_d))](
        dout2d, segments.order, partials if partials is not None else dout2d, segments.bounds, param, *states,
        scale, num_rows, dim, *DoutDropout.launch_args(dropout, segments.order), *scalars,
        DIVIDE_BY_COUNT=divide_by_count, HAS_PARTIALS=partials is not None, HAS_DROPOUT=dropout is not None,
        **rule_flags, ALL_ROWS=all_rows, COMPUTE_F64=param.dtype == torch.float64, CHUNK=CHUNK_ROWS,
        BLOCK_R=block_r, BLOCK_D=block_d,
    )


def position_update(dout2d, param, state1, state2, batch: int, seq_len: int, offset: int, rule: int, hyper,
                    dropout: Optional[DoutDropout] = None, launch=_direct):
    """The learned positions' update by the gradient batch_sum would give them (p = offset
    + t, no position_ids), without that gradient: one launch, every row (a dense rule) --
    where the gradient's op and optimizer_update took two and a (rows, d) buffer between."""
    rows, dim = param.shape
    if rows == 0 or dim == 0:
        return
    states, scalars, rule_flags = _rule_args(rule, hyper, param, state1, state2)
    _, block_d = _blocks(dim, dropout=dropout is not None)
    launch(_position_update_kernel)[(rows, _cdiv(dim, block_d))](
        dout2d, param, *states, rows, batch, seq_len, min(max(rows - offset, 0), seq_len), offset, dim,
        *DoutDropout.launch_args(dropout, param), *scalars, HAS_DROPOUT=dropout is not None, **rule_flags,
        COMPUTE_F64=param.dtype == torch.float64, BLOCK_D=block_d,
    )


# Every kernel's cache key, computed now, in definition order. Triton 3.6 (the GPU machine's)
# folds the global constants a kernel reads into its key in a way that depends on which
# kernels' keys a process computed first (seen: a kernel keyed with or without constants its
# helpers read, by that order): the same call keyed _chunk_kernel, _merge_tiles_kernel and the
# checked forward otherwise in a process launching a lookup and its backward than in one
# compiling them from tests/triton_specs.py's record, so the test step's workers missed what
# `triton_specs.py warm` had compiled beside gpu-check's build. Computed here, every process
# keys them alike (~12 ms once, on the first use of the triton backend; 3.8 keys them alike
# in any order).
def _key_every_kernel() -> None:
    for value in list(globals().values()):
        if isinstance(value, JITFunction):  # not under the interpreter: its kernels have no key
            value.cache_key


_key_every_kernel()
