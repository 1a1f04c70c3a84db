"""The ``triton`` backend: kernels in ``pyembed.kernels.embedding`` (top-level kernels/),
registered as ops so ``torch.compile`` sees them:

- ``pyembed::triton_forward``: a custom op that, when torch.compile functionalises the
  graph, launches through ``wrap_triton`` so Inductor traces the kernel itself (what
  ``torch.library.triton_op`` does, registered without importing Triton or Inductor);
  under the CPU interpreter an opaque custom op (interpreted kernels cannot be traced);
- ``pyembed::triton_backward``: the dense backward, a custom op that torch.compile
  decomposes the same way (its kernels, and torch's sort where the tile sort does not
  fit; no host sync);
- ``pyembed::triton_sparse_backward``: the sparse backward, tagged cudagraph_unsafe (the
  number of touched rows is read back from the device).

Eager calls on real tensors run the forward and dense backward bodies (``forward``,
``backward``) directly: a Python custom op's dispatch costs more host time than the
launch itself (pyembed.dispatch.Backend.eager_forward); from a metadata's second or third
call on, their launches replay plans kept per metadata (kernels/launch.py), and a lookup's
node (pyembed::embedding with these kernels) calls a forward's replay and a dense
backward's whole replay itself, from C++ (``set_forward_replay``, ``set_backward_replay``).
The ops serve torch.compile, torch.func and fake-tensor tracing.

Imported by pyembed/__init__.py only when the triton package exists; triton itself is
imported on first use, so ``import pyembed`` stays cheap. On CPU tensors
the backend runs only under ``TRITON_INTERPRET=1`` (how it is tested without a GPU).
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Optional

import torch

from torch._subclasses.functional_tensor import FunctionalTensorMode  # imported by torch itself

from . import _autograd, _ops, checks, dispatch, reference
from ._extension import _C
from .checks import CUDAGRAPH_UNSAFE

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@functools.cache
def _kernels():
    """pyembed.kernels.embedding, imported on first use (it imports triton); then remembered:
    an import statement per call costs the host a microsecond."""
    from .kernels import embedding

    return embedding


def _why_unavailable(device: torch.device) -> Optional[str]:
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    if device.type == "cpu":
        if _INTERPRETED:
            return None
        return "Triton runs on CPU tensors only under TRITON_INTERPRET=1 (set before triton is imported)"
    return f"the triton backend takes CUDA tensors, not {device.type}"


_NO_GUARD = contextlib.nullcontext()


def _on_device(t: torch.Tensor):
    """Triton launches on the *current* CUDA device; make it the tensors' device (a
    torchrun script may move tensors to cuda:rank without set_device). Usually it already
    is, and then no guard is entered (a device switch costs the host microseconds). The
    current device as kernels.launch.device_getter reads it: torch.cuda.current_device's C
    function, without the Python function's lazy-init check (~2.0 -> ~0.6 us on a GPU's host)."""
    index = t.get_device()  # -1 on the CPU; cheaper than t.device.type
    if index < 0 or index == torch._C._cuda_getDevice():
        return _NO_GUARD
    return torch.cuda.device(index)


def _forward(ids, weight, pos_weight, position_ids, pos_encoding: str, scale: float, offset: int, dropout_key,
             dropout_p: float, sinusoid_column_offset: int = 0, sinusoid_dim: int = 0, error_record: int = 0, *,
             launch, device_guard=True, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    if out is None:
        out = weight.new_empty(*ids.shape, weight.shape[1])
    mode = checks.POS_CODES[pos_encoding]
    with _on_device(weight) if device_guard else contextlib.nullcontext():
        _kernels().embedding_forward(
            ids.contiguous(), weight.contiguous(), pos_weight.contiguous() if mode == 1 else None,
            position_ids.long().contiguous() if (position_ids is not None and mode) else None,
            mode, scale, offset, dropout_key, 0 if dropout_key is None else reference.dropout_threshold(dropout_p),
            1.0 if dropout_key is None else reference.dropout_scale(dropout_p), sinusoid_column_offset,
            sinusoid_dim or weight.shape[1], out,
            launch=launch, error_record=error_record,
        )
    return out


def forward(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
            position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int,
            dropout_key: Optional[torch.Tensor], dropout_p: float, sinusoid_column_offset: int = 0,
            sinusoid_dim: int = 0, error_record: int = 0) -> torch.Tensor:
    """The forward (schema of reference.embedding_forward); eagerly, a direct launch. With
    an error_record the kernel checks the ranges into it, and an earlier call's finding is
    raised first (pyembed.checks; csrc/checks.h does the same for the cuda backend).

    A lookup without position_ids or dropout is launched from a plan kept per metadata
    (``_plans``, from the second call of that metadata on): the kernel Triton compiled for
    those shapes, dtypes and arguments, launched again with the new tensors and offset
    (kernels.launch.bind). What lies between this call and the launch -- the launch key over
    25 arguments, their list, the block sizes -- is then done once: a one-token forward's
    host time 11 -> 5 us on the development VM (stand-in driver, ``python -m bench.triton_host``)."""
    if error_record:
        checks.raise_pending_error(weight.device)
    return node_forward(None, ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key,
                        dropout_p, sinusoid_column_offset, sinusoid_dim, error_record)


def node_forward(out: Optional[torch.Tensor], ids: torch.Tensor, weight: torch.Tensor,
                 pos_weight: Optional[torch.Tensor], position_ids: Optional[torch.Tensor], pos_encoding: str,
                 scale: float, offset: int, dropout_key: Optional[torch.Tensor], dropout_p: float,
                 sinusoid_column_offset: int, sinusoid_dim: int, error_record: int) -> torch.Tensor:
    """forward's launch into ``out`` (None: a new tensor), from its plan where it has one,
    without forward's check of the record. The forward of pyembed::embedding's C++ node
    (csrc/pyembed.cpp, PythonKernels), which raises an earlier call's finding and allocates
    ``out`` itself: in Python the two cost ~1.3 us (new_empty 1.1, the record's check with
    its torch.device 0.3); from C++ a one-token forward took ~1 us less on the development
    VM (stand-in driver, ``python -m bench.triton_host``, best of three runs each: 14.3 ->
    13.3 us with a gradient, 11.0 -> 9.9 under no_grad). The replay it binds it gives the
    node too (``_C.set_forward_replay``), which from then on replays it without calling this
    function where the call has that metadata and contiguous tensors."""
    plan = None
    positions = position_ids is not None and pos_encoding != "none"  # (without an encoding: unread)
    planned = type(scale) is float and type(offset) is int and (pos_weight is None or pos_encoding == "learned")
    if planned:
        # Everything the launch's fixed arguments, grid and binary depend on: of the offset (a
        # decoder's position, new each step) only what Triton specialises it on; of the
        # position ids (as Hugging Face models pass them) their shape; of the dropout its p
        # (the key is new each call). The tensors' alignment is checked by the replay.
        key = (ids.shape, ids.dtype, weight.shape, weight.dtype, weight.device,
               None if pos_weight is None else (pos_weight.shape, pos_weight.dtype), pos_encoding, scale,
               _kernels().int_class(offset), sinusoid_column_offset, sinusoid_dim, error_record,
               position_ids.shape if positions else None, None if dropout_key is None else dropout_p)
        plan = _plans.get(key)
        if (type(plan) is tuple and ids.is_contiguous() and weight.is_contiguous()
                and (pos_weight is None or pos_weight.is_contiguous())):
            out_shape, replay = plan
            if out is None:
                out = weight.new_empty(*out_shape)  # ints: a torch.Size costs the host ~1.5 us more
            table = weight if pos_weight is None else pos_weight
            with _on_device(weight):
                if positions or dropout_key is not None:  # (bound with FORWARD_REPLAYED_ALL)
                    done = replay(ids, position_ids.long().contiguous() if positions else ids,
                                  ids if dropout_key is None else dropout_key, weight, table, out, offset)
                else:
                    done = replay(ids, weight, table, out, offset)
            if done:
                return out
        elif plan is None:
            _note_first_call(_plans, key)
    reference.check_sinusoid_columns(pos_encoding, sinusoid_column_offset, sinusoid_dim, weight.shape[1])
    # A metadata's second call: launched through a Binding, which keeps the replay.
    binding = None
    if plan is _SEEN:
        k = _kernels()
        binding = k.Binding(**(k.FORWARD_REPLAYED_ALL if positions or dropout_key is not None else k.FORWARD_REPLAYED))
    out = _forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p,
                   sinusoid_column_offset, sinusoid_dim, error_record, launch=binding or _direct, out=out)
    if binding is not None:
        _plans[key] = (tuple(out.shape), binding.replay) if binding.replay is not None else _UNPLANNED
        if (binding.replay is not None and sinusoid_column_offset == 0 and sinusoid_dim == 0
                and hasattr(_C, "set_forward_replay")):
            # The node (csrc/pyembed.cpp) keeps it too, and replays it without this function:
            # only a call of the node's form, whose sinusoid is the table's own columns (a
            # column shard's, offset and width given, would be replayed there for a plain
            # lookup of the shard's shape: the node's key holds neither).
            _C.set_forward_replay(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key,
                                  dropout_p, error_record, binding.replay)
    return out


def clear_plans(forward: bool = True, backward: bool = True) -> None:
    """Forget the forward's or the dense backward's plans, or both, the node's replays of them
    too: the next call of each metadata is its first (bench.triton_host times one; a setting
    read when a call is planned, e.g. PYEMBED_TRITON_ROW_TILES, applies from then on)."""
    if forward:
        _plans.clear()
    if backward:
        _backward_plans.clear()
    if hasattr(_C, "clear_replays"):
        _C.clear_replays(forward, backward)


# Launch plans by metadata key, forward's (output shape, replay) and backward's LaunchPlan:
# _SEEN after one call, then the plan, or _UNPLANNED where the launches cannot be replayed.
_plans: dict = {}
_backward_plans: dict = {}
_segment_plans: dict = {}  # optimizer_backward's sort and chunks
_update_plans: dict = {}  # the optimizer's launches (their tensors and the step's scalars replaced), keyed by kind
_touched_plans: dict = {}  # touched_rows' (an optimizer's sparse gradient rows)
_MAX_PLANS = 256
_SEEN, _UNPLANNED = "seen", "unplanned"


def _note_first_call(plans: dict, key) -> None:
    """A metadata's first call: planned at its second, if there is one (a plan costs ~20 us
    per launch). Bounded: a server's stream of new shapes starts the plans afresh rather than
    holding them all."""
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = _SEEN


def _direct(kernel):
    """An eager launch: through the kernel's cached launcher (kernels/launch.py)."""
    return _kernels().cached(kernel)


