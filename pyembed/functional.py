"""``fused_embedding``: argument checks (DESIGN §3), backend dispatch, autograd.

Checks here read only metadata (dtype, shape, device), so they cost nothing under
``torch.compile``; the data-dependent ones (id range, negative or too-large
position_ids) are one op shared by every backend (pyembed.checks), skipped with
``validate=False``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from . import checks, dispatch, reference

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
        weight: (V, d) float32/float16/bfloat16/float64 table. An integer table (no
            gradient) is looked up as ``nn.Embedding`` does, without positions or scale.
        pos_weight: (max_seq_len, d) learned positional table, same dtype as ``weight``.
        pos_encoding: None (inferred: "learned" if ``pos_weight`` is given, else none),
            "learned" or "sinusoidal" (computed on the fly, even d, any position).
        scale: multiplies the token rows (``math.sqrt(d)`` for scaled embeddings);
            applied in float32.
        position_ids: positions >= 0, shaped like ids, or (T,) / (1, T) for (B, T) ids
            (broadcast over the batch, as Hugging Face models pass them); default ``offset + t``.
        offset: first position when ``position_ids`` is None (incremental decoding).
        padding_idx: row that receives no gradient (negative counts from the end).
        scale_grad_by_freq: divide each gradient term by its id's count in the batch.
        sparse: the weight gradient is a coalesced ``torch.sparse_coo_tensor``. The
            learned positional gradient stays dense (nearly every position is touched).
        validate: check id / position ranges (a device sync on a GPU). With False, an
            out-of-range id yields a zero row, never an out-of-bounds access.
        backend: "auto", "reference", "cpu", "cuda" or "triton" (DESIGN §2).

    Returns:
        ``ids.shape + (d,)`` tensor of ``weight.dtype``. Differentiable to any order, in
        forward mode too, and under ``torch.func`` transforms (``vmap``, ``grad``).
    """
    if isinstance(weight, torch.Tensor) and not (weight.is_floating_point() or weight.is_complex()):
        return _integer_lookup(ids, weight, pos_weight, pos_encoding, scale, position_ids, padding_idx, validate)
    pos_encoding, position_ids = _check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset)
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
        raise checks.InputValueError(f"pyembed: padding_idx={padding_idx} is out of range for V={num_embeddings}")
    return padding_idx % num_embeddings


@dataclass(frozen=True)
class FusedConfig:
    """The static arguments of one call: everything but the tensors."""

    pos_encoding: str  # "none" | "learned" | "sinusoidal"
    scale: float
    offset: int
    padding_idx: Optional[int]  # in [0, V) or None
    scale_grad_by_freq: bool
    sparse: bool
    validate: bool
    backend: str
    # The vocab-parallel layer's group: each rank looks up the ids it holds (others give
    # zero rows) and the ranks' outputs are summed (all-reduce). The backward is
    # unchanged by that sum: every rank holds the whole output gradient.
    reduce_group: Any = field(default=None, compare=False)


def apply_fused(ids, weight, pos_weight, position_ids, pos_encoding: str, scale, offset, padding_idx,
                scale_grad_by_freq, sparse, validate, backend: dispatch.Backend, reduce_group=None) -> torch.Tensor:
    """FusedEmbeddingFunction on checked arguments (shared by fused_embedding and the
    vocab-parallel layer); the kernels index rows densely, so tensors are made contiguous."""
    config = FusedConfig(pos_encoding, float(scale), int(offset), padding_idx, bool(scale_grad_by_freq),
                         bool(sparse), bool(validate), backend.name, reduce_group)
    tensors = (ids.contiguous(), weight.contiguous(), None if pos_weight is None else pos_weight.contiguous(),
               None if position_ids is None else position_ids.contiguous())
    if not torch.compiler.is_compiling():
        function = FusedEmbeddingFunctorch if _functorch_active() else FusedEmbeddingFunctionWithJvp
        return function.apply(*tensors, config)
    if sparse and reduce_group is None:
        # Dynamo cannot hold the sparse gradient an autograd.Function's backward returns;
        # AOTAutograd can, for a custom op's registered backward (as for nn.Embedding's).
        ids, weight, pos_weight, position_ids = tensors
        if validate:
            ids = _checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)
        return torch.ops.pyembed.sparse_grad_embedding(ids, weight, pos_weight, position_ids, pos_encoding,
                                                        config.scale, config.offset, padding_idx,
                                                        config.scale_grad_by_freq, backend.name)
    return FusedEmbeddingFunction.apply(*tensors, config)


