"""The autograd side of ``fused_embedding``: which route a checked call takes
(``apply_fused``), the ``torch.autograd.Function``s, and the gradient math they share.

Routes, each for a reason torch imposes:
- the C++ backends' ``pyembed::embedding`` op with its C++ autograd node: plain eager
  calls (the fewest host microseconds); on ``triton`` the same checks and node running its
  Python kernels (pyembed._triton._lookup_ops); on tables whose optimizer runs in the
  backward, the same node, whose backward calls ``fused_step`` (pyembed.optim) first;
- ``FusedEmbeddingFunctionWithJvp``: other eager calls (dropout, sparse, forward-mode AD);
- ``FusedEmbeddingFunctorch``: under torch.func transforms (setup_context + vmap rule);
- ``FusedEmbeddingFunction``: what torch.compile traces (Dynamo cannot trace a custom jvp);
- ``pyembed::sparse_grad_embedding``: a sparse gradient under torch.compile (AOTAutograd
  builds it from a custom op's registered backward; Dynamo cannot hold it).
Every Python backward goes through ``_gradients``, the one seam where a table's gradient
rows become a dense gradient, a sparse one, or (pyembed.optim) an optimizer update; the C++
node's makes the same choice (csrc/autograd.cpp), its update through ``fused_step``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch.autograd import forward_ad

from . import _coalesced, checks, dispatch, optim, reference


class FusedConfig(NamedTuple):
    """The static arguments of one call: everything but the tensors. A NamedTuple, not a
    frozen dataclass: built on every call, and a frozen dataclass's __init__ (one
    object.__setattr__ per field) cost ~2 us of a ~15 us one-token lookup."""

    pos_encoding: str  # "none" | "learned" | "sinusoidal"
    scale: float
    offset: int
    padding_idx: Optional[int]  # in [0, V) or None
    scale_grad_by_freq: bool
    sparse: bool
    validate: bool
    backend: str
    dropout_p: float = 0.0  # with a dropout key (an input tensor of the Function)
    # validate=True on a GPU: the forward kernel checks the ranges into this error record
    # (pyembed.checks); 0: no check in the kernel (validate says whether one runs before).
    error_record: int = 0
    # A column shard (DTensor Shard(1)): the sinusoid of column j is column
    # sinusoid_column_offset + j of a sinusoid_dim-wide encoding (0: the table's own d).
    sinusoid_column_offset: int = 0
    sinusoid_dim: int = 0


def apply_fused(ids, weight, pos_weight, position_ids, dropout_key, config: FusedConfig, *,
                cpp_autograd: bool = True) -> torch.Tensor:
    """The route of a checked call (shared by fused_embedding and the sharded tables' rules,
    pyembed._dtensor), named here once; the kernels index rows densely, so tensors are made
    contiguous. cpp_autograd=False: never the C++ autograd node (a table whose optimizer
    runs in the backward needs the Python one, pyembed.optim)."""
    tensors = (*_contiguous(ids, weight, pos_weight, position_ids), dropout_key)
    backend = dispatch.get(config.backend)
    no_transform = forward_ad._current_level < 0 and not functorch_active()  # nothing needs the Function's jvp/vmap
    # autograd_may_be_cpp(), its parts asked once; and no make_fx graph recording this call
    # or FakeTensorMode (checks.traced_or_fake: the C++ node would read values; its kernels miss a graph)
    plain_eager = no_transform and not torch.compiler.is_compiling() and not checks.traced_or_fake()
    if (no_transform or only_functionalize()) and not wants_gradient(weight, pos_weight):
        # Nothing will ask this call for a gradient (inference, torch.no_grad, frozen
        # tables): the forward op alone. An autograd.Function's apply and saved context
        # were half the host time of a one-token triton lookup (launch stubbed: 17.6 -> 9.6 us);
        # under torch.compile (grad mode and requires_grad are guarded) Dynamo then traces
        # no Function, and its guards on the Function's code go too.
        return _fused_forward(*tensors, config)
    if (cpp_autograd and backend.autograd_op is not None and dropout_key is None and not config.sparse
            and not config.sinusoid_dim and plain_eager):
        # The common eager call: the backend's lookup op (on a C++ backend its autograd node
        # is C++ too, csrc/autograd.cpp: a few us less than an autograd.Function -- most of a
        # one-token lookup; triton's is that node running its Python kernels). Everything
        # else (forward AD, torch.func, torch.compile, and the calls with dropout or a sparse
        # gradient that reach this general route: fused_embedding sent the plain ones to
        # that op) takes a Function below.
        ids, weight, pos_weight, position_ids, _ = tensors
        if config.validate:  # here, not in the op: the Python checks raise pyembed's exception types
            ids = checked_ids(ids, weight, pos_weight, position_ids, config.pos_encoding)
        return backend.autograd_op(ids, weight, pos_weight, position_ids, config.pos_encoding, config.scale,
                                   config.offset, config.padding_idx, config.scale_grad_by_freq, False,
                                   config.error_record)
    if not cpp_autograd or plain_eager:  # (not cpp_autograd: a fused optimizer's update runs in this backward)
        if no_transform:  # (what eager_apply needs; not cpp_autograd alone does not say so)
            return eager_apply(FusedEmbeddingFunctionWithJvp, *tensors, config)
        return FusedEmbeddingFunctionWithJvp.apply(*tensors, config)
    if not torch.compiler.is_compiling():  # eager with forward AD or torch.func (the setup_context form)
        function = FusedEmbeddingFunctorch if functorch_active() else FusedEmbeddingFunctionWithJvp
        return function.apply(*tensors, config)
    if config.sparse:
        # Dynamo cannot hold the sparse gradient an autograd.Function's backward returns;
        # AOTAutograd can, for a custom op's registered backward (as for nn.Embedding's).
        # The table as given (the op makes it contiguous): its hooks then go on the table
        # itself, not on a copy the graph makes (pyembed._coalesced).
        ids, _, pos_weight, position_ids, dropout_key = tensors
        if config.validate:
            ids = checked_ids(ids, weight, pos_weight, position_ids, config.pos_encoding)
        return torch.ops.pyembed.sparse_grad_embedding(
            ids, weight, pos_weight, position_ids, config.pos_encoding, config.scale, config.offset,
            config.padding_idx, config.scale_grad_by_freq, config.backend, dropout_key, config.dropout_p,
            config.sinusoid_column_offset, config.sinusoid_dim, config.error_record)
    return FusedEmbeddingFunction.apply(*tensors, config)  # what torch.compile traces (no custom jvp)


def _eager_apply():
    """``eager_apply(function, *args)``: ``function.apply(*args)`` where no torch.func
    transform and no forward-mode AD is active (the caller has checked), for a Function
    without setup_context. Before torch 2.14 Function.apply is Python that asks whether a
    transform is active, binds a setup_context's arguments, unwraps dead functorch wrappers
    and then calls the C apply beneath it: here that unwrap and the C apply alone (~2.2 of
    a 6.7 us apply of six arguments on the development VM, torch 2.13; a one-token
    `triton` lookup with a gradient, stand-in driver: 19.7 -> ~18 us, ``python -m
    bench.triton_host``). From 2.14 Function.apply is C, called as it is."""
    if not isinstance(torch.autograd.Function.__dict__.get("apply"), classmethod):
        return lambda function, *args: function.apply(*args)
    unwrap = torch._C._functorch.unwrap_if_dead
    c_apply = {}  # Function -> the C apply bound to it

    def eager_apply(function, *args):
        apply = c_apply.get(function)
        if apply is None:
            apply = c_apply[function] = super(torch.autograd.Function, function).apply
        return apply(*[unwrap(a) if isinstance(a, torch.Tensor) else a for a in args])
    return eager_apply


eager_apply = _eager_apply()


def _contiguous(ids, weight, pos_weight, position_ids) -> tuple:
    """The lookup's tensors as the kernels index them (dense rows); None stays None."""
    return (ids.contiguous(), weight.contiguous(), None if pos_weight is None else pos_weight.contiguous(),
            None if position_ids is None else position_ids.contiguous())


