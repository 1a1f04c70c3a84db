"""The optimizer inside the backward: ``apply_optimizer_in_backward``.

A table registered here is updated by pyembed's backward itself, from the summed
gradient rows the backward computes anyway: the (V, d) gradient is never allocated, the
parameter's ``.grad`` stays None, and a dense optimizer makes one pass over the table
(each of p, m, v read and written once). The optimizer object is a real instance of the
torch class: its ``param_groups`` are read at every backward (LR schedulers work), its
``state`` is exactly what the torch optimizer would hold (a checkpoint moves between fused
and unfused training), its ``step()`` does nothing and ``zero_grad()`` finds no gradient.

The spec is :func:`reference_update`: torch's own functional optimizer applied to the
gradient that the plain path would have produced. The cpu backend runs a C++ kernel
(csrc/cpu/kernels.h, ``optimizer_update``), CUDA tensors a Triton kernel
(kernels/embedding.py, ``_optimizer_update_kernel``); both follow the same math in float32
(float64 for float64 tables), rounding each of p and the state once.
"""

from __future__ import annotations

import functools
import math
import types
import warnings
import weakref
from typing import Iterable, NamedTuple, Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.optim import _functional as _sparse_functional, adagrad as _adagrad, adam as _adam, sgd as _sgd
from torch.optim.optimizer import register_optimizer_step_pre_hook

from . import checks

# The update rules, shared with csrc/optim.h (Rule) and kernels/embedding.py (RULE).
SGD, ADAM, ADAGRAD, SPARSE_ADAM = 0, 1, 2, 3
_FUSED = {torch.optim.SGD: SGD, torch.optim.Adam: ADAM, torch.optim.AdamW: ADAM, torch.optim.Adagrad: ADAGRAD,
          torch.optim.SparseAdam: SPARSE_ADAM}
_FUSED_NAMES = "SGD, Adam, AdamW, Adagrad, SparseAdam"
ATTR = "_pyembed_optimizer"  # the Parameter's fused optimizer (the instance apply_optimizer_in_backward made)