def _planned(plans: dict, key, inputs: tuple, run, floats: bool = False, keep=None):
    """``run(launch)`` -- a helper's launches and allocations, returning a tuple of tensors
    -- planned per metadata ``key`` (kernels.launch.LaunchPlan): through the cached launcher
    at the metadata's first call, bound at its second, replayed from its third: whole (its
    allocations and launches, none of the helper's Python) where the bound call was nothing
    else, else launch by launch. ``inputs``: the tensors ``run`` reads (None allowed),
    contiguous, the device's first; ``key`` holds everything else its launches follow from
    -- but the float arguments, with ``floats`` (replayed launch by launch, each with the
    call's own: an optimizer step's scalars). ``keep``: given the call's whole replay
    (LaunchPlan.replay_whole's function of ``inputs``) when it is planned whole."""
    plan = plans.get(key)
    if plan is None:
        _note_first_call(plans, key)
        return run(_direct)
    if plan is _UNPLANNED:
        return run(_direct)
    if plan is _SEEN:  # this metadata's second call: bound as it launches
        plan = _kernels().LaunchPlan(floats)
        result = plan.bind_call(run, inputs)
        plans[key] = plan if plan.complete else _UNPLANNED
        if keep is not None and plan.whole is not None:
            keep(plan.whole)
        return result
    with _on_device(inputs[0]):
        result = plan.replay_whole(inputs)
    return result if result is not None else run(plan.replaying())