def wants_gradient(weight, pos_weight) -> bool:
    """Something will ask this call for a gradient (grad mode on and a table that needs one)."""
    return torch.is_grad_enabled() and (weight.requires_grad or (pos_weight is not None and pos_weight.requires_grad))


def checked_ids(ids, weight, pos_weight, position_ids, pos_encoding: str) -> torch.Tensor:
    max_seq_len = pos_weight.shape[0] if pos_encoding == "learned" else None
    return checks.checked_ids(ids, weight.shape[0], position_ids, max_seq_len)


def _gradients(ctx, grad_out):
    """(weight gradient, positional gradient) of the lookup whose ``ctx`` holds the saved
    (ids, position_ids, dropout_key), its config, table shapes and fused tables, from the
    backend's ops, None where not needed: updates of tables whose optimizer runs in the
    backward (pyembed.optim), dense through DenseGradFunction (differentiable again),
    sparse as a coalesced COO tensor built by the aten op behind torch.sparse_coo_tensor.
    With dropout, the output gradient goes through the forward's mask, regenerated from its
    key: inside the backend's ops, which apply it as they read the gradient (the key passed
    on), in a plain backward on cuda / triton; first, as an op of its own (differentiable
    again, vmappable), where the gradients are differentiated again (create_graph=True) or
    torch.func runs; first, by the forward's kernel, where two or more ops read it on a
    backend whose ops would each mask it by a pass of their own (cpu, reference)."""
    ids, position_ids, dropout_key = ctx.saved_tensors
    config, weight_shape = ctx.config, ctx.weight_shape
    backend = dispatch.get(config.backend)
    need_weight_grad = ctx.needs_input_grad[1]
    need_pos_grad = ctx.needs_input_grad[2] and config.pos_encoding == "learned"
    op_dropout_key = None  # the key the ops take
    if dropout_key is not None:
        if functorch_active() or torch.is_grad_enabled():
            grad_out = (DropoutMaskFunctorch if functorch_active() else DropoutMaskFunction).apply(
                grad_out, dropout_key, config)
        elif not backend.masks_as_it_reads and gradient_readers(
                ctx.fused_tables, need_weight_grad, need_pos_grad, config.sparse) > 1:
            grad_out = _dropout_mask_forward(grad_out, dropout_key, config)
        else:
            op_dropout_key = dropout_key
    grad_out = grad_out.contiguous()
    if ctx.fused_tables is not None:  # tables with an optimizer in the backward: updated here, no gradient
        need_weight_grad, need_pos_grad = optim.step_tables(
            backend, config, grad_out, ids, position_ids, ctx.fused_tables,
            (need_weight_grad, need_pos_grad), op_dropout_key)
    dense_weight_grad = need_weight_grad and not config.sparse
    grad_weight = pos_grad = None
    if dense_weight_grad or need_pos_grad:
        grad_weight, pos_grad = _gradient_op(
            _dense_grad_forward, DenseGradFunction, DenseGradFunctorch,
            grad_out, ids, position_ids, config, weight_shape[0], ctx.num_positions, dense_weight_grad, need_pos_grad,
            dropout_key=op_dropout_key)
    if need_weight_grad and config.sparse:
        rows, values = _gradient_op(_sparse_values_forward, SparseGradFunction, SparseGradFunctorch,
                                    grad_out, ids, config, weight_shape[0], dropout_key=op_dropout_key)
        grad_weight = torch.ops.aten._sparse_coo_tensor_with_dims_and_tensors(
            1, 1, list(weight_shape), rows[None], values, dtype=values.dtype, layout=torch.sparse_coo,
            device=values.device, is_coalesced=True)
    return grad_weight if need_weight_grad else None, pos_grad if need_pos_grad else None