def apply_optimizer_in_backward(optimizer_class, params: Iterable[torch.nn.Parameter],
                                optimizer_kwargs: Optional[dict] = None) -> list[torch.optim.Optimizer]:
    """Update ``params`` (tables of pyembed modules: ``FusedEmbedding.weight``,
    ``EmbeddingLayer.token_embedding.weight``, ``EmbeddingLayer.pos_embedding``) inside
    pyembed's backward with ``optimizer_class(params, **optimizer_kwargs)``'s math, never
    materialising their gradient. Same shape as torch's
    ``torch.distributed.optim._apply_optimizer_in_backward``.

    Returns ``[optimizer]``: one instance of ``optimizer_class`` over ``params`` whose
    ``param_groups``, ``state`` and ``state_dict()`` are what the torch optimizer holds
    (schedulers and checkpoints work on it); its ``step()`` does nothing, the update
    having happened in the backward. Fused: SGD, Adam, AdamW (not amsgrad), Adagrad,
    SparseAdam.

    Limits (they raise where a user would otherwise get something else silently):
    every backward that reaches a table updates it, so gradient accumulation over several
    backwards and gradient-norm clipping cannot include these tables; a table used twice
    in one backward, a gradient from outside pyembed (a tied output layer), a torch
    optimizer stepping the same parameter, add_param_group on the returned optimizer, a
    GradScaler's step of it (the update used the scaled gradient: fp16 loss scaling does not
    mix with in-backward updates), an update in a CUDA graph capture (its host scalars would
    be replayed), torch.compile(fullgraph=True) (the call runs outside the graph), torch.func
    transforms and create_graph=True raise.
    """
    if optimizer_class not in _FUSED:
        name = getattr(optimizer_class, "__name__", optimizer_class)
        raise checks.InputTypeError(f"pyembed: apply_optimizer_in_backward fuses {_FUSED_NAMES}; got {name!r}")
    params = list(params)
    kwargs = dict(optimizer_kwargs or {})
    for p in params:
        if not isinstance(p, torch.nn.Parameter) or checks.is_dtensor(p) or checks.is_foreign_subclass(p):
            # (a quantized table is looked up through its own F.embedding, with no fused update)
            raise checks.InputTypeError(f"pyembed: apply_optimizer_in_backward takes the Parameters of pyembed tables "
                                        f"(not sharded DTensor tables, nor tensor subclasses such as quantized "
                                        f"tables); got {type(p).__name__}")
        if not p.is_floating_point() or p.dim() != 2:
            raise checks.InputValueError(f"pyembed: a fused optimizer needs a 2-D float table, got {p.dtype} "
                                         f"of shape {tuple(p.shape)}")
        if getattr(p, ATTR, None) is not None or getattr(p, "_in_backward_optimizers", None):
            raise checks.InputValueError("pyembed: this parameter already has an optimizer in its backward")
        if p.grad is not None:
            raise checks.InputValueError("pyembed: this parameter already holds a gradient (.grad): zero it with "
                                         "set_to_none=True, and leave it out of other optimizers, first")
    if torch.distributed.is_available() and torch.distributed.is_initialized() and \
            torch.distributed.get_world_size() > 1:
        warnings.warn(
            "pyembed: apply_optimizer_in_backward under torch.distributed: each rank updates its table from its own "
            "gradient, with no all-reduce. Right for a table each rank owns a part of (a vocab-parallel shard); "
            "wrong for a replicated table under DistributedDataParallel, whose replicas would drift apart: keep "
            "such a table on a torch optimizer.", RuntimeWarning, stacklevel=2)
    optimizer = optimizer_class(params, **kwargs)
    if optimizer_class is not torch.optim.SparseAdam:
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("differentiable"):
                raise checks.InputValueError("pyembed: amsgrad and differentiable are not fused; use the torch "
                                             "optimizer for these tables")
    # A bound method, as LR schedulers expect to wrap it; the update already happened in the
    # backward. Wrapped as torch wraps every optimizer's step, so step hooks (the optimizer's
    # own and the global ones) run when it is called, as for a torch optimizer.
    optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(_step_is_done), optimizer)
    optimizer.add_param_group = types.MethodType(_takes_no_more_params, optimizer)
    # What torch's fused optimizers declare: a GradScaler then calls step() itself, with its
    # scale and inf flag set on the optimizer -- so step() can say what went wrong (without
    # it the scaler failed with "No inf checks were recorded for this optimizer").
    optimizer._step_supports_amp_scaling = True
    _guard_other_optimizers()
    global tables_are_fused
    tables_are_fused = True
    prepare_outside_compiled_graphs()
    for p in params:
        setattr(p, ATTR, optimizer)
        p._in_backward_optimizers = [optimizer]  # where torch's in-backward optimizers live (torch.distributed.optim)
        p.register_post_accumulate_grad_hook(_no_outside_gradient)
    return [optimizer]


def _step_is_done(self, closure=None):
    """A fused optimizer's step: the backward already applied it."""
    if hasattr(self, "found_inf"):  # set by a GradScaler stepping it (_step_supports_amp_scaling)
        del self.found_inf, self.grad_scale  # (the scaler removes them after a step that returns)
        raise checks.InputValueError(
            "pyembed: a GradScaler stepped an optimizer of apply_optimizer_in_backward, whose tables were updated "
            "inside the backward from the gradient as it arrived -- multiplied by the loss scale, and no step can "
            "undo that. Loss scaling and in-backward updates do not mix: train in bfloat16 autocast (no scaler), or "
            "keep these tables on a torch optimizer")
    return closure() if closure is not None else None


def _takes_no_more_params(self, param_group) -> None:
    """A fused optimizer's add_param_group: a parameter added later would never be updated
    (step() does nothing, and no backward of pyembed's knows it)."""
    raise checks.InputValueError(
        "pyembed: an optimizer made by apply_optimizer_in_backward takes no more parameters: its step() does "
        "nothing, so they would never be updated. Fuse another pyembed table with its own "
        "apply_optimizer_in_backward call, and put other parameters in a torch optimizer")


