"""``fused_embedding``: argument checks (DESIGN §3), backend dispatch, autograd.

Checks here read only metadata (dtype, shape, device), so they cost nothing under
``torch.compile``; the data-dependent ones (id range, negative or too-large
position_ids) are one op shared by every backend (pyembed.checks), skipped with
``validate=False``.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import checks, dispatch

_ID_DTYPES = (torch.int32, torch.int64)
_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def fused_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: Optional[torch.Tensor] = None,
    *,
    pos_encoding: Optional[str] = None,
    scale: float = 1.0,
    position_ids: Optional[torch.Tensor] = None,
    offset: int = 0,
    padding_idx: Optional[int] = None,
    scale_grad_by_freq: bool = False,
    sparse: bool = False,
    validate: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Token lookup, scaling and positional addition in one pass:
    ``out[b, t] = W[ids[b, t]] * scale + PE(p(b, t))``, computed in float32 and rounded once.

    Args:
        ids: (B, T) or (T,) int32/int64 token ids; any shape when there is no positional
            encoding (as ``nn.Embedding``).
        weight: (V, d) float32/float16/bfloat16 table (float64 on CPU / reference).
        pos_weight: (max_seq_len, d) learned positional table, same dtype as ``weight``.
        pos_encoding: None (inferred: "learned" if ``pos_weight`` is given, else none),
            "learned" or "sinusoidal" (computed on the fly, even d, any position).
        scale: multiplies the token rows (``math.sqrt(d)`` for scaled embeddings);
            applied in float32.
        position_ids: positions, same shape as ids, >= 0; default ``offset + t``.
        offset: first position when ``position_ids`` is None (incremental decoding).
        padding_idx: row that receives no gradient (negative counts from the end).
        scale_grad_by_freq: divide each gradient term by its id's count in the batch.
        sparse: the weight gradient is a coalesced ``torch.sparse_coo_tensor``. The
            learned positional gradient stays dense (nearly every position is touched).
        validate: check id / position ranges (a device sync on a GPU). With False, an
            out-of-range id yields a zero row, never an out-of-bounds access.
        backend: "auto", "reference", "cpu", "cuda" or "triton" (DESIGN §2).

    Returns:
        ``ids.shape + (d,)`` tensor of ``weight.dtype``.
    """
    pos_encoding = _check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset)
    return apply_fused(
        ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
        normalize_padding_idx(padding_idx, weight.shape[0]), scale_grad_by_freq, sparse, validate,
        dispatch.resolve(backend, weight.device),
    )


