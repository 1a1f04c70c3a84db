"""The reference backend: the whole contract of DESIGN.md §1 in plain PyTorch.

This file is the spec in code. Every other backend (cpu, cuda, triton) is tested
against it, and it is deliberately written for clarity, not speed:

    out[b, t] = round_to_weight_dtype(f32(W[ids[b, t]]) * scale + f32(PE(p(b, t))))

    dW[v] = scale * sum_{(b,t): ids[b,t] = v} dout[b, t]    (v != padding_idx;
            each term divided by count(v) with scale_grad_by_freq)
    dP[p] = sum_{(b,t): p(b,t) = p} dout[b, t]              (learned positions only)

Arithmetic runs in float32 (float64 for float64 tables) with one rounding at the end;
gradients are accumulated in that same compute dtype over the *touched* rows only.

The two functions are registered as the custom ops ``pyembed::reference_forward`` and
``pyembed::reference_backward`` so that ``torch.compile`` sees one opaque op (the
data-dependent id checks inside never break a graph). Every backend's ops share the
schema below and the fake (meta) implementations at the end of this file.
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


def sinusoid(positions: torch.Tensor, embed_dim: int) -> torch.Tensor:
    """The closed form in float64: PE(p, 2i) = sin(p w_i), PE(p, 2i+1) = cos(p w_i),
    w_i = exp(-(2i) ln(10000) / d). positions: (N,) integer -> (N, d) float64."""
    i = torch.arange(embed_dim // 2, device=positions.device, dtype=torch.float64)
    w = torch.exp(-(2.0 * i) * math.log(10000.0) / embed_dim)
    angle = positions.to(torch.float64)[:, None] * w[None, :]
    # Interleave (sin, cos) pairs: stack on a last axis of 2, then flatten it into d.
    return torch.stack((torch.sin(angle), torch.cos(angle)), dim=-1).reshape(-1, embed_dim)


# --------------------------------------------------------------------------- checks
def check_ids_in_range(ids: torch.Tensor, num_embeddings: int) -> None:
    """IndexError naming the offending min/max and V (DESIGN §3). Syncs on a GPU."""
    if ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(ids))
    if lo < 0 or hi >= num_embeddings:
        raise IndexError(
            f"pyembed: ids out of range: min id {lo}, max id {hi}, but the embedding "
            f"table has V={num_embeddings} rows (valid ids are 0..{num_embeddings - 1})"
        )


def check_position_ids(position_ids: torch.Tensor, max_seq_len: Optional[int]) -> None:
    """ValueError for a negative position, or one past a learned table's max_seq_len."""
    if position_ids.numel() == 0:
        return
    lo, hi = (int(x) for x in torch.aminmax(position_ids))
    if lo < 0:
        raise ValueError(f"pyembed: position_ids must be >= 0, got min position {lo}")
    if max_seq_len is not None and hi >= max_seq_len:
        raise ValueError(
            f"pyembed: position {hi} is out of range for the learned positional table "
            f"with max_seq_len={max_seq_len}"
        )


# --------------------------------------------------------------------------- forward
def embedding_forward(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    pos_encoding: str,
    scale: float,
    offset: int,
    validate: bool,
) -> torch.Tensor:
    """ids: (B, T) or (T,) int32/int64 (any shape when pos_encoding == "none");
    weight: (V, d); pos_weight: (max_seq_len, d) for "learned"; position_ids: like ids.
    Returns ids.shape + (d,) in weight.dtype. With validate=False, an out-of-range id
    gives a zero output row (positional term included) and an out-of-range learned
    position a zero positional term, instead of raising."""
    num_embeddings, embed_dim = weight.shape
    if validate:
        check_ids_in_range(ids, num_embeddings)
        if position_ids is not None:
            check_position_ids(position_ids, pos_weight.shape[0] if pos_encoding == "learned" else None)
    acc = compute_dtype(weight.dtype)

    flat = ids.reshape(-1).long()
    out = _gather_rows(weight, flat, acc) * scale
    if pos_encoding != "none":
        positions = token_positions(ids, position_ids, offset)
        if pos_encoding == "learned":
            pe = _gather_rows(pos_weight, positions, acc)
        else:
            pe = sinusoid(positions, embed_dim).to(acc)
        # An out-of-range id gives a zero row, positional term included: vocab-parallel
        # ranks (pyembed.parallel) sum their rows, so each token's is added once.
        id_ok = (flat >= 0) & (flat < num_embeddings)
        out = out + torch.where(id_ok[:, None], pe, torch.zeros((), dtype=acc, device=pe.device))
    return out.to(weight.dtype).reshape(*ids.shape, embed_dim)