def _no_outside_gradient(param: torch.Tensor) -> None:
    # Autograd runs this hook after pyembed's backward too (its None gradient accumulates nothing).
    if param.grad is None:
        return
    raise checks.InputValueError(
        "pyembed: a table with a fused optimizer (apply_optimizer_in_backward) received a gradient from outside "
        "pyembed's op (a tied output layer, or a use not through pyembed): its update would miss that gradient. "
        "Keep such parameters on a torch optimizer instead.")


_guarded = False


def _guard_other_optimizers() -> None:
    """A torch optimizer stepping a fused table would find no gradient and silently skip it:
    say so at its first step (a global optimizer hook, installed once a table is fused)."""
    global _guarded
    if not _guarded:
        register_optimizer_step_pre_hook(_refuse_fused_params)
        _guarded = True


def _refuse_fused_params(optimizer, args, kwargs) -> None:
    for group in optimizer.param_groups:
        for p in group["params"]:
            fused = getattr(p, ATTR, None)
            if fused is not None and fused is not optimizer:  # (its own no-op step() may be called)
                raise checks.InputValueError(
                    f"pyembed: {type(optimizer).__name__}.step() over a table whose optimizer runs in pyembed's "
                    "backward (apply_optimizer_in_backward); leave that table out of this optimizer")


# False until a table is fused: until then the op's hot path pays one global read for this feature.
tables_are_fused = False
_disabled_call = None  # _call, never traced by torch.compile (prepare_outside_compiled_graphs)


def _call(fn, *args, **kwargs):
    return fn(*args, **kwargs)


def prepare_outside_compiled_graphs() -> None:
    """Make what outside_compiled_graphs calls, before it is first needed: by
    apply_optimizer_in_backward, or while Dynamo traces (functional.py). Not at import:
    torch.compiler.disable imports Dynamo."""
    global _disabled_call
    if _disabled_call is None:
        _disabled_call = torch.compiler.disable(_call)


def outside_compiled_graphs(fn, *args, **kwargs):
    """fn(*args, **kwargs), run eagerly even inside a function torch.compile traces (a graph
    break); prepare_outside_compiled_graphs has run."""
    return _disabled_call(fn, *args, **kwargs)


def fused_optimizer(table: Optional[torch.Tensor]) -> Optional[torch.optim.Optimizer]:
    return None if table is None else getattr(table, ATTR, None)


def fused_tables(weight: torch.Tensor, pos_weight: Optional[torch.Tensor]):
    """(weight, pos_weight), each kept only if its optimizer runs in the backward; None if neither."""
    fused_weight = weight if fused_optimizer(weight) is not None else None
    fused_pos_weight = pos_weight if fused_optimizer(pos_weight) is not None else None
    # Tested with `is`: comparing a tuple that holds a tensor with (None, None) calls
    # Tensor.__ne__ through torch's function dispatch, ~9 us of every such step.
    if fused_weight is None and fused_pos_weight is None:
        return None
    return fused_weight, fused_pos_weight