@functools.cache
def _inductor_takes_launch_options() -> bool:
    """Whether Inductor compiles a user kernel with the compile options given beside its
    arguments (``maxnreg``: kernels.launch.LAUNCH_OPTIONS), as torch 2.14 does; before, it
    would take one for an argument the kernel lacks."""
    from torch._inductor.runtime import triton_helpers

    return hasattr(triton_helpers, "try_filter_backend_options_for_target")


class _Traced:
    """``launch=`` in a compiled graph: torch.library.wrap_triton, so Inductor gets the kernel
    itself -- without the launch's ``maxnreg`` (a register budget for ptxas's schedule, not
    arithmetic) where Inductor would not take it."""

    def __call__(self, kernel):
        self.wrapped = torch.library.wrap_triton(kernel)
        return self

    def __getitem__(self, grid):
        if _inductor_takes_launch_options():
            return self.wrapped[grid]
        return lambda *args, maxnreg=None, **kwargs: self.wrapped[grid](*args, **kwargs)


triton_forward = torch.library.custom_op("pyembed::triton_forward", mutates_args=())(forward)


if not _INTERPRETED:
    @triton_forward.register_torch_dispatch(FunctionalTensorMode)
    def _(mode, func, types, args, kwargs):
        # What torch.library.triton_op does, without its definition-time scan of the
        # function's source (which imports Inductor, ~2 s, at `import pyembed`): when
        # AOTAutograd functionalises a compiled graph, the launcher runs through
        # wrap_triton, so Inductor gets the Triton kernel itself, not an opaque call.
        # (Under the interpreter kernels run eagerly on data and cannot be traced.) The
        # generated code guards the device itself.
        with mode:
            return _forward(*args, **kwargs, launch=_Traced(), device_guard=False)