def _gather_rows(table: torch.Tensor, rows: torch.Tensor, acc: torch.dtype) -> torch.Tensor:
    """table[rows] in the compute dtype; rows outside [0, len(table)) give zero rows."""
    valid = (rows >= 0) & (rows < table.shape[0])
    if table.shape[0] == 0:
        return torch.zeros(rows.numel(), table.shape[1], dtype=acc, device=table.device)
    safe = torch.where(valid, rows, torch.zeros_like(rows))
    gathered = table.index_select(0, safe).to(acc)
    return torch.where(valid[:, None], gathered, torch.zeros((), dtype=acc, device=table.device))


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
    sparse: bool,
    need_weight_grad: bool,
    need_pos_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (weight_rows, weight_values, pos_grad), the layout every backend shares:
    - dense:  weight_rows empty (0,), weight_values the full (V, d) gradient;
    - sparse: weight_rows (U,) sorted unique touched ids (padding absent), weight_values
      (U, d) their summed gradients -- a coalesced COO gradient's indices and values;
    - pos_grad (max_seq_len, d) for a learned table, else (0, d).
    Outputs not needed are empty. Gradients are in grad_out's dtype, accumulated in fp32."""
    embed_dim = grad_out.shape[-1]
    dtype, acc = grad_out.dtype, compute_dtype(grad_out.dtype)
    dout = grad_out.reshape(-1, embed_dim).to(acc)
    no_rows = torch.empty(0, dtype=torch.long, device=grad_out.device)
    weight_rows, weight_values = no_rows, grad_out.new_empty(0, embed_dim)
    pos_grad = grad_out.new_empty(0, embed_dim)

    if need_weight_grad:
        flat = ids.reshape(-1).long()
        keep = (flat >= 0) & (flat < num_embeddings)
        if padding_idx is not None:
            keep &= flat != padding_idx
        rows, sums, counts = _segment_sum(flat[keep], dout[keep])
        # scale (and 1/count) applied once per touched row, after the fp32 sum.
        factor = torch.full_like(counts, scale, dtype=acc)
        if scale_grad_by_freq:
            factor = factor / counts.to(acc)
        values = (sums * factor[:, None]).to(dtype)
        if sparse:
            weight_rows, weight_values = rows, values
        else:
            weight_values = grad_out.new_zeros(num_embeddings, embed_dim)
            weight_values.index_copy_(0, rows, values)

    if need_pos_grad:
        positions = token_positions(ids, position_ids, offset)
        keep = (positions >= 0) & (positions < num_positions)
        rows, sums, _ = _segment_sum(positions[keep], dout[keep])
        pos_grad = grad_out.new_zeros(num_positions, embed_dim)
        pos_grad.index_copy_(0, rows, sums.to(dtype))
    return weight_rows, weight_values, pos_grad


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
    positions = torch.arange(max_seq_len, device=device)
    return sinusoid(positions, embed_dim).to(dtype)


# --------------------------------------------------------------------------- op registration
# Every backend's forward / backward op has the schema of the two functions above, so
# one fake implementation each serves them all (registered by each backend).
def forward_fake(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, validate):
    return weight.new_empty(*ids.shape, weight.shape[1])


def backward_fake(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale,
                  padding_idx, scale_grad_by_freq, sparse, need_weight_grad, need_pos_grad):
    embed_dim = grad_out.shape[-1]
    rows_count, value_rows = 0, 0
    if need_weight_grad and sparse:
        rows_count = value_rows = torch.library.get_ctx().new_dynamic_size()
    elif need_weight_grad:
        value_rows = num_embeddings
    return (
        grad_out.new_empty(rows_count, dtype=torch.long),
        grad_out.new_empty(value_rows, embed_dim),
        grad_out.new_empty(num_positions if need_pos_grad else 0, embed_dim),
    )


reference_forward = torch.library.custom_op("pyembed::reference_forward", mutates_args=())(embedding_forward)
reference_backward = torch.library.custom_op("pyembed::reference_backward", mutates_args=())(embedding_backward)
reference_forward.register_fake(forward_fake)
reference_backward.register_fake(backward_fake)