def step_tables(backend, config, grad_out: torch.Tensor, ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                tables, needs: tuple[bool, bool], dropout_key: Optional[torch.Tensor] = None) -> tuple[bool, bool]:
    """The backward's seam for fused optimizers: each table of ``tables`` whose gradient is
    needed is updated from its gradient rows -- the token table's touched rows (the
    backend's touched_rows: the sparse backward's sorted unique rows, summed, padding and
    out-of-range ids left out, scale and scale_grad_by_freq applied; on a GPU with no host
    sync) and the learned positions' dense gradient -- and needs no gradient any more. A
    dense token table on a backend with optimizer_backward (cuda, triton) is updated by that op
    from grad_out and ids directly: the same update, its gradient rows never in memory; the
    learned positions (p = offset + t) likewise where the backend has position_update (cuda, triton).
    dropout_key: the forward's, which the ops apply to grad_out as they read it. Returns
    what still does."""
    weight, pos_weight = tables
    need_weight_grad, need_pos_grad = needs
    if isinstance(grad_out, FakeTensor):
        # FakeTensorMode (a memory estimator's step, as torch's MemTracker runs one): the
        # update changes values, which fake tables lack, so only its state is made, as in a
        # real step (the estimate counts it); the touched rows, whose count depends on the
        # ids' values, are not computed.
        for table, need in zip(tables, needs):
            if table is not None and need:
                prepare(table)
        return need_weight_grad and weight is None, need_pos_grad and pos_weight is None
    if weight is not None and need_weight_grad:
        if backend.optimizer_backward is not None and not config.sparse and grad_out.dtype == weight.dtype:
            _, state, update = prepare(weight)
            state1, state2 = state_tensors(update.rule, state, weight)
            backend.optimizer_backward(grad_out, ids, config.scale, config.padding_idx, config.scale_grad_by_freq,
                                       dropout_key, config.dropout_p, weight.detach(), state1, state2, update.rule,
                                       list(update.hyper), update.all_rows)
        else:
            rows, values = (backend.touched_rows or backend.sparse_backward)(
                grad_out, ids, weight.shape[0], config.scale, config.padding_idx, config.scale_grad_by_freq,
                dropout_key, config.dropout_p)
            _update(backend, weight, rows, values, config.sparse)
        need_weight_grad = False
    if (pos_weight is not None and need_pos_grad and backend.position_update is not None and position_ids is None
            and grad_out.dtype == pos_weight.dtype):
        _, state, update = prepare(pos_weight)
        state1, state2 = state_tensors(update.rule, state, pos_weight)
        backend.position_update(grad_out, ids, config.offset, dropout_key, config.dropout_p, pos_weight.detach(),
                                state1, state2, update.rule, list(update.hyper))
        need_pos_grad = False
    if pos_weight is not None and need_pos_grad:
        _, pos_grad = backend.backward_op(grad_out)(grad_out, ids, position_ids, config.offset, 0,
                                                    pos_weight.shape[0], config.scale, config.padding_idx, False,
                                                    False, True, dropout_key, config.dropout_p)  # eagerly: no dispatch
        _update(backend, pos_weight, _row_range(pos_weight.shape[0], pos_grad.device), pos_grad, False, every_row=True)
        need_pos_grad = False
    return need_weight_grad, need_pos_grad


@functools.lru_cache(maxsize=None)
def _row_range(num_rows: int, device: torch.device) -> torch.Tensor:
    """0..num_rows-1 on ``device``, made once (on a GPU an arange per step was a launch) and
    only read. Copied from the host with a blocking copy, so that it is written before any
    stream reads it, whichever stream a later step runs on."""
    return torch.arange(num_rows).to(device)


def _update(backend, table: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, sparse_grad: bool,
            every_row: bool = False) -> None:
    """One table's update from its gradient rows. every_row: ``rows`` names every table row
    (the learned positions' dense gradient), so the kernels update them as given, without
    the map from table row to gradient row that an update of untouched rows needs (one
    fill and one launch less per step)."""
    _, state, update = prepare(table)  # refuses grad mode: the update needs no torch.no_grad() (~1.6 us each)
    if backend.optimizer_update is None:
        reference_update(table, state, update, rows, values, sparse_grad)
    else:
        state1, state2 = state_tensors(update.rule, state, table)
        values = values if values.dtype == table.dtype else values.to(table.dtype)
        backend.optimizer_update(table.detach(), state1, state2, rows, values, update.rule, list(update.hyper),
                                 update.all_rows and not every_row)


# --------------------------------------------------------------------------- one update
class Update(NamedTuple):
    """One table's update, as the kernels take it: rule, host scalars, and whether rows
    with no gradient change too (dense semantics: decay, momentum, weight decay). A
    NamedTuple: built per table per step, where a frozen dataclass's __init__ cost ~1 us."""

    rule: int
    hyper: tuple[float, ...]  # per rule, in the order of csrc/optim.h Scalars::from (built by prepare)
    all_rows: bool


def check_call(weight: torch.Tensor, pos_weight: Optional[torch.Tensor], sparse: bool) -> None:
    """A forward on tables of which at least one has its optimizer in the backward: no
    torch.func transform (the update cannot be batched), and what torch's optimizer would
    refuse for the gradient each table gets."""
    if torch._C._are_functorch_transforms_active():
        raise checks.InputValueError("pyembed: a table with a fused optimizer cannot be used under torch.func "
                                     "transforms")
    for table, positional in ((weight, False), (pos_weight, True)):
        if fused_optimizer(table) is not None:
            _check_table_use(table, sparse and not positional, positional)