def gradient_readers(fused_tables, need_weight_grad: bool, need_pos_grad: bool, sparse: bool) -> int:
    """How many of the backend's ops read the output gradient in a backward: one update per
    table whose optimizer runs in it (fused_tables: (weight, pos_weight), each None unless
    fused; or None), one dense op for the other dense gradients, one for a sparse table's.
    csrc/autograd.cpp's lookup_backward counts them alike."""
    fused_weight = fused_tables is not None and fused_tables[0] is not None and need_weight_grad
    fused_pos = fused_tables is not None and fused_tables[1] is not None and need_pos_grad
    weight_left, pos_left = need_weight_grad and not fused_weight, need_pos_grad and not fused_pos
    return fused_weight + fused_pos + ((weight_left and not sparse) or pos_left) + (weight_left and sparse)


def fused_step(python: bool, grad_out, ids, position_ids, dropout_key, weight, pos_weight, need_weight_grad: bool,
               need_pos_grad: bool, scale: float, offset: int, padding_idx: Optional[int], scale_grad_by_freq: bool,
               dropout_p: float, sparse: bool) -> tuple[bool, bool]:
    """What _gradients does for a Function's fused tables, for the C++ node of a lookup on
    them (the backends' fused_autograd_op; csrc/autograd.h's FusedStep calls this from the
    node's backward): optim.step_tables on the tables given (weight, pos_weight: each only
    if its optimizer runs in the backward), dropout_key the forward's when the ops apply
    the mask. python: the node's kernels are triton's, else the C++ ops of grad_out's
    device. Returns the gradients still needed."""
    backend = dispatch.get("triton" if python else grad_out.device.type)
    # The fields step_tables reads (the gradient's arguments); the positional table's kind
    # is the node's (need_pos_grad is False unless it is learned).
    config = FusedConfig("learned", scale, offset, padding_idx, scale_grad_by_freq, sparse, False, backend.name,
                         dropout_p)
    return optim.step_tables(backend, config, grad_out, ids, position_ids, (weight, pos_weight),
                             (need_weight_grad, need_pos_grad), dropout_key)


