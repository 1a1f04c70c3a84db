"""The reference backend: the whole contract of DESIGN.md §1 in plain PyTorch.

This file is the spec in code. Every other backend (cpu, cuda, triton) is tested
against it, and it is deliberately written for clarity, not speed:

    out[b, t] = round_to_weight_dtype(f32(W[ids[b, t]]) * scale + f32(PE(p(b, t))))
    (with dropout q: times keep(n, j) / (1 - q) before the rounding, n = flat token index)

    dW[v] = scale * sum_{(b,t): ids[b,t] = v} dout[b, t]    (v != padding_idx;
            each term divided by count(v) with scale_grad_by_freq)
    dP[p] = sum_{(b,t): p(b,t) = p} dout[b, t]              (learned positions only)

Arithmetic runs in float32 (float64 for float64 tables) with one rounding at the end;
gradients are accumulated in that same compute dtype over the *touched* rows only.

The three functions (forward, dense backward, sparse backward) give every backend's ops
their schemas (pyembed/_ops.py holds the contract: fakes, vmap rules, the Backend record);
pyembed/dispatch.py registers them as the custom ops ``pyembed::reference_*``. The range
checks (validate=True) are one op of their own, in pyembed.checks.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 tables compute in float64; every other float dtype in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------- positions
def token_positions(ids: torch.Tensor, position_ids: Optional[torch.Tensor], offset: int) -> torch.Tensor:
    """p(b, t) for every token, flattened to (N,) int64: position_ids, else offset + t."""
    if position_ids is not None:
        return position_ids.reshape(-1).long()
    seq_len = ids.shape[-1] if ids.dim() > 0 else 1
    t = torch.arange(offset, offset + seq_len, device=ids.device, dtype=torch.long)
    return t.repeat(ids.numel() // max(seq_len, 1))


def sinusoid(positions: torch.Tensor, embed_dim: int, column_offset: int = 0, num_columns: Optional[int] = None,
             dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The closed form in float64: PE(p, 2i) = sin(p w_i), PE(p, 2i+1) = cos(p w_i),
    w_i = exp(-(2i) ln(10000) / d), d = embed_dim. positions: (N,) integer -> (N, num_columns)
    float64: columns [column_offset, column_offset + num_columns) (default: all d), so a
    column shard of the table gets its columns at their global index. column_offset is even.
    (Another ``dtype`` computes it in that dtype: pyembed.decompositions, for runtimes
    without float64.)"""
    num_columns = embed_dim - column_offset if num_columns is None else num_columns
    i = torch.arange(column_offset // 2, (column_offset + num_columns + 1) // 2, device=positions.device,
                     dtype=dtype)
    w = torch.exp(-(2.0 * i) * math.log(10000.0) / embed_dim)
    angle = positions.to(dtype)[:, None] * w[None, :]
    # Interleave (sin, cos) pairs: stack on a last axis of 2, then flatten it into columns.
    pe = torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).reshape(positions.numel(), 2 * i.numel())
    return pe[:, :num_columns]


def check_sinusoid_columns(pos_encoding: str, column_offset: int, total_dim: int, embed_dim: int) -> None:
    """The forward ops' sinusoid_column_offset / sinusoid_dim: an even-aligned slice of an
    even-wide encoding (the C++ ops check the same, in csrc/checks.h)."""
    if pos_encoding != "sinusoidal" or (column_offset == 0 and total_dim in (0, embed_dim)):
        return  # the whole table (whose even d the callers check)
    if column_offset < 0 or column_offset % 2 or total_dim % 2 or column_offset + embed_dim > total_dim:
        raise ValueError(f"pyembed: sinusoid columns {column_offset}..{column_offset + embed_dim} are not an "
                         f"even-aligned slice of an even {total_dim}-wide encoding")