def _check_table_use(table: torch.Tensor, sparse_grad: bool, positional: bool) -> None:
    """What torch's optimizer would refuse for the gradient this table gets (sparse for a
    sparse=True token table, dense otherwise), refused at the forward with torch's reason."""
    optimizer = getattr(table, ATTR)
    rule = _FUSED[type(optimizer)]
    name = type(optimizer).__name__
    group = _group_of(optimizer, table)
    if rule == SPARSE_ADAM and not sparse_grad:
        what = "the learned positional table's gradient is dense" if positional else "the table has sparse=False"
        raise checks.InputValueError(f"pyembed: SparseAdam needs a sparse gradient and {what} (as torch.optim."
                                     "SparseAdam refuses it); use Adam/AdamW, or sparse=True")
    if sparse_grad and rule == ADAM:
        raise checks.InputValueError(f"pyembed: {name} does not support sparse gradients (sparse=True); "
                                     "use SparseAdam, or sparse=False")
    if sparse_grad and rule in (SGD, ADAGRAD) and group["weight_decay"] != 0:
        raise checks.InputValueError("pyembed: weight_decay is not compatible with sparse gradients (sparse=True)")
    if sparse_grad and rule == SGD and group["momentum"] != 0:
        raise checks.InputValueError("pyembed: a fused SGD with momentum needs a dense table (sparse=False)")


def _group_of(optimizer: torch.optim.Optimizer, table: torch.Tensor) -> dict:
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p is table:
                return group
    raise checks.InputValueError("pyembed: the fused optimizer no longer holds this table in its param_groups")


def prepare(table: torch.Tensor) -> tuple[torch.optim.Optimizer, dict, Update]:
    """The optimizer's state for ``table`` (created as torch creates it), its step counted,
    and this backward's scalars read from its param group (lr schedules apply)."""
    if torch.is_grad_enabled():
        raise checks.InputValueError("pyembed: a table with a fused optimizer cannot be differentiated twice "
                                     "(create_graph=True): its update runs inside the backward")
    task = torch._C._current_graph_task_id()
    if task != -1 and getattr(table, "_pyembed_graph_task", None) == task:
        raise checks.InputValueError(
            "pyembed: a table with a fused optimizer was used twice in one backward; its update would run twice. "
            "Make one pyembed call per table per step (or use the torch optimizer for it)")
    if _captured(table):
        raise checks.InputValueError(
            "pyembed: a table with a fused optimizer (apply_optimizer_in_backward) cannot be updated in a CUDA graph "
            "capture: each backward takes the update's lr and bias correction from the host, and every replay would "
            "repeat the captured ones (torch's optimizers refuse capture unless capturable=True for the same reason). "
            "Train such a table outside the captured graph, or capture it with a torch optimizer (capturable=True)")
    table._pyembed_graph_task = task  # the backward pass that last updated it
    optimizer = getattr(table, ATTR)
    # This backward is the optimizer's step: what an LR scheduler's wrapper of step() marks,
    # so a scheduler stepped without calling the no-op step() does not warn that it was.
    optimizer._opt_called = True
    group = _group_of(optimizer, table)
    rule = _FUSED[type(optimizer)]
    # A kernel argument: a CUDA tensor lr (torch's fused / capturable optimizers take one) is
    # read back here, a sync per backward; the kernels would need it from device memory.
    lr = float(group["lr"])
    maximize = float(bool(group.get("maximize", False)))
    if rule == SGD:
        momentum, wd = float(group["momentum"]), float(group["weight_decay"])
        state = optimizer.state[table] if momentum != 0 else {}  # torch's SGD keeps none without momentum
        first = float(momentum != 0 and state.get("momentum_buffer") is None)
        if first:
            # buf = g on the first step, written by the kernel -- which reads it first: zeros, not
            # uninitialised memory (compute-sanitizer's initcheck on an H200 at 1b594a4), once a table.
            state["momentum_buffer"] = torch.zeros_like(table)
        hyper = (lr, momentum, float(group["dampening"]), wd, float(group["nesterov"]), maximize, first)
        return optimizer, state, Update(rule, hyper, momentum != 0 or wd != 0)
    state = optimizer.state[table]
    if rule == SPARSE_ADAM:
        if not state:
            state["step"] = 0
            state["exp_avg"] = torch.zeros_like(table)
            state["exp_avg_sq"] = torch.zeros_like(table)
        state["step"] += 1
        beta1, beta2 = map(float, group["betas"])
        step = state["step"]
        step_size = lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)
        hyper = (step_size, beta1, beta2, float(group["eps"]), maximize, lr)  # lr: for the reference only
        return optimizer, state, Update(rule, hyper, False)
    on_device = group.get("fused") or group.get("capturable")
    if not state:  # torch's layout: step a float32 scalar, on the CPU unless fused/capturable
        state["step"] = (torch.zeros((), dtype=torch.float32, device=table.device) if on_device
                         else torch.tensor(0.0, dtype=torch.float32))
        if on_device:
            _keep(_counted_steps, state["step"], 0.0)
        if rule == ADAM:
            state["exp_avg"] = torch.zeros_like(table)
            state["exp_avg_sq"] = torch.zeros_like(table)
        else:
            state["sum"] = torch.full_like(table, float(group["initial_accumulator_value"]))
    step = _step_count(state) if on_device else _cpu_step(state)
    wd = float(group["weight_decay"])
    if rule == ADAM:
        beta1, beta2 = map(float, group["betas"])
        hyper = (lr, beta1, beta2, float(group["eps"]), wd, float(bool(group.get("decoupled_weight_decay"))),
                 maximize, 1 - beta1**step, math.sqrt(1 - beta2**step))
        return optimizer, state, Update(rule, hyper, True)
    clr = lr / (1 + (step - 1) * float(group["lr_decay"]))
    return optimizer, state, Update(rule, (clr, wd, float(group["eps"]), maximize), wd != 0)