def _gradient_op(forward, function, functorch_form, *arguments, dropout_key=None):
    """``function.apply(*arguments)`` where its graph is used: under a torch.func transform
    (``functorch_form``) or with grad mode on (``create_graph=True``: the gradient is
    differentiated again). A plain backward runs with grad mode off and records nothing,
    so there the forward body runs alone (a Function's apply cost a one-token `triton`
    forward + backward ~4 us of host time), and only there with the forward's
    ``dropout_key`` (the op applies the mask; the Functions take masked gradients)."""
    if functorch_active():
        return functorch_form.apply(*arguments)
    if torch.is_grad_enabled():
        return function.apply(*arguments)
    return forward(*arguments, dropout_key)


# --------------------------------------------------------------------------- autograd
# Each autograd.Function below comes in two forms with the same bodies: the classic one
# (forward(ctx, ...)), whose apply costs ~4 us, and one with setup_context and
# generate_vmap_rule, which torch.func transforms need but whose apply binds the
# signature with inspect on every call (~20 us, most of a one-token lookup). The second
# form is used only while a torch.func transform is active. Plain eager calls on the C++
# backends take neither: their op, pyembed::embedding, has a C++ autograd node (apply_fused).
def functorch_active() -> bool:
    return torch._C._are_functorch_transforms_active()


def _fused_forward(ids, weight, pos_weight, position_ids, dropout_key, config: FusedConfig):
    """One op of the chosen backend (after the range checks, when validate)."""
    if config.validate:
        ids = checked_ids(ids, weight, pos_weight, position_ids, config.pos_encoding)
    return dispatch.get(config.backend).forward_op(weight)(
        ids, weight, pos_weight, position_ids, config.pos_encoding, config.scale, config.offset, dropout_key,
        config.dropout_p, config.sinusoid_column_offset, config.sinusoid_dim, config.error_record)


def fused_save(ctx, ids, weight, pos_weight, position_ids, dropout_key, config: FusedConfig):
    """Only the ids, positions and dropout key are saved: never the table, the output or a mask."""
    ctx.save_for_backward(ids, position_ids, dropout_key)
    if forward_ad._current_level >= 0 or functorch_active():  # only a jvp reads them (0.4 us a call)
        ctx.save_for_forward(ids, position_ids, dropout_key)
    ctx.config = config
    # Tables whose optimizer runs in the backward are held (not saved: the update changes them).
    ctx.fused_tables = optim.fused_tables(weight, pos_weight) if optim.tables_are_fused else None
    ctx.weight_shape, ctx.weight_dtype = weight.shape, weight.dtype
    ctx.num_positions = pos_weight.shape[0] if pos_weight is not None else 0


