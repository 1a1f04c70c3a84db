"""The op contract every backend meets, in one file (the C++ ops' schemas are declared in
csrc/pyembed.cpp; the Python ones take the signatures of reference.embedding_forward,
reference.embedding_backward and reference.embedding_sparse_backward):

- ``Backend``: the record naming one backend's ops (registered in pyembed/dispatch.py);
- the fake (meta) implementation each op schema shares, for torch.compile and tracing;
- the vmap rules of the forward and dense backward ops (``torch.func.vmap``).

``FusedEmbeddingFunction`` runs its bodies batched (``generate_vmap_rule``); its ops are
custom ops, which vmap needs a rule for. Both rules fold the vmapped dimension into the
op's own batch, so a batch of N samples is still one kernel launch:
- forward, tables not batched (per-sample inputs over one model): N samples of (T,) or
  (B, T) ids are one (N*B, T) lookup; batched tables (ensembles) run one call per sample,
  as does dropout (its mask follows the token index within a sample: randomness="same"
  gives every sample one key, "different" each sample its own);
- dense backward (per-sample gradients, as DP training with Opacus needs): sample i's
  ids address rows [i*V, (i+1)*V) of an N-times-taller table, so one backward call gives
  every sample's (V, d) gradient, ``scale_grad_by_freq`` counting within each sample.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

import torch
from torch._subclasses.functional_tensor import FunctionalTensorMode  # imported by torch itself

from . import reference


@dataclass(frozen=True)
class Backend:
    name: str
    forward: Callable  # op with the schema of reference.embedding_forward
    backward: Callable  # op with the schema of reference.embedding_backward (dense, no host sync)
    sparse_backward: Callable  # op with the schema of reference.embedding_sparse_backward
    why_unavailable: Callable[[torch.device], Optional[str]]  # None when it can run there
    # The lookup that checks its arguments and holds its own autograd, for plain eager calls
    # (the C++ backends' pyembed::embedding, with a C++ node; triton's call of that op's
    # checks and node with its Python kernels, pyembed._triton._lookup_ops); None: the general route.
    autograd_op: Optional[Callable] = None
    # The same lookup on tables of which some have their optimizer in the backward
    # (pyembed.optim), called (fused_weight, fused_pos, *autograd_op's arguments): the same
    # checks and C++ node, whose backward updates those tables (csrc/autograd.h,
    # embedding_fused); None: the general route's Python Function.
    fused_autograd_op: Optional[Callable] = None
    # The same lookup as an op for torch.compile to trace, with the schema of
    # torch.ops.pyembed.embedding (the C++ backends' own; triton's pyembed::triton_lookup),
    # whose autograd AOTAutograd splits into the forward and backward ops; None: the general
    # route (pyembed.functional._compiled_lookup says why it matters).
    compiled_op: Optional[Callable] = None
    # compiled_op takes dropout_p too (drawing the key itself, as pyembed::embedding does)
    compiled_dropout: bool = False
    # Its forward kernel checks id / position ranges itself into an error record (the
    # ``error_record`` argument; pyembed.checks): validate=True on a GPU then never syncs.
    checks_in_kernel: bool = False
    # The forward / dense backward for eager calls on plain tensors (not torch.compile,
    # torch.func or any tracer with fake tensors: those need the ops' fakes and vmap rules):
    # a Python backend's op bodies, without the dispatcher (a Python custom op's dispatch
    # costs ~20 us per call, more than a kernel launch); the C++ backends' typed dispatcher
    # calls (pyembed._C), without the boxed call's argument parsing (~2.7 us a call).
    eager_forward: Optional[Callable] = None
    eager_backward: Optional[Callable] = None
    # The optimizer inside the backward (pyembed.optim): ops with the schemas of
    # torch.ops.pyembed.embedding_touched_rows (None: sparse_backward, which may sync) and
    # optimizer_update (None: the reference, torch's functional optimizers).
    touched_rows: Optional[Callable] = None
    optimizer_update: Optional[Callable] = None
    # torch.ops.pyembed.optimizer_backward's schema: a dense table's whole update from dout
    # and ids, its gradient rows never in memory (None: touched_rows, then optimizer_update).
    optimizer_backward: Optional[Callable] = None
    # torch.ops.pyembed.position_update's schema: the learned positions' update (p = offset
    # + t) from dout, their gradient never in memory (None: the positions' backward op,
    # then optimizer_update).
    position_update: Optional[Callable] = None
    # Its backward ops apply the dropout mask as they read the output gradient (cuda, triton).
    # False: each op would mask it by a pass of its own (cpu, reference), so a backward whose
    # gradient two or more ops read masks it once, first (pyembed._autograd._gradients).
    masks_as_it_reads: bool = False
    # "auto"'s preference per device type, lower first ("*": any device type); a device type
    # not listed: auto never picks it there (it can still be asked for by name).
    auto_rank: Mapping[str, int] = field(default_factory=dict)

    def forward_op(self, tensor: torch.Tensor) -> Callable:
        """The forward to call on ``tensor`` (an input): the eager body when it is a plain
        tensor and nothing traces or transforms, else the op."""
        if self.eager_forward is not None and _eager(tensor):
            return self.eager_forward
        return self.forward

    def backward_op(self, tensor: torch.Tensor) -> Callable:
        if self.eager_backward is not None and _eager(tensor):
            return self.eager_backward
        return self.backward


def _eager(tensor: torch.Tensor) -> bool:
    """A real tensor (not fake, functional or wrapped; with storage: the batched tensors of
    torch.autograd.functional's vectorized jacobians have none) and neither torch.compile,
    a torch.func transform nor a dispatch mode active (make_fx's proxy tensors record the
    dispatcher's ops, and a kernel launched around it would be missing from their graph):
    an op's body may run on it directly."""
    return (type(tensor) in (torch.Tensor, torch.nn.Parameter) and not torch.compiler.is_compiling()
            and not torch._C._are_functorch_transforms_active() and torch._C._has_storage(tensor)
            and not torch._C._len_torch_dispatch_stack())


# --------------------------------------------------------------------------- fakes
# Every backend's ops have the schemas of the three functions above, so one fake
# implementation each serves them all (registered by each backend).
def forward_fake(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p,
                 sinusoid_column_offset=0, sinusoid_dim=0, error_record=0):
    return weight.new_empty(*ids.shape, weight.shape[1])


def backward_fake(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                  scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key=None, dropout_p=0.0):
    embed_dim = grad_out.shape[-1]
    return (grad_out.new_empty(num_embeddings if need_weight_grad else 0, embed_dim),
            grad_out.new_empty(num_positions if need_pos_grad else 0, embed_dim))


def sparse_backward_fake(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq, dropout_key=None,
                         dropout_p=0.0):
    touched = torch.library.get_ctx().new_dynamic_size()
    return grad_out.new_empty(touched, dtype=torch.long), grad_out.new_empty(touched, grad_out.shape[-1])


def lookup_fake(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, scale_grad_by_freq,
                validate=True, error_record=0, dropout_p=0.0, generator=None, sparse=False):
    """pyembed::embedding (the C++ backends' lookup with its C++ autograd node)."""
    return weight.new_empty(*ids.shape, weight.shape[1])


def register_lookup_forms(lookup_op, forward_op) -> None:
    """A Python backend's lookup op (pyembed::embedding's schema: triton_lookup,
    reference_lookup): its fake, and its functionalised form (torch.compile's graphs), the
    backend's forward op. Its autograd: pyembed._autograd.register_lookup_autograd."""
    lookup_op.register_fake(lookup_fake)

    @lookup_op.register_torch_dispatch(FunctionalTensorMode)
    def _(mode, func, types, args, kwargs):
        # Every argument arrives positionally: the schema has no defaults or keyword-only ones.
        ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, _, _, _, error_record = args
        with mode:
            return forward_op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, None, 0.0, 0, 0,
                              error_record)


def register_fakes(forward_op: str, backward_op: str, sparse_backward_op: str) -> None:
    """One backend's three ops share these fakes (same schemas as the functions above)."""
    torch.library.register_fake(forward_op)(forward_fake)
    torch.library.register_fake(backward_op)(backward_fake)
    torch.library.register_fake(sparse_backward_op)(sparse_backward_fake)


# --------------------------------------------------------------------------- vmap rules
_registered: set[str] = set()
_FORWARD_INPUTS = tuple(inspect.signature(reference.embedding_forward).parameters)  # the forward ops' schema


def _batch_first(t, bdim, n):
    if t is None:
        return None
    return t.expand(n, *t.shape) if bdim is None else t.movedim(bdim, 0)


def _select(t, bdim, i):
    return t if t is None or bdim is None else t.select(bdim, i)


def _forward_rule(op):
    def rule(info, in_dims, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key,
             dropout_p, sinusoid_column_offset=0, sinusoid_dim=0, error_record=0):
        columns = (sinusoid_column_offset, sinusoid_dim, error_record)
        dims = dict(zip(_FORWARD_INPUTS, in_dims))  # by name: a new argument shifts nothing here
        ids_dim, weight_dim, pos_weight_dim = dims["ids"], dims["weight"], dims["pos_weight"]
        position_ids_dim, key_dim = dims["position_ids"], dims["dropout_key"]
        n = info.batch_size
        if weight_dim is None and pos_weight_dim is None and dropout_key is None:
            ids = _batch_first(ids, ids_dim, n)
            position_ids = _batch_first(position_ids, position_ids_dim, n)
            sample_shape = ids.shape[1:]
            if pos_encoding != "none":  # (N, T) or (N, B, T) -> (N * B, T): positions follow t
                ids = ids.flatten(0, -2)  # not reshape(-1, T): ambiguous for zero tokens
                position_ids = None if position_ids is None else position_ids.reshape(ids.shape)
            out = op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, None, dropout_p, *columns)
            return out.reshape(n, *sample_shape, out.shape[-1]), 0
        outs = [op(_select(ids, ids_dim, i), _select(weight, weight_dim, i), _select(pos_weight, pos_weight_dim, i),
                   _select(position_ids, position_ids_dim, i), pos_encoding, scale, offset,
                   _select(dropout_key, key_dim, i), dropout_p, *columns) for i in range(n)]
        return torch.stack(outs), 0
    return rule