def _captured(table: torch.Tensor) -> bool:
    """Whether this backward runs in a CUDA graph capture (no capture without CUDA initialised:
    a fake CUDA table on a machine without a GPU asks nothing of the driver)."""
    return table.is_cuda and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


# The step of a fused or capturable group lives beside its table: on a GPU, where reading it
# would make every backward wait for the device. Its count is kept here instead, on the
# host, by the tensor's id (with a weak reference, so a new tensor at a reused address is
# not taken for it): set when prepare makes the state, else read from the tensor once (a
# state from a checkpoint: load_state_dict brings new tensors), then counted with the
# increments prepare makes. Not seen: a step changed in place by anything else.
_counted_steps: dict[int, tuple[weakref.ref, float]] = {}
# A step on the CPU (a group neither fused nor capturable: torch's default) is counted
# through a view of its memory (a memoryview of a numpy view), kept the same way:
# ``state["step"] += 1`` is a torch op, ~3 us of host time a table a step on the development
# VM (~8 us inside a backward), the view's add ~0.1 us (a 0-d numpy array's, 1.4 us). The
# tensor's version counter does not see it; nothing reads that of an optimizer's step.
_step_views: dict[int, tuple[weakref.ref, memoryview]] = {}


def _kept(kept: dict, tensor: torch.Tensor):
    """What ``kept`` holds for this very tensor, or None."""
    found = kept.get(id(tensor))
    return found[1] if found is not None and found[0]() is tensor else None


def _keep(kept: dict, tensor: torch.Tensor, value) -> None:
    if len(kept) >= 1024:  # drop the entries of freed tensors
        for key in [key for key, (ref, _) in kept.items() if ref() is None]:
            del kept[key]
    kept[id(tensor)] = (weakref.ref(tensor), value)


def _step_count(state: dict) -> float:
    """``state["step"] += 1`` for a step on the table's device, and its new value, without
    reading the device when its count is kept."""
    state["step"] += 1
    step = state["step"]
    count = _kept(_counted_steps, step)
    count = float(step) if count is None else count + 1  # one device->host read, the first time it is seen
    _keep(_counted_steps, step, count)
    return count