def _checked_ids(ids, weight, pos_weight, position_ids, pos_encoding: str) -> torch.Tensor:
    max_seq_len = pos_weight.shape[0] if pos_encoding == "learned" else None
    return checks.checked_ids(ids, weight.shape[0], position_ids, max_seq_len)


def _gradients(config: FusedConfig, grad_out, ids, position_ids, weight_shape, num_positions: int,
               need_weight_grad: bool, need_pos_grad: bool):
    """(weight gradient, positional gradient) from the backend's ops, None where not
    needed: dense through DenseGradFunction (differentiable again), sparse as a coalesced
    COO tensor built by the aten op behind torch.sparse_coo_tensor."""
    grad_out = grad_out.contiguous()
    dense_weight_grad = need_weight_grad and not config.sparse
    grad_weight = pos_grad = None
    if dense_weight_grad or need_pos_grad:
        grad_weight, pos_grad = (DenseGradFunctorch if _functorch_active() else DenseGradFunction).apply(
            grad_out, ids, position_ids, config, weight_shape[0], num_positions, dense_weight_grad, need_pos_grad)
    if need_weight_grad and config.sparse:
        rows, values = dispatch.get(config.backend).sparse_backward(
            grad_out, ids, weight_shape[0], config.scale, config.padding_idx, config.scale_grad_by_freq)
        grad_weight = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            1, 1, list(weight_shape), rows[None], values, dtype=values.dtype, layout=torch.sparse_coo,
            device=values.device, is_coalesced=True)
    return grad_weight if need_weight_grad else None, pos_grad if need_pos_grad else None


# --------------------------------------------------------------------------- autograd
# Each autograd.Function below comes in two forms with the same bodies: the classic one
# (forward(ctx, ...)), whose apply costs ~4 us, and one with setup_context and
# generate_vmap_rule, which torch.func transforms need but whose apply binds the
# signature with inspect on every call (~20 us, most of a one-token lookup). The second
# form is used only while a torch.func transform is active.
def _functorch_active() -> bool:
    return torch._C._are_functorch_transforms_active()


def _fused_forward(ids, weight, pos_weight, position_ids, config: FusedConfig):
    """One op of the chosen backend (after the range checks, when validate)."""
    if config.validate:
        ids = _checked_ids(ids, weight, pos_weight, position_ids, config.pos_encoding)
    out = dispatch.get(config.backend).forward(
        ids, weight, pos_weight, position_ids, config.pos_encoding, config.scale, config.offset)
    if config.reduce_group is not None:
        torch.distributed.all_reduce(out, group=config.reduce_group)
    return out


def _fused_save(ctx, ids, weight, pos_weight, position_ids, config: FusedConfig):
    """Only the ids and positions are saved: never the table or the output."""
    ctx.save_for_backward(ids, position_ids)
    ctx.save_for_forward(ids, position_ids)
    ctx.config = config
    ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
    ctx.num_positions = pos_weight.shape[0] if pos_weight is not None else 0


def _fused_backward(ctx, grad_out):
    ids, position_ids = ctx.saved_tensors
    grad_weight, pos_grad = _gradients(
        ctx.config, grad_out, ids, position_ids, ctx.weight_shape, ctx.num_positions, ctx.needs_input_grad[1],
        ctx.needs_input_grad[2] and ctx.config.pos_encoding == "learned")
    return None, grad_weight, pos_grad, None, None


def _fused_jvp(ctx, ids_t, weight_t, pos_weight_t, position_ids_t, config_t):
    """The tangent: the same lookup of the tangent tables (no positional term for a
    sinusoid, which has no parameters), zero rows for out-of-range ids."""
    ids, position_ids = ctx.saved_tensors
    learned_t = pos_weight_t if ctx.config.pos_encoding == "learned" else None
    if weight_t is None and learned_t is None:
        return torch.zeros(*ids.shape, ctx.weight_shape[1], dtype=ctx.weight_dtype, device=ids.device)
    return lookup(ids, position_ids, weight_t, learned_t, ctx.config, ctx.weight_shape, of="forward")