def fused_backward(ctx, grad_out):
    grad_weight, pos_grad = _gradients(ctx, grad_out)
    return None, grad_weight, pos_grad, None, None, None


def _fused_jvp(ctx, ids_t, weight_t, pos_weight_t, position_ids_t, dropout_key_t, config_t):
    """The tangent: the same lookup of the tangent tables (no positional term for a
    sinusoid, which has no parameters), zero rows for out-of-range ids, the same mask."""
    ids, position_ids, dropout_key = ctx.saved_tensors
    learned_t = pos_weight_t if ctx.config.pos_encoding == "learned" else None
    if weight_t is None and learned_t is None:
        return torch.zeros(*ids.shape, ctx.weight_shape[1], dtype=ctx.weight_dtype, device=ids.device)
    tangent = lookup(ids, position_ids, weight_t, learned_t, ctx.config, ctx.weight_shape, of="forward")
    return tangent if dropout_key is None else _dropout_mask_forward(tangent, dropout_key, ctx.config)


class FusedEmbeddingFunction(torch.autograd.Function):
    """Forward and backward are each one op of the chosen backend.

    Beyond first order, as ``nn.Embedding``: the weight gradient is linear in the output
    gradient, so its own derivative is a lookup (``DenseGradFunction``); the forward-mode
    derivative is the lookup of the tangent tables (``FusedEmbeddingFunctionWithJvp``);
    and under torch.func, ``FusedEmbeddingFunctorch`` runs the same bodies batched, the
    backends' ops having vmap rules (pyembed/_ops.py): per-sample gradients are one
    backward call. This plain form is what torch.compile traces (Dynamo cannot trace an
    autograd.Function with a custom ``jvp``)."""

    @staticmethod
    def forward(ctx, ids, weight, pos_weight, position_ids, dropout_key, config: FusedConfig):
        fused_save(ctx, ids, weight, pos_weight, position_ids, dropout_key, config)
        return _fused_forward(ids, weight, pos_weight, position_ids, dropout_key, config)

    backward = staticmethod(fused_backward)


class FusedEmbeddingFunctionWithJvp(FusedEmbeddingFunction):
    """Eager code: plus forward-mode AD (``jvp`` runs only under torch.autograd.forward_ad)."""

    jvp = staticmethod(_fused_jvp)


class _Leaf:
    """A FusedConfig as one leaf of torch.func's pytrees. The generated vmap rule of a jvp
    pairs the inputs' tangents, one an input, with the inputs' batch dims flattened as a
    pytree, where the NamedTuple is twelve leaves: jacfwd(jacrev(f)) -- torch.func.hessian --
    failed there ("leaves has length 8 but the spec refers to a pytree that holds 19 items")."""

    __slots__ = ("config",)

    def __init__(self, config):
        self.config = config


def _unwrapped(inputs) -> tuple:
    return tuple(x.config if type(x) is _Leaf else x for x in inputs)