def _cpu_step(state: dict) -> float:
    """``state["step"] += 1`` for a step on the CPU, and its new value."""
    step = state["step"]
    view = _kept(_step_views, step)
    if view is None:
        try:
            plain = (type(step) is torch.Tensor and step.is_cpu and not step.dim() and not step.requires_grad
                     and step.dtype in (torch.float32, torch.float64))
            view = memoryview(step.view(1).numpy()) if plain else None
        except RuntimeError:  # torch without numpy
            view = None
        if view is None:  # a number, a tensor of another kind: counted as torch's optimizer counts it
            state["step"] += 1
            return float(state["step"])
        _keep(_step_views, step, view)
    view[0] += 1  # rounded to the tensor's dtype, as the torch op rounds it
    return view[0]


def state_tensors(rule: int, state: dict, table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(state1, state2) as the kernels take them; an unused one is an empty tensor on the
    table's device (the C++ ops check that every tensor is on one device)."""
    if rule in (ADAM, SPARSE_ADAM):  # both held: no placeholder to allocate (~0.7 us a table a step)
        return state["exp_avg"], state["exp_avg_sq"]
    unused = table.new_empty(0)
    if rule == SGD:
        buffer = state.get("momentum_buffer")
        return (buffer if buffer is not None else unused), unused
    return state["sum"], unused  # Adagrad


def reference_update(table: torch.Tensor, state: dict, update: Update, rows: torch.Tensor,
                     values: torch.Tensor, sparse_grad: bool) -> None:
    """The spec: torch's own functional optimizer on the gradient the plain path gives --
    dense (zeros where untouched) or, for sparse_grad, the coalesced COO of (rows, values)."""
    num_rows, dim = table.shape
    if sparse_grad:
        grad = torch.sparse_coo_tensor(rows[None], values.to(table.dtype), (num_rows, dim),
                                       check_invariants=True).coalesce()
    else:
        grad = table.new_zeros(num_rows, dim).index_put_((rows,), values.to(table.dtype), accumulate=True)
    hyper = update.hyper
    with torch.no_grad():
        if update.rule == SGD:
            lr, momentum, dampening, wd, nesterov, maximize, first = hyper
            buffers = [None if first else state.get("momentum_buffer")]
            _sgd.sgd([table], [grad], buffers, weight_decay=wd, momentum=momentum, lr=lr, dampening=dampening,
                     nesterov=bool(nesterov), maximize=bool(maximize), foreach=False, has_sparse_grad=sparse_grad)
            if momentum != 0:
                state["momentum_buffer"] = buffers[0]
        elif update.rule == ADAM:
            lr, beta1, beta2, eps, wd, decoupled, maximize, _, _ = hyper
            step = state["step"] - 1  # torch's functional adam counts the step itself
            _adam.adam([table], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [], [step], foreach=False,
                       amsgrad=False, beta1=beta1, beta2=beta2, lr=lr, weight_decay=wd, eps=eps,
                       maximize=bool(maximize), decoupled_weight_decay=bool(decoupled))
            state["step"] = step
        elif update.rule == ADAGRAD:
            clr, wd, eps, maximize = hyper
            # torch's functional adagrad takes lr and lr_decay; clr already holds the decay: lr_decay=0.
            step = state["step"] - 1
            with torch.sparse.check_sparse_tensor_invariants(enable=False):  # torch's own sparse path, unwarned
                _adagrad.adagrad([table], [grad], [state["sum"]], [step], foreach=False, lr=clr,
                                 weight_decay=wd, lr_decay=0.0, eps=eps, has_sparse_grad=sparse_grad,
                                 maximize=bool(maximize))
            state["step"] = step
        else:
            _, beta1, beta2, eps, maximize, lr = hyper
            _sparse_functional.sparse_adam([table], [grad], [state["exp_avg"]], [state["exp_avg_sq"]], [state["step"]],
                                           eps=eps, beta1=beta1, beta2=beta2, lr=lr, maximize=bool(maximize))