def _backward(grad_out, ids, position_ids, offset: int, num_embeddings: int, num_positions: int, scale: float,
              padding_idx: Optional[int], scale_grad_by_freq: bool, need_weight_grad: bool, need_pos_grad: bool,
              dropout_key: Optional[torch.Tensor] = None, dropout_p: float = 0.0, *,
              launch=_direct, device_guard=True) -> tuple[torch.Tensor, torch.Tensor]:
    k = _kernels()
    dim = grad_out.shape[-1]
    dout = grad_out.contiguous().reshape(ids.numel(), dim)  # not -1: d may be 0
    dropout = _dout_dropout(dropout_key, dropout_p)
    weight_grad = pos_grad = None  # (0, d) where not asked for: made only then (each op costs the host)
    with _on_device(grad_out) if device_guard else contextlib.nullcontext():
        # Dense gradients are written once, every row: no zero fill first. Learned positions
        # by p = offset + t are written by the token table's last kernel.
        positions = None
        if need_pos_grad and position_ids is None:
            pos_grad = grad_out.new_empty(num_positions, dim)
            seq_len = ids.shape[-1] if ids.numel() else 0
            if num_positions and dim:
                positions = k.PositionSums(pos_grad, ids.numel() // max(seq_len, 1), seq_len,
                                           min(max(num_positions - offset, 0), seq_len), offset)
        if need_weight_grad:
            weight_grad = k.dense_gradient(dout, ids, num_embeddings, -1 if padding_idx is None else padding_idx,
                                           scale, scale_grad_by_freq, launch=launch, positions=positions,
                                           dropout=dropout)
        elif positions is not None:
            k.batch_sum(dout, positions, launch=launch, dropout=dropout)
        if need_pos_grad and position_ids is not None:
            pos_grad = k.dense_gradient(dout, position_ids, num_positions, -1, 1.0, False, launch=launch,
                                        dropout=dropout)
    return (grad_out.new_empty(0, dim) if weight_grad is None else weight_grad,
            grad_out.new_empty(0, dim) if pos_grad is None else pos_grad)


def _dout_dropout(dropout_key: Optional[torch.Tensor], dropout_p: float):
    """The forward's dropout as the backward's kernels apply it as they read dout (no mask
    pass first; kernels' DoutDropout), None without a key."""
    if dropout_key is None:
        return None
    return _kernels().DoutDropout(dropout_key, reference.dropout_threshold(dropout_p), reference.dropout_scale(dropout_p))