class FusedEmbeddingFunction(torch.autograd.Function):
    """Forward and backward are each one op of the chosen backend.

    Beyond first order, as ``nn.Embedding``: the weight gradient is linear in the output
    gradient, so its own derivative is a lookup (``DenseGradFunction``); the forward-mode
    derivative is the lookup of the tangent tables (``FusedEmbeddingFunctionWithJvp``);
    and under torch.func, ``FusedEmbeddingFunctorch`` runs the same bodies batched, the
    backends' ops having vmap rules (pyembed/_vmap.py): per-sample gradients are one
    backward call. This plain form is what torch.compile traces (Dynamo cannot trace an
    autograd.Function with a custom ``jvp``)."""

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, position_ids, config: FusedConfig):
        _fused_save(ctx, ids, weight, pos_weight, position_ids, config)
        return _fused_forward(ids, weight, pos_weight, position_ids, config)

    backward = staticmethod(_fused_backward)


class FusedEmbeddingFunctionWithJvp(FusedEmbeddingFunction):
    """Eager code: plus forward-mode AD (``jvp`` runs only under torch.autograd.forward_ad)."""

    jvp = staticmethod(_fused_jvp)


def _functorch_form(name: str, forward, save, backward, jvp=None):
    """The same bodies as the setup_context + generate_vmap_rule Function that torch.func
    transforms (vmap, grad, jvp) require."""
    def setup_context(ctx, inputs, output):
        save(ctx, *inputs)

    body = {"__doc__": f"{name}: the form torch.func transforms require.", "generate_vmap_rule": True,
            "forward": staticmethod(forward), "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward)}
    if jvp is not None:
        body["jvp"] = staticmethod(jvp)
    return type(name, (torch.autograd.Function,), body)


FusedEmbeddingFunctorch = _functorch_form("FusedEmbeddingFunctorch", _fused_forward, _fused_save, _fused_backward,
                                          _fused_jvp)


def _dense_grad_forward(grad_out, ids, position_ids, config: FusedConfig, num_embeddings: int, num_positions: int,
                        need_weight_grad: bool, need_pos_grad: bool):
    return dispatch.get(config.backend).backward(
        grad_out, ids, position_ids, config.offset, num_embeddings, num_positions, config.scale,
        config.padding_idx, config.scale_grad_by_freq, need_weight_grad, need_pos_grad)


def _dense_grad_save(ctx, grad_out, ids, position_ids, config: FusedConfig, num_embeddings: int, *_):
    ctx.save_for_backward(ids, position_ids)
    ctx.config, ctx.table_shape = config, (num_embeddings, grad_out.shape[-1])
    ctx.set_materialize_grads(False)


def _dense_grad_backward(ctx, grad_weight_grad, grad_pos_grad):
    ids, position_ids = ctx.saved_tensors
    if grad_weight_grad is not None and grad_weight_grad.numel() == 0:
        grad_weight_grad = None  # the weight gradient was not computed
    if grad_pos_grad is not None and grad_pos_grad.numel() == 0:
        grad_pos_grad = None
    if grad_weight_grad is None and grad_pos_grad is None:
        return (None,) * 8
    grad = lookup(ids, position_ids, grad_weight_grad, grad_pos_grad, ctx.config, ctx.table_shape, of="backward")
    return (grad,) + (None,) * 7


class DenseGradFunction(torch.autograd.Function):
    """The dense gradients (dW, dP) as a function of the output gradient, so that they can
    be differentiated again (``create_graph=True``): dW[v] = scale * sum of dout over the
    tokens of v is linear in dout, and its derivative is a lookup of the incoming
    gradient's rows (``lookup(..., of="backward")``)."""

    @staticmethod
    def forward(ctx, grad_out, ids, position_ids, config, num_embeddings, num_positions, need_weight_grad,
                need_pos_grad):
        _dense_grad_save(ctx, grad_out, ids, position_ids, config, num_embeddings)
        return _dense_grad_forward(grad_out, ids, position_ids, config, num_embeddings, num_positions,
                                   need_weight_grad, need_pos_grad)

    backward = staticmethod(_dense_grad_backward)


DenseGradFunctorch = _functorch_form("DenseGradFunctorch", _dense_grad_forward, _dense_grad_save,
                                     _dense_grad_backward)


@torch.library.custom_op("pyembed::sparse_grad_embedding", mutates_args=())
def sparse_grad_embedding(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
                          position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int,
                          padding_idx: Optional[int], scale_grad_by_freq: bool, backend: str) -> torch.Tensor:
    """The lookup with a sparse weight gradient, as one op torch.compile keeps whole: its
    backward (registered below) runs under AOTAutograd, which can build the sparse
    gradient where Dynamo cannot. Eager code uses FusedEmbeddingFunction."""
    return dispatch.get(backend).forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset)