def _functorch_form(name: str, forward, save, backward, jvp=None, save_takes_rows=False):
    """The same bodies as the setup_context + generate_vmap_rule Function that torch.func
    transforms (vmap, grad, jvp) require, the config given to apply passed as one leaf
    (_Leaf). save_takes_rows: ``save`` also gets the first output (the sparse gradient's rows)."""
    def setup_context(ctx, inputs, output):
        save(ctx, *_unwrapped(inputs), *((output[0],) if save_takes_rows else ()))

    def forward_of_given(*inputs):  # apply binds forward's signature: defaulted parameters would be inputs too
        return forward(*_unwrapped(inputs))

    def apply(cls, *inputs):
        return super(function, cls).apply(*(_Leaf(x) if isinstance(x, FusedConfig) else x for x in inputs))

    body = {"__doc__": f"{name}: the form torch.func transforms require.", "generate_vmap_rule": True,
            "forward": staticmethod(forward_of_given), "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward), "apply": classmethod(apply)}
    if jvp is not None:
        body["jvp"] = staticmethod(jvp)
    function = type(name, (torch.autograd.Function,), body)  # apply's super() names it
    return function


FusedEmbeddingFunctorch = _functorch_form("FusedEmbeddingFunctorch", _fused_forward, fused_save, fused_backward,
                                          _fused_jvp)


def _dense_grad_forward(grad_out, ids, position_ids, config: FusedConfig, num_embeddings: int, num_positions: int,
                        need_weight_grad: bool, need_pos_grad: bool, dropout_key=None):
    """The dense backward op; dropout_key: of grad_out through the forward's mask (a plain
    backward only: DenseGradFunction's double backward and the vmap rule take none)."""
    return dispatch.get(config.backend).backward_op(grad_out)(
        grad_out, ids, position_ids, config.offset, num_embeddings, num_positions, config.scale,
        config.padding_idx, config.scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key,
        config.dropout_p)


def _dense_grad_save(ctx, grad_out, ids, position_ids, config: FusedConfig, num_embeddings: int,
                     num_positions: int, need_weight_grad: bool, need_pos_grad: bool):
    ctx.save_for_backward(ids, position_ids)
    if not no_transform():  # only a jvp reads them
        ctx.save_for_forward(ids, position_ids)
    ctx.config, ctx.table_shape = config, (num_embeddings, grad_out.shape[-1])
    ctx.jvp_arguments = (num_positions, need_weight_grad, need_pos_grad)  # the same gradients, of the tangent
    ctx.set_materialize_grads(False)


def _dense_grad_jvp(ctx, grad_out_t, *_):
    """(dW, dP) are linear in dout: their tangents are the same sums of dout's tangent
    (forward-over-reverse: torch.func.hessian, jvp of a gradient)."""
    ids, position_ids = ctx.saved_tensors
    return _dense_grad_forward(grad_out_t.contiguous(), ids, position_ids, ctx.config, ctx.table_shape[0],
                               *ctx.jvp_arguments)


def _dense_grad_backward(ctx, grad_weight_grad, grad_pos_grad):
    ids, position_ids = ctx.saved_tensors
    _, need_weight_grad, need_pos_grad = ctx.jvp_arguments
    if not need_weight_grad:
        grad_weight_grad = None  # the weight gradient was not computed (an empty placeholder)
    if not need_pos_grad:
        grad_pos_grad = None
    if grad_weight_grad is None and grad_pos_grad is None:
        return (None,) * 8
    grad = lookup(ids, position_ids, grad_weight_grad, grad_pos_grad, ctx.config, ctx.table_shape, of="backward")
    return (grad,) + (None,) * 7


class DenseGradFunction(torch.autograd.Function):
    """The dense gradients (dW, dP) as a function of the output gradient, so that they can
    be differentiated again (``create_graph=True``): dW[v] = scale * sum of dout over the
    tokens of v is linear in dout, and its derivative is a lookup of the incoming
    gradient's rows (``lookup(..., of="backward")``); in forward mode, the same sums of
    dout's tangent."""

    @staticmethod
    def forward(ctx, grad_out, ids, position_ids, config, num_embeddings, num_positions, need_weight_grad,
                need_pos_grad):
        _dense_grad_save(ctx, grad_out, ids, position_ids, config, num_embeddings, num_positions, need_weight_grad,
                         need_pos_grad)
        return _dense_grad_forward(grad_out, ids, position_ids, config, num_embeddings, num_positions,
                                   need_weight_grad, need_pos_grad)

    backward = staticmethod(_dense_grad_backward)
    jvp = staticmethod(_dense_grad_jvp)


DenseGradFunctorch = _functorch_form("DenseGradFunctorch", _dense_grad_forward, _dense_grad_save,
                                     _dense_grad_backward, _dense_grad_jvp)


def _sparse_values_forward(grad_out, ids, config: FusedConfig, num_embeddings: int, dropout_key=None):
    """The sparse backward op; dropout_key as _dense_grad_forward's."""
    return dispatch.get(config.backend).sparse_backward(grad_out, ids, num_embeddings, config.scale,
                                                        config.padding_idx, config.scale_grad_by_freq, dropout_key,
                                                        config.dropout_p)


def _sparse_values_save(ctx, grad_out, ids, config: FusedConfig, num_embeddings: int, rows):
    ctx.mark_non_differentiable(rows)
    ctx.save_for_backward(ids, rows)
    ctx.config, ctx.table_shape = config, (num_embeddings, grad_out.shape[-1])


def _sparse_values_backward(ctx, grad_rows, grad_values):
    """The values' derivative, as the dense gradient's: the incoming gradient's rows,
    placed at their table rows, looked up per token (padding, out-of-range ids and
    scale_grad_by_freq applied as the backward applies them). The (V, d) table it places
    them in exists only here, for gradients of gradients."""
    ids, rows = ctx.saved_tensors  # grad_values is never None: this Function materialises zeros
    table = grad_values.new_zeros(ctx.table_shape).index_copy(0, rows, grad_values)
    return lookup(ids, None, table, None, ctx.config, ctx.table_shape, of="backward"), None, None, None


class SparseGradFunction(torch.autograd.Function):
    """The sparse gradient's (rows, values) as a function of the output gradient, for the
    same reason as DenseGradFunction: values are linear in dout (differentiable again), and
    torch.func.grad, which tracks dout whenever the loss is not linear in the output,
    needs an autograd rule for every op it meets."""

    @staticmethod
    def forward(ctx, grad_out, ids, config, num_embeddings):
        rows, values = _sparse_values_forward(grad_out, ids, config, num_embeddings)
        _sparse_values_save(ctx, grad_out, ids, config, num_embeddings, rows)
        return rows, values

    backward = staticmethod(_sparse_values_backward)


SparseGradFunctorch = _functorch_form("SparseGradFunctorch", _sparse_values_forward, _sparse_values_save,
                                      _sparse_values_backward, save_takes_rows=True)


def _dropout_mask_forward(grad, dropout_key, config: FusedConfig):
    """grad * keep / (1 - p) with the forward's mask, by the forward's own kernel: grad is
    looked up as a table whose row n is flat token n (ids = 0..N-1), so element (n, j)
    meets the keep bit it met in the forward. Rounded once to grad's dtype, as
    nn.Dropout's backward rounds its product."""
    dim = grad.shape[-1]
    rows = grad.reshape(-1, dim) if dim else grad.new_empty(grad.numel(), 0)
    tokens = torch.arange(rows.shape[0], device=grad.device)
    return dispatch.get(config.backend).forward(
        tokens, rows.contiguous(), None, None, "none", 1.0, 0, dropout_key, config.dropout_p).reshape(grad.shape)


def _dropout_mask_save(ctx, grad, dropout_key, config: FusedConfig):
    ctx.save_for_backward(dropout_key)
    if not no_transform():  # only a jvp reads it
        ctx.save_for_forward(dropout_key)
    ctx.config = config


def _dropout_mask_jvp(ctx, grad_t, *_):
    """The mask is linear: the tangent is the tangent masked."""
    (dropout_key,) = ctx.saved_tensors
    return _dropout_mask_forward(grad_t, dropout_key, ctx.config)


def _dropout_mask_backward(ctx, grad):
    (dropout_key,) = ctx.saved_tensors
    function = DropoutMaskFunctorch if functorch_active() else DropoutMaskFunction
    return function.apply(grad, dropout_key, ctx.config), None, None  # the mask is diagonal: its own transpose


class DropoutMaskFunction(torch.autograd.Function):
    """The dropout mask applied to an output gradient, differentiable again (for double
    backward): multiplying by the mask is linear and diagonal, so its backward is itself."""

    @staticmethod
    def forward(ctx, grad, dropout_key, config: FusedConfig):
        _dropout_mask_save(ctx, grad, dropout_key, config)
        return _dropout_mask_forward(grad, dropout_key, config)

    backward = staticmethod(_dropout_mask_backward)
    jvp = staticmethod(_dropout_mask_jvp)


DropoutMaskFunctorch = _functorch_form("DropoutMaskFunctorch", _dropout_mask_forward, _dropout_mask_save,
                                       _dropout_mask_backward, _dropout_mask_jvp)


def register_lookup_autograd(op, backend: str) -> None:
    """The autograd of a Python lookup op of ``backend`` (pyembed::embedding's schema:
    triton's triton_lookup, the reference's reference_lookup): the general route's save and
    dense backward."""
    def save(ctx, inputs, output):
        ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, by_freq, _, record = inputs
        config = FusedConfig(pos_encoding, scale, offset, padding_idx, by_freq, False, False, backend, 0.0, record)
        fused_save(ctx, ids, weight, pos_weight, position_ids, None, config)

    def backward(ctx, grad_out):
        _, grad_weight, pos_grad, *_ = fused_backward(ctx, grad_out)
        return None, grad_weight, pos_grad, *(None,) * 8

    op.register_autograd(backward, setup_context=save)


register_lookup_autograd(dispatch.reference_lookup, "reference")


@torch.library.custom_op("pyembed::sparse_grad_embedding", mutates_args=())
def sparse_grad_embedding(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
                          position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int,
                          padding_idx: Optional[int], scale_grad_by_freq: bool, backend: str,
                          dropout_key: Optional[torch.Tensor], dropout_p: float, sinusoid_column_offset: int = 0,
                          sinusoid_dim: int = 0, error_record: int = 0) -> torch.Tensor:
    """The lookup with a sparse weight gradient, as one op torch.compile keeps whole: its
    backward (registered below) runs under AOTAutograd, which can build the sparse
    gradient where Dynamo cannot. Eager code uses FusedEmbeddingFunction.

    A compiled call runs this body with the real table (the only Python of pyembed's it
    runs): here the table gets the hooks that keep the flag of the coalesced gradient its
    backward builds (pyembed._coalesced), which the eager routes register in the call."""
    _coalesced.keep_flag(weight)
    return dispatch.get(backend).forward(ids, weight.contiguous(), pos_weight, position_ids, pos_encoding, scale,
                                         offset, dropout_key, dropout_p, sinusoid_column_offset, sinusoid_dim,
                                         error_record)


@sparse_grad_embedding.register_fake
def _(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, backend,
      dropout_key, dropout_p, sinusoid_column_offset=0, sinusoid_dim=0, error_record=0):
    return weight.new_empty(*ids.shape, weight.shape[1])


def _sparse_grad_setup(ctx, inputs, output):
    (ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, by_freq, backend, dropout_key,
     dropout_p, sinusoid_column_offset, sinusoid_dim, error_record) = inputs
    ctx.save_for_backward(ids, position_ids, dropout_key)
    ctx.config = FusedConfig(pos_encoding, scale, offset, padding_idx, by_freq, True, False, backend, dropout_p,
                             error_record, sinusoid_column_offset, sinusoid_dim)
    ctx.weight_shape, ctx.num_positions = weight.shape, (pos_weight.shape[0] if pos_weight is not None else 0)
    ctx.fused_tables = None  # a fused optimizer's table runs outside compiled graphs (pyembed.optim)


def _sparse_grad_backward(ctx, grad_out):
    grad_weight, pos_grad = _gradients(ctx, grad_out)
    return (None, grad_weight, pos_grad) + (None,) * 12


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


def no_transform() -> bool:
    """No forward-mode AD and no torch.func transform: nothing needs a Function's jvp or vmap."""
    return forward_ad._current_level < 0 and not functorch_active()


def only_functionalize() -> bool:
    """torch.func.functionalize is the only torch.func transform active (and no forward-mode
    AD): it has no rule for an autograd.Function ("NYI: Functionalize rule for
    custom_function_call"), so a call takes the dispatcher's ops there, as under torch.compile.
    Whether any transform is active is asked first: Dynamo cannot trace the stack's read (a
    graph break and a warning naming it, seen when a compiled call raised one of pyembed's
    errors and Dynamo ran its frame again eagerly, compiling these helpers one by one)."""
    if not functorch_active():
        return False
    stack = torch._C._functorch.get_interpreter_stack()
    return (bool(stack) and forward_ad._current_level < 0
            and all(layer.key() == torch._C._functorch.TransformType.Functionalize for layer in stack))


def autograd_may_be_cpp() -> bool:
    """Nothing needs the Python autograd.Function: not compiling (Dynamo traces the
    Function), no forward-mode AD and no torch.func transform (the C++ node has neither)."""
    return not torch.compiler.is_compiling() and forward_ad._current_level < 0 and not functorch_active()