def _backward_rule(op):
    def rule(info, in_dims, grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
             scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key=None, dropout_p=0.0):
        if dropout_key is not None:  # the autograd routes mask the gradient first under torch.func
            raise NotImplementedError("pyembed: the dense backward op's dropout has no vmap rule")
        n = info.batch_size
        grad_out = _batch_first(grad_out, in_dims[0], n)
        ids = _batch_first(ids, in_dims[1], n).long()
        sample = torch.arange(n, device=ids.device).view(n, *[1] * (ids.dim() - 1))
        # Sample i's keys are shifted into its own block of rows; keys the backward skips
        # (out of range, padding) stay out of every block.
        skip = (ids < 0) | (ids >= num_embeddings)
        if padding_idx is not None:
            skip |= ids == padding_idx
        keys = torch.where(skip, -1, ids + sample * num_embeddings)
        pos_keys = None
        if need_pos_grad:
            if position_ids is None:
                positions = offset + torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
            else:
                positions = _batch_first(position_ids, in_dims[2], n).long()
            out_of_range = (positions < 0) | (positions >= num_positions)
            pos_keys = torch.where(out_of_range, -1, positions + sample * num_positions)
        weight_grad, pos_grad = op(grad_out, keys, pos_keys, 0, n * num_embeddings, n * num_positions, scale, None,
                                   scale_grad_by_freq, need_weight_grad, need_pos_grad)
        dim = grad_out.shape[-1]
        return ((weight_grad.view(n, num_embeddings, dim) if need_weight_grad else weight_grad,
                 pos_grad.view(n, num_positions, dim) if need_pos_grad else pos_grad),
                (0 if need_weight_grad else None, 0 if need_pos_grad else None))
    return rule


def _qualname(op) -> str:
    # torch.ops.pyembed.x (an OpOverloadPacket) or a torch.library.custom_op (CustomOpDef)
    return getattr(op, "_qualified_op_name", None) or op._qualname


def register_vmap_rules(forward_op, backward_op) -> None:
    """Give a backend's forward and dense backward ops their vmap rules (once per op:
    the cpu and cuda backends share theirs)."""
    for op, make in ((forward_op, _forward_rule), (backward_op, _backward_rule)):
        name = _qualname(op)
        if name not in _registered:
            torch.library.register_vmap(name, make(op))
            _registered.add(name)