def normalize_padding_idx(padding_idx: Optional[int], num_embeddings: int) -> Optional[int]:
    """nn.Embedding's rule: padding_idx in [-V, V), negative counting from the end;
    returned in [0, V) (or None)."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise ValueError(f"pyembed: padding_idx={padding_idx} is out of range for V={num_embeddings}")
    return padding_idx % num_embeddings


def apply_fused(ids, weight, pos_weight, position_ids, pos_encoding: str, scale, offset, padding_idx,
                scale_grad_by_freq, sparse, validate, backend: dispatch.Backend, reduce_group=None) -> torch.Tensor:
    """FusedEmbeddingFunction on checked arguments (shared by fused_embedding and the
    vocab-parallel layer); the kernels index rows densely, so tensors are made contiguous."""
    return FusedEmbeddingFunction.apply(
        ids.contiguous(),
        weight.contiguous(),
        None if pos_weight is None else pos_weight.contiguous(),
        None if position_ids is None else position_ids.contiguous(),
        pos_encoding,
        float(scale),
        int(offset),
        padding_idx,
        bool(scale_grad_by_freq),
        bool(sparse),
        bool(validate),
        backend.name,
        reduce_group,
    )


class FusedEmbeddingFunction(torch.autograd.Function):
    """Forward and backward are each one op of the chosen backend. Only the ids and
    positions are saved for backward: never the table or the output.

    ``reduce_group`` serves the vocab-parallel layer (pyembed.parallel): each rank holds
    some rows, looks up the ids it holds (the others give zero rows) and the ranks'
    outputs are summed over the group (all-reduce). The backward is unchanged by that
    sum: every rank holds the whole output gradient (the layers after it are replicated).
    """

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
                padding_idx, scale_grad_by_freq, sparse, validate, backend, reduce_group):
        if validate:
            max_seq_len = pos_weight.shape[0] if pos_encoding == "learned" else None
            ids = checks.checked_ids(ids, weight.shape[0], position_ids, max_seq_len)
        out = dispatch.get(backend).forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset)
        if reduce_group is not None:
            torch.distributed.all_reduce(out, group=reduce_group)
        ctx.save_for_backward(ids, position_ids)
        ctx.backend, ctx.pos_encoding, ctx.scale, ctx.offset = backend, pos_encoding, scale, offset
        ctx.padding_idx, ctx.scale_grad_by_freq, ctx.sparse = padding_idx, scale_grad_by_freq, sparse
        ctx.weight_shape = weight.shape
        ctx.num_positions = pos_weight.shape[0] if pos_weight is not None else 0
        return out

    @staticmethod
    def backward(ctx, grad_out):
        ids, position_ids = ctx.saved_tensors
        need_weight_grad = ctx.needs_input_grad[1]
        need_pos_grad = ctx.needs_input_grad[2] and ctx.pos_encoding == "learned"
        backend = dispatch.get(ctx.backend)
        grad_out = grad_out.contiguous()
        dense_weight_grad = need_weight_grad and not ctx.sparse
        grad_weight = pos_grad = None
        if dense_weight_grad or need_pos_grad:
            grad_weight, pos_grad = backend.backward(
                grad_out, ids, position_ids, ctx.offset, ctx.weight_shape[0], ctx.num_positions, ctx.scale,
                ctx.padding_idx, ctx.scale_grad_by_freq, dense_weight_grad, need_pos_grad,
            )
        if need_weight_grad and ctx.sparse:
            rows, values = backend.sparse_backward(
                grad_out, ids, ctx.weight_shape[0], ctx.scale, ctx.padding_idx, ctx.scale_grad_by_freq)
            grad_weight = torch.sparse_coo_tensor(
                rows[None], values, tuple(ctx.weight_shape), is_coalesced=True, check_invariants=False)
        return (None, grad_weight if need_weight_grad else None, pos_grad if need_pos_grad else None) + (None,) * 10


def _check_integer_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _ID_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise TypeError(f"pyembed: {name} must be an int32 or int64 tensor, got {got}")


def _check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset) -> str:
    """Every metadata check of DESIGN §3; returns the normalised pos_encoding."""
    _check_integer_tensor("ids", ids)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _WEIGHT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise TypeError(f"pyembed: weight must be a float32/float16/bfloat16/float64 tensor, got {got}")
    if weight.dim() != 2:
        raise ValueError(f"pyembed: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")
    embed_dim = weight.shape[1]

    if pos_encoding is None or pos_encoding == "none":
        pos_encoding = "learned" if pos_weight is not None else "none"
    if pos_encoding not in ("none", "learned", "sinusoidal"):
        raise ValueError(f"pyembed: pos_encoding must be None, 'learned' or 'sinusoidal', got {pos_encoding!r}")
    if pos_encoding == "learned":
        if pos_weight is None:
            raise ValueError("pyembed: pos_encoding='learned' needs pos_weight (max_seq_len, d)")
        if pos_weight.dim() != 2 or pos_weight.shape[1] != embed_dim:
            raise ValueError(
                f"pyembed: embedding dimension mismatch: weight is {tuple(weight.shape)} "
                f"but pos_weight is {tuple(pos_weight.shape)}"
            )
        if pos_weight.dtype != weight.dtype:
            raise TypeError(f"pyembed: pos_weight dtype {pos_weight.dtype} != weight dtype {weight.dtype}")
    elif pos_weight is not None:
        raise ValueError(f"pyembed: pos_weight was given but pos_encoding={pos_encoding!r}")
    if pos_encoding == "sinusoidal" and embed_dim % 2:
        raise ValueError(f"pyembed: sinusoidal encoding requires an even embedding dim, got d={embed_dim}")
    if pos_encoding != "none" and ids.dim() not in (1, 2):
        raise ValueError(
            f"pyembed: with a positional encoding ids must be (B, T) or (T,), got shape {tuple(ids.shape)}"
        )

    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"pyembed: offset must be an int >= 0, got {offset!r}")
    if position_ids is not None:
        if pos_encoding == "none":
            raise ValueError("pyembed: position_ids given but there is no positional encoding")
        _check_integer_tensor("position_ids", position_ids)
        if position_ids.shape != ids.shape:
            raise ValueError(
                f"pyembed: position_ids shape {tuple(position_ids.shape)} != ids shape {tuple(ids.shape)}"
            )
        if offset != 0:
            raise ValueError("pyembed: pass position_ids or offset, not both")
    elif pos_encoding == "learned" and ids.numel() > 0:
        seq_len, max_seq_len = ids.shape[-1], pos_weight.shape[0]
        if offset + seq_len > max_seq_len:
            raise ValueError(
                f"pyembed: positions {offset}..{offset + seq_len - 1} (sequence length {seq_len}, "
                f"offset {offset}) exceed the learned table's max_seq_len={max_seq_len}"
            )

    for name, t in (("pos_weight", pos_weight), ("position_ids", position_ids), ("ids", ids)):
        if t is not None and t.device != weight.device:
            raise ValueError(f"pyembed: {name} is on {t.device} but weight is on {weight.device}")
    return pos_encoding


def embedding_renorm_(weight: torch.Tensor, ids: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """``nn.Embedding``'s ``max_norm``: rescale, in place and without grad, the looked-up
    rows whose ``norm_type``-norm exceeds ``max_norm`` (as ``torch.embedding_renorm_``).
    The ids are checked first, since the renorm itself would index with them."""
    _check_integer_tensor("ids", ids)
    checks.check_ids_in_range(ids, weight.shape[0])
    with torch.no_grad():
        torch.embedding_renorm_(weight, ids.contiguous(), max_norm, norm_type)