def backward(grad_out: torch.Tensor, ids: torch.Tensor, position_ids: Optional[torch.Tensor], offset: int,
             num_embeddings: int, num_positions: int, scale: float, padding_idx: Optional[int],
             scale_grad_by_freq: bool, need_weight_grad: bool, need_pos_grad: bool,
             dropout_key: Optional[torch.Tensor] = None, dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense gradients (schema of reference.embedding_backward), without a host sync; with
    the forward's dropout key, of the output gradient through its mask.

    Eagerly, from a metadata's third call on, the launches replay a plan bound at its
    second (kernels.launch.LaunchPlan): the kernels Triton compiled for this metadata,
    launched with the call's tensors without the launch key over their ~20 arguments each;
    where the bound call was allocations and launches alone (every backward but those past
    the tile sort, which take torch's sort), the whole call is: its allocations made and
    its launches replayed, none of this module's or the kernels' Python run -- and that whole
    replay the node (pyembed::embedding with these kernels) keeps too and calls itself,
    without this function. The key holds everything the launches' other arguments, grids
    and constexprs follow from."""
    def run(launch):  # the tensors as they are when it runs (made contiguous below for a plan)
        return _backward(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                         scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key, dropout_p, launch=launch)

    if type(scale) is not float or type(offset) is not int:
        return run(_direct)
    key = (grad_out.shape, grad_out.dtype, grad_out.device, ids.shape, ids.dtype,
           None if position_ids is None else (position_ids.shape, position_ids.dtype), offset, num_embeddings,
           num_positions, scale, padding_idx, scale_grad_by_freq, need_weight_grad, need_pos_grad,
           None if dropout_key is None else float(dropout_p))
    # The tensors as the bound call had them (its own .contiguous() calls are no-ops then).
    grad_out, ids = grad_out.contiguous(), ids.contiguous()
    position_ids = None if position_ids is None else position_ids.contiguous()

    def keep(whole):  # the node (csrc/pyembed.cpp) keeps it too, and calls it without this function
        _C.set_backward_replay(grad_out, ids, position_ids, offset, num_embeddings, num_positions, scale,
                               padding_idx, scale_grad_by_freq, need_weight_grad, need_pos_grad, dropout_key,
                               dropout_p, whole)
    return _planned(_backward_plans, key, (grad_out, ids, position_ids, dropout_key), run,
                    keep=keep if hasattr(_C, "set_backward_replay") else None)


triton_backward = torch.library.custom_op("pyembed::triton_backward", mutates_args=())(backward)

if not _INTERPRETED:
    @triton_backward.register_torch_dispatch(FunctionalTensorMode)
    def _(mode, func, types, args, kwargs):
        # As the forward: under a compiled graph's functionalisation Inductor gets the
        # backward's kernels and the torch ops between them (sort, scan), not an opaque call.
        with mode:
            return _backward(*args, **kwargs, launch=_Traced(), device_guard=False)


def compiled_lookup(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
                    position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int,
                    padding_idx: Optional[int], scale_grad_by_freq: bool, validate: bool,
                    error_record: int) -> torch.Tensor:
    """The plain call as torch.compile traces it (schema of pyembed::embedding; the
    Backend's compiled_op, pyembed.functional._compiled_lookup): Dynamo records this one op,
    not the general route, whose functions and constants it would guard on every call.
    Functionalised, it is triton_forward (so Inductor gets the kernel); its autograd below
    is the general route's backward, triton_backward. The caller checked the arguments and,
    when validate asked for a check in the call, the ranges: validate is False here."""
    return forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, None, 0.0, 0, 0, error_record)


triton_lookup = torch.library.custom_op("pyembed::triton_lookup", mutates_args=())(compiled_lookup)
_ops.register_lookup_forms(triton_lookup, triton_forward)
_autograd.register_lookup_autograd(triton_lookup, "triton")


def sparse_backward(grad_out: torch.Tensor, ids: torch.Tensor, num_embeddings: int, scale: float,
                    padding_idx: Optional[int], scale_grad_by_freq: bool, dropout_key: Optional[torch.Tensor] = None,
                    dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The token table's sparse gradient (schema of reference.embedding_sparse_backward):
    one host sync, for the number of touched rows."""
    sums, _, _ = _used_row_sums(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq, dropout_key,
                                dropout_p, exact=True)
    with _on_device(grad_out):
        return sums(_direct)


triton_sparse_backward = torch.library.custom_op("pyembed::triton_sparse_backward", mutates_args=(),
                                                 tags=CUDAGRAPH_UNSAFE)(sparse_backward)


def touched_rows(grad_out: torch.Tensor, ids: torch.Tensor, num_embeddings: int, scale: float,
                 padding_idx: Optional[int], scale_grad_by_freq: bool, dropout_key: Optional[torch.Tensor] = None,
                 dropout_p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The sparse backward without its host sync (schema of
    torch.ops.pyembed.embedding_touched_rows): min(tokens, V) slots, unused ones row -1.
    Planned per metadata, as the dense backward (a step with an optimizer in the backward
    calls it every step)."""
    sums, inputs, key = _used_row_sums(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq,
                                       dropout_key, dropout_p, exact=False)
    with _on_device(grad_out):
        return _planned(_touched_plans, key, inputs, sums)


def _used_row_sums(grad_out, ids, num_embeddings, scale, padding_idx, scale_grad_by_freq, dropout_key, dropout_p,
                   exact: bool):
    """kernels.embedding.used_row_sums on the op's arguments -- (rows by slot, their sums) --
    as _planned takes it: (the call as a function of its launch, the tensors it reads, what
    else its launches follow from)."""
    dout2d = grad_out.contiguous().reshape(ids.numel(), grad_out.shape[-1])
    ids, skip, dropout = ids.contiguous(), -1 if padding_idx is None else padding_idx, _dout_dropout(dropout_key,
                                                                                                     dropout_p)

    def sums(launch):
        return _kernels().used_row_sums(dout2d, ids, num_embeddings, skip, scale, scale_grad_by_freq, exact=exact,
                                        dropout=dropout, launch=launch)
    key = (dout2d.shape, dout2d.dtype, dout2d.device, ids.shape, ids.dtype, num_embeddings, skip, float(scale),
           bool(scale_grad_by_freq), None if dropout is None else float(dropout_p))
    return sums, (dout2d, ids, dropout_key), key


def _update_key(param, state1, state2, rule: int, hyper) -> tuple:
    """What fixes an update's launches besides the tensors and float scalars a plan replaces
    (_update_plans): the table's shape, dtype and device, the rule, the states it holds and
    its flags (kernels.embedding._rule_args' constexprs: which of hyper's values are true;
    the others' truth splits a key needlessly, never wrongly)."""
    return (param.shape, param.dtype, param.device, rule, *map(bool, hyper), state1.numel() > 0, state2.numel() > 0)


def optimizer_update(param, state1, state2, rows, values, rule: int, hyper: list, all_rows: bool) -> None:
    """The optimizer inside the backward (schema of torch.ops.pyembed.optimizer_update),
    one Triton launch (two with a row map); only ever called eagerly (pyembed.optim runs
    outside compiled graphs). Planned per metadata, each step's scalars given anew."""
    key = ("rows", _update_key(param, state1, state2, rule, hyper), rows.shape, values.shape, values.dtype, all_rows)

    def update(launch):
        _kernels().optimizer_update(param, state1, state2, rows, values, rule, hyper, all_rows, launch=launch)
    with _on_device(param):
        _planned(_update_plans, key, (param, state1, state2, rows, values), update, floats=True)


def optimizer_backward(grad_out, ids, scale: float, padding_idx: Optional[int], scale_grad_by_freq: bool,
                       dropout_key: Optional[torch.Tensor], dropout_p: float, param, state1, state2, rule: int,
                       hyper: list, all_rows: bool) -> None:
    """A dense token table's backward as its optimizer's update (schema of
    torch.ops.pyembed.optimizer_backward, pyembed/optim.py's step_tables): the update by the
    gradient ``backward`` would give, that gradient never in memory. Up to FEW_TOKENS
    tokens, the touched rows' sums and optimizer_update (no sort: fewer launches there).
    Only ever called eagerly, as optimizer_update."""
    num_tokens, (num_rows, dim) = ids.numel(), param.shape
    if num_tokens <= _kernels().FEW_TOKENS:
        rows, values = touched_rows(grad_out, ids, num_rows, scale, padding_idx, scale_grad_by_freq, dropout_key,
                                    dropout_p)
        optimizer_update(param, state1, state2, rows, values, rule, hyper, all_rows)
        return
    dout2d, ids = grad_out.contiguous().reshape(num_tokens, dim), ids.contiguous()
    skip, dropout = -1 if padding_idx is None else padding_idx, _dout_dropout(dropout_key, dropout_p)

    def sort(launch):  # the sort and the chunks' pass: no per-step scalar among their arguments
        segments = _kernels().sorted_segments(dout2d, ids, num_rows, skip, by_row=True, launch=launch,
                                              dropout=dropout)
        return (segments.order, segments.bounds) + (() if segments.partials is None else (segments.partials,))

    # Planned as the dense backward's launches (at 8x2048 its Python was most of this op's
    # host time); the update's launch too, with the step's scalars.
    key = (dout2d.shape, dout2d.dtype, dout2d.device, ids.shape, ids.dtype, num_rows, skip,
           None if dropout is None else float(dropout_p))
    with _on_device(param):
        order, bounds, *partials = _planned(_segment_plans, key, (dout2d, ids, dropout_key), sort)
        segments = _kernels().Segments(order, bounds, num_rows, False, None, partials[0] if partials else None)

        def update(launch):
            _kernels().optimizer_backward(dout2d, segments, scale, scale_grad_by_freq, param, state1, state2, rule,
                                          hyper, all_rows, dropout=dropout, launch=launch)
        _planned(_update_plans, ("segments", key, bool(partials), bool(scale_grad_by_freq), all_rows,
                                 _update_key(param, state1, state2, rule, hyper)),
                 (dout2d, order, bounds, param, state1, state2), update, floats=True)


def position_update(grad_out, ids, offset: int, dropout_key: Optional[torch.Tensor], dropout_p: float, param, state1,
                    state2, rule: int, hyper: list) -> None:
    """The learned positions' backward (p = offset + t) as their optimizer's update
    (pyembed/optim.py's step_tables): one launch, no gradient in memory. Eagerly only;
    planned per metadata as optimizer_update."""
    seq_len = ids.shape[-1] if ids.dim() and ids.numel() else 0
    dout2d, dropout = grad_out.contiguous().reshape(ids.numel(), param.shape[1]), _dout_dropout(dropout_key, dropout_p)
    key = ("positions", dout2d.shape, dout2d.dtype, seq_len, offset, None if dropout is None else float(dropout_p),
           _update_key(param, state1, state2, rule, hyper))

    def update(launch):
        _kernels().position_update(dout2d, param, state1, state2, ids.numel() // max(seq_len, 1), seq_len, offset,
                                   rule, hyper, dropout=dropout, launch=launch)
    with _on_device(param):
        _planned(_update_plans, key, (dout2d, param, state1, state2, dropout_key), update, floats=True)


_ops.register_fakes("pyembed::triton_forward", "pyembed::triton_backward", "pyembed::triton_sparse_backward")


def _lookup_ops() -> dict:
    """The lookup ops of plain eager calls (pyembed.functional's first route, the Backend's
    autograd_op and fused_autograd_op): pyembed::embedding's call -- its argument checks and
    its C++ autograd node (csrc/autograd.cpp) -- with this module's forward, backward and
    sparse_backward as the node's kernels (csrc/pyembed.cpp, PythonKernels); the second on
    tables whose optimizer its backward runs. A Python autograd.Function and the checks in
    Python cost a one-token lookup with a gradient ~6 us more on the development VM
    (stand-in driver: ``python -m bench.triton_host``), its backward another layer of
    Python. None (the general route, a Python Function) without the compiled extension."""
    if _C is None or not hasattr(_C, "embedding_python_kernels"):
        return {}
    _C.set_python_kernels(node_forward, backward, sparse_backward, triton_backward, triton_sparse_backward)
    return dict(autograd_op=_C.embedding_python_kernels, fused_autograd_op=functools.partial(_C.embedding_fused, True))


dispatch.register_backend(dispatch.Backend(
    "triton", torch.ops.pyembed.triton_forward, torch.ops.pyembed.triton_backward,
    torch.ops.pyembed.triton_sparse_backward, _why_unavailable, **_lookup_ops(),
    compiled_op=torch.ops.pyembed.triton_lookup.default, checks_in_kernel=True, masks_as_it_reads=True,
    eager_forward=forward, eager_backward=backward, touched_rows=touched_rows, optimizer_update=optimizer_update,
    optimizer_backward=optimizer_backward, position_update=position_update,
    auto_rank={"cuda": 1}))  # after the cuda backend, where both are built