@sparse_grad_embedding.register_fake
def _(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, backend):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _sparse_grad_setup(ctx, inputs, output):
    ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, by_freq, backend = inputs
    ctx.save_for_backward(ids, position_ids)
    ctx.config = FusedConfig(pos_encoding, scale, offset, padding_idx, by_freq, True, False, backend)
    ctx.weight_shape, ctx.num_positions = weight.shape, (pos_weight.shape[0] if pos_weight is not None else 0)


def _sparse_grad_backward(ctx, grad_out):
    ids, position_ids = ctx.saved_tensors
    grad_weight, pos_grad = _gradients(
        ctx.config, grad_out, ids, position_ids, ctx.weight_shape, ctx.num_positions, ctx.needs_input_grad[1],
        ctx.needs_input_grad[2] and ctx.config.pos_encoding == "learned")
    return (None, grad_weight, pos_grad) + (None,) * 7


sparse_grad_embedding.register_autograd(_sparse_grad_backward, setup_context=_sparse_grad_setup)


def lookup(ids, position_ids, table, pos_table, config: FusedConfig, table_shape, *, of: str) -> torch.Tensor:
    """Rows of ``table`` (times scale) plus rows of ``pos_table`` per token, in plain torch
    ops (any dtype, differentiable again, vmappable), shaped ``ids.shape + (d,)``; either
    table may be None. ``of`` says which derivative this is:
    - "forward": the derivative of the forward (its jvp): an out-of-range id gives a zero
      row, positional term included, as the forward does;
    - "backward": the derivative of the backward: the padding row, out-of-range ids and
      scale_grad_by_freq's 1/count apply to the token part as the backward applies them,
      and the positional part counts every token, as dP does."""
    num_embeddings, dim = table_shape
    some = table if table is not None else pos_table
    flat = ids.reshape(-1).long()
    id_ok = (flat >= 0) & (flat < num_embeddings)
    out = some.new_zeros(flat.shape[0], dim)
    if table is not None and num_embeddings > 0:
        keep = id_ok
        rows = table.index_select(0, flat.clamp(0, num_embeddings - 1)) * config.scale
        if of == "backward":
            if config.padding_idx is not None:
                keep = keep & (flat != config.padding_idx)
            if config.scale_grad_by_freq:
                counts = torch.zeros(num_embeddings, dtype=rows.dtype, device=rows.device).index_add_(
                    0, flat.clamp(0, num_embeddings - 1), id_ok.to(rows.dtype))
                rows = rows / counts.index_select(0, flat.clamp(0, num_embeddings - 1)).clamp(min=1)[:, None]
        out = out + torch.where(keep[:, None], rows, 0)
    if pos_table is not None and pos_table.shape[0] > 0:
        positions = reference.token_positions(ids, position_ids, config.offset)
        keep = (positions >= 0) & (positions < pos_table.shape[0])
        if of == "forward":
            keep = keep & id_ok
        rows = pos_table.index_select(0, positions.clamp(0, pos_table.shape[0] - 1))
        out = out + torch.where(keep[:, None], rows, 0)
    return out.reshape(*ids.shape, dim)


def _integer_lookup(ids, weight, pos_weight, pos_encoding, scale, position_ids, padding_idx, validate):
    """An integer table (``from_pretrained`` of ints) is looked up as ``nn.Embedding``
    does: no gradient, so nothing to fuse; positions and scaling need a float table."""
    if pos_weight is not None or pos_encoding not in (None, "none") or position_ids is not None or scale != 1.0:
        raise checks.InputTypeError(
            f"pyembed: an integer table ({weight.dtype}) takes no positional encoding or scale; "
            "only a plain lookup, as nn.Embedding")
    _check_integer_tensor("ids", ids)
    if weight.dim() != 2:
        raise checks.InputValueError(f"pyembed: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")
    if validate:
        checks.check_ids_in_range(ids, weight.shape[0])
    return torch.nn.functional.embedding(ids, weight, normalize_padding_idx(padding_idx, weight.shape[0]))