# --------------------------------------------------------------------------- forward
def embedding_forward(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    pos_encoding: str,
    scale: float,
    offset: int,
    dropout_key: Optional[torch.Tensor],
    dropout_p: float,
    sinusoid_column_offset: int = 0,
    sinusoid_dim: int = 0,
    error_record: int = 0,
) -> torch.Tensor:
    """ids: (B, T) or (T,) int32/int64 (any shape when pos_encoding == "none");
    weight: (V, d); pos_weight: (max_seq_len, d) for "learned"; position_ids: like ids;
    dropout_key: None, or the (2,) int64 [seed, offset] of ``dropout_keep`` with dropout_p.
    sinusoid_column_offset, sinusoid_dim: for a column shard of a wider table (DTensor
    Shard(1)): the sinusoid of column j is column sinusoid_column_offset + j (even) of a
    sinusoid_dim-wide encoding (0: d, the whole table).
    error_record: the address of the GPU backends' in-kernel range check's record
    (pyembed.checks); this spec, like the cpu backend, is always checked before the call
    instead, so it takes the argument (the schema every backend shares) and ignores it.
    Returns ids.shape + (d,) in weight.dtype. The range checks run before, in
    pyembed.checks (validate=True); unchecked, an out-of-range id gives a zero output row
    (positional term included) and an out-of-range learned position a zero positional
    term -- never an out-of-bounds access."""
    num_embeddings, embed_dim = weight.shape
    check_sinusoid_columns(pos_encoding, sinusoid_column_offset, sinusoid_dim, embed_dim)
    acc = compute_dtype(weight.dtype)

    flat = ids.reshape(-1).long()
    # Each term is computed by flat token and brought to the output's shape before it is
    # added: the output is a tensor of its own, not a view of one made here, which autograd
    # would not let a caller change in place (as nn.Embedding's output can be: `x *= s`).
    shape = (*ids.shape, embed_dim)
    out = _gather_rows(weight, flat, acc).reshape(shape) * scale
    if pos_encoding != "none":
        positions = token_positions(ids, position_ids, offset)
        if pos_encoding == "learned":
            pe = _gather_rows(pos_weight, positions, acc)
        else:
            pe = sinusoid(positions, sinusoid_dim or embed_dim, sinusoid_column_offset, embed_dim).to(acc)
        # An out-of-range id gives a zero row, positional term included: vocab-parallel
        # ranks (pyembed.parallel) sum their rows, so each token's is added once.
        id_ok = (flat >= 0) & (flat < num_embeddings)
        out = out + torch.where(id_ok[:, None], pe, torch.zeros((), dtype=acc, device=pe.device)).reshape(shape)
    if dropout_key is not None:
        keep = dropout_keep(dropout_key, flat.numel(), embed_dim, dropout_p).reshape(shape)
        out = torch.where(keep, out * torch.tensor(dropout_scale(dropout_p), dtype=acc, device=out.device), 0)
    return out.to(weight.dtype)


def _gather_rows(table: torch.Tensor, rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """table[rows] in the compute dtype; rows outside [0, len(table)) give zero rows."""
    valid = (rows >= 0) & (rows < table.shape[0])
    if table.shape[0] == 0:
        return torch.zeros(rows.numel(), table.shape[1], dtype=acc, device=table.device)
    safe = torch.where(valid, rows, torch.zeros_like(rows))
    gathered = table.index_select(0, safe).to(acc)
    return torch.where(valid[:, None], gathered, torch.zeros((), dtype=acc, device=table.device))


# --------------------------------------------------------------------------- dropout
# Element (n, j) of the output -- flat token n, column j -- is kept iff u >= p, where
# u = r * 2^-32 and r is word j % 4 of Philox4x32-10 with
#     key     = (lo32(seed), hi32(seed))
#     counter = (lo32(offset + j // 4), hi32(offset + j // 4), lo32(n), hi32(n)),
# i.e. at::philox_engine(seed, subsequence=n, offset=offset + j // 4) in C++ and
# tl.philox(seed, c0, c1, c2, c3) in Triton: the same bits on every backend. [seed, offset]
# is drawn once per call (``draw_dropout_key``); nothing (B, T, d)-sized is ever stored.
_PHILOX_ROUND_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
_PHILOX_KEY_STEPS = (0x9E3779B9, 0xBB67AE85)
_LOW32 = 0xFFFFFFFF
KEY_BOUND = 2**62  # seed and offset are drawn in [0, 2^62): offset + j // 4 never overflows


def draw_dropout_key(device: torch.device, generator: Optional[torch.Generator] = None) -> torch.Tensor:
    """[seed, offset] (int64, on ``device``) from ``generator`` or the device's default
    generator: no host sync, and ``torch.manual_seed`` reproduces it."""
    return torch.randint(0, KEY_BOUND, (2,), dtype=torch.long, device=device, generator=generator)


def dropout_threshold(p: float) -> int:
    """u >= p  <=>  r >= ceil(p * 2^32) (exact: p * 2^32 is exact in float64); 2^32 for
    p = 1 keeps nothing."""
    return math.ceil(math.ldexp(p, 32))


def dropout_scale(p: float) -> float:
    """What a kept element is multiplied by (rounded once to the compute dtype)."""
    return 1.0 / (1.0 - p) if p < 1.0 else 0.0


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of the 64-bit product of the 32-bit constant a and 32-bit words b,
    in int64 without overflow: a is split into 16-bit halves, each product < 2^48."""
    low_part, high_part = b * (a & 0xFFFF), b * (a >> 16)
    low = low_part + ((high_part & 0xFFFF) << 16)
    return (high_part >> 16) + (low >> 32), low & _LOW32


def philox4x32(key: torch.Tensor, c0, c1, c2, c3) -> list[torch.Tensor]:
    """Philox4x32-10 (Salmon et al. 2011) on int64 tensors holding 32-bit words (the
    counter words broadcast together); key: (2,) int64 [lo32, hi32]."""
    k0, k1 = key[0], key[1]
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_PHILOX_ROUND_MULTIPLIERS[1], c2)
        hi_a, lo_a = _mul_hi_lo(_PHILOX_ROUND_MULTIPLIERS[0], c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _PHILOX_KEY_STEPS[0]) & _LOW32, (k1 + _PHILOX_KEY_STEPS[1]) & _LOW32
    return [c0, c1, c2, c3]


def dropout_keep(dropout_key: torch.Tensor, num_tokens: int, dim: int, p: float) -> torch.Tensor:
    """(num_tokens, dim) bool: which output elements dropout keeps."""
    seed, offset = dropout_key.long()
    key = torch.stack((seed & _LOW32, seed >> 32))
    groups = offset + torch.arange((dim + 3) // 4, device=dropout_key.device)[None, :]  # (1, G)
    tokens = torch.arange(num_tokens, device=dropout_key.device)[:, None]  # (N, 1)
    words = philox4x32(key, groups & _LOW32, groups >> 32, tokens & _LOW32, tokens >> 32)
    # word j % 4 of group j // 4 (the width named: -1 is ambiguous for zero tokens)
    words = torch.stack(torch.broadcast_tensors(*words), dim=-1).reshape(num_tokens, 4 * groups.shape[1])[:, :dim]
    return words >= dropout_threshold(p)


# --------------------------------------------------------------------------- backward
def embedding_backward(
    grad_out: torch.Tensor,
    ids: torch.Tensor,
    position_ids: Optional[torch.Tensor],
    offset: int,
    num_embeddings: int,
    num_positions: int,
    scale: float,
    padding_idx: Optional[int],
    scale_grad_by_freq: bool,
    need_weight_grad: bool,
    need_pos_grad: bool,
    dropout_key: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense gradients: (weight_grad, pos_grad).
    - weight_grad (V, d), zero on untouched rows and the padding row, if need_weight_grad;
    - pos_grad (max_seq_len, d) for a learned table, if need_pos_grad.
    An output not needed is (0, d). Gradients are in grad_out's dtype, accumulated in fp32
    (fp64 for fp64). The kernels' backends compute this without a device->host sync.
    dropout_key: the forward's, with dropout_p: the gradients of grad_out through the
    forward's mask, as that mask applied alone stores it (in grad_out's dtype); the
    kernels' backends apply it as they read grad_out."""
    embed_dim = grad_out.shape[-1]
    dtype, acc = grad_out.dtype, compute_dtype(grad_out.dtype)
    dout = _masked_rows(grad_out, ids.numel(), dropout_key, dropout_p).to(acc)
    weight_grad = pos_grad = grad_out.new_empty(0, embed_dim)
    if need_weight_grad:
        rows, values = _weight_grad_rows(dout, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq)
        weight_grad = grad_out.new_zeros(num_embeddings, embed_dim)
        weight_grad.index_copy_(0, rows, values.to(dtype))
    if need_pos_grad:
        positions = token_positions(ids, position_ids, offset)
        keep = (positions >= 0) & (positions < num_positions)
        rows, sums, _ = _segment_sum(positions[keep], dout[keep])
        pos_grad = grad_out.new_zeros(num_positions, embed_dim)
        pos_grad.index_copy_(0, rows, sums.to(dtype))
    return weight_grad, pos_grad


def embedding_sparse_backward(
    grad_out: torch.Tensor,
    ids: torch.Tensor,
    num_embeddings: int,
    scale: float,
    padding_idx: Optional[int],
    scale_grad_by_freq: bool,
    dropout_key: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The token table's gradient as a coalesced COO gradient's (indices, values):
    rows (U,) the sorted unique touched ids (padding absent), values (U, d) their summed
    gradients. U depends on the data, so on a GPU this op syncs (tagged cudagraph_unsafe).
    dropout_key, dropout_p: as embedding_backward's."""
    acc = compute_dtype(grad_out.dtype)
    rows, values = _weight_grad_rows(_masked_rows(grad_out, ids.numel(), dropout_key, dropout_p).to(acc), ids,
                                     num_embeddings, scale, padding_idx, scale_grad_by_freq)
    return rows, values.to(grad_out.dtype)


def _masked_rows(grad_out: torch.Tensor, num_tokens: int, dropout_key: Optional[torch.Tensor],
                 dropout_p: float) -> torch.Tensor:
    """grad_out as (num_tokens, d) rows, through the forward's dropout mask when a key is
    given: the mask alone is a lookup of those rows, token n reading row n."""
    rows = grad_out.reshape(num_tokens, grad_out.shape[-1])  # not -1: d may be 0
    if dropout_key is None:
        return rows
    return embedding_forward(torch.arange(num_tokens, device=rows.device), rows, None, None, "none", 1.0, 0,
                             dropout_key, dropout_p)


def _weight_grad_rows(dout: torch.Tensor, ids: torch.Tensor, num_embeddings: int, scale: float,
                      padding_idx: Optional[int], scale_grad_by_freq: bool):
    """(sorted touched rows, their gradient rows in the compute dtype) of the token table."""
    flat = ids.reshape(-1).long()
    keep = (flat >= 0) & (flat < num_embeddings)
    if padding_idx is not None:
        keep &= flat != padding_idx
    rows, sums, counts = _segment_sum(flat[keep], dout[keep])
    # scale (and 1/count) applied once per touched row, after the sum.
    factor = torch.full_like(counts, scale, dtype=dout.dtype)
    if scale_grad_by_freq:
        factor = factor / counts.to(dout.dtype)
    return rows, sums * factor[:, None]


def _segment_sum(keys: torch.Tensor, values: torch.Tensor):
    """Sum the rows of values that share a key: (sorted unique keys, sums, counts).
    Only touched rows are materialised: O(unique keys x d) scratch, never O(V x d)."""
    rows, inverse, counts = torch.unique(keys, sorted=True, return_inverse=True, return_counts=True)
    sums = values.new_zeros(rows.numel(), values.shape[1]).index_add_(0, inverse, values)
    return rows, sums, counts


# --------------------------------------------------------------------------- tables
def sinusoidal_table(max_seq_len: int, embed_dim: int, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The (max_seq_len, embed_dim) sinusoidal table, computed in float64 then rounded.
    The fused op never reads this table; it is for inspection and for plain-PyTorch code."""
    if embed_dim % 2:
        raise ValueError(f"pyembed: sinusoidal encoding requires an even embedding dim, got d={embed_dim}")
    if max_seq_len < 0 or embed_dim < 0:
        raise ValueError(f"pyembed: a sinusoidal table of {max_seq_len} positions and d={embed_dim}: both must be >= 0")
    positions = torch.arange(max_seq_len, device=device)
    return sinusoid(positions, embed_dim).to(dtype)