def _check_integer_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in _ID_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise checks.InputTypeError(f"pyembed: {name} must be an int32 or int64 tensor, got {got}")


def _check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset):
    """Every metadata check of DESIGN §3. Returns the normalised pos_encoding and
    position_ids shaped like ids ((T,) / (1, T) ones expanded over the batch)."""
    _check_integer_tensor("ids", ids)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in _WEIGHT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise checks.InputTypeError(f"pyembed: weight must be a float32/float16/bfloat16/float64 tensor, got {got}")
    if weight.dim() != 2:
        raise checks.InputValueError(f"pyembed: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")
    embed_dim = weight.shape[1]

    if pos_encoding is None or pos_encoding == "none":
        pos_encoding = "learned" if pos_weight is not None else "none"
    if pos_encoding not in ("none", "learned", "sinusoidal"):
        raise checks.InputValueError(f"pyembed: pos_encoding must be None, 'learned' or 'sinusoidal', got {pos_encoding!r}")
    if pos_encoding == "learned":
        if pos_weight is None:
            raise checks.InputValueError("pyembed: pos_encoding='learned' needs pos_weight (max_seq_len, d)")
        if pos_weight.dim() != 2 or pos_weight.shape[1] != embed_dim:
            raise checks.InputValueError(
                f"pyembed: embedding dimension mismatch: weight is {tuple(weight.shape)} "
                f"but pos_weight is {tuple(pos_weight.shape)}"
            )
        if pos_weight.dtype != weight.dtype:
            raise checks.InputTypeError(f"pyembed: pos_weight dtype {pos_weight.dtype} != weight dtype {weight.dtype}")
    elif pos_weight is not None:
        raise checks.InputValueError(f"pyembed: pos_weight was given but pos_encoding={pos_encoding!r}")
    if pos_encoding == "sinusoidal" and embed_dim % 2:
        raise checks.InputValueError(f"pyembed: sinusoidal encoding requires an even embedding dim, got d={embed_dim}")
    if pos_encoding != "none" and ids.dim() not in (1, 2):
        raise checks.InputValueError(
            f"pyembed: with a positional encoding ids must be (B, T) or (T,), got shape {tuple(ids.shape)}"
        )

    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise checks.InputValueError(f"pyembed: offset must be an int >= 0, got {offset!r}")
    if position_ids is not None:
        if pos_encoding == "none":
            raise checks.InputValueError("pyembed: position_ids given but there is no positional encoding")
        _check_integer_tensor("position_ids", position_ids)
        broadcasts = ids.dim() == 2 and position_ids.shape in ((ids.shape[1],), (1, ids.shape[1]))
        if position_ids.shape != ids.shape and not broadcasts:
            raise checks.InputValueError(
                f"pyembed: position_ids shape {tuple(position_ids.shape)} != ids shape {tuple(ids.shape)} "
                f"(nor (T,) / (1, T) for the batch)"
            )
        position_ids = position_ids.expand(ids.shape)
        if offset != 0:
            raise checks.InputValueError("pyembed: pass position_ids or offset, not both")
    elif pos_encoding == "learned" and ids.numel() > 0:
        seq_len, max_seq_len = ids.shape[-1], pos_weight.shape[0]
        if offset + seq_len > max_seq_len:
            raise checks.InputValueError(
                f"pyembed: positions {offset}..{offset + seq_len - 1} (sequence length {seq_len}, "
                f"offset {offset}) exceed the learned table's max_seq_len={max_seq_len}"
            )

    for name, t in (("pos_weight", pos_weight), ("position_ids", position_ids), ("ids", ids)):
        if t is not None and t.device != weight.device:
            raise checks.InputValueError(f"pyembed: {name} is on {t.device} but weight is on {weight.device}")
    return pos_encoding, position_ids


def embedding_renorm_(weight: torch.Tensor, ids: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """``nn.Embedding``'s ``max_norm``: rescale, in place and without grad, the looked-up
    rows whose ``norm_type``-norm exceeds ``max_norm`` (as ``torch.embedding_renorm_``).
    The ids are checked first, since the renorm itself would index with them."""
    _check_integer_tensor("ids", ids)
    checks.check_ids_in_range(ids, weight.shape[0])
    with torch.no_grad():  # on weight.detach(), as F.embedding: no autograd, no forward-AD tangent
        torch.embedding_renorm_(weight.detach(), ids.contiguous(), max_norm, norm_type)
