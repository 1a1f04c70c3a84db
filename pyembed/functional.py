"""``fused_embedding``: the public op -- its checks (pyembed/checks.py), the backend
(pyembed/dispatch.py), and the route to autograd (pyembed/_autograd.py).

A plain eager call goes straight to its backend's lookup op: on a C++ backend
``pyembed::embedding``, which checks every argument itself, with the messages the Python
checks below use, and has a C++ autograd node (csrc/autograd.cpp); on ``triton`` the same
checks and node with Python kernels (pyembed._triton._lookup_ops); a table whose
optimizer runs in the backward the same, its node updating it there. Its bad-input errors
are raised as pyembed's exception types (checks.from_cpp), anything else as it is. Under
torch.compile the same call is checked here and traced as one lookup op
(``_compiled_lookup``). The general route below runs for every other call. Checks here
read only metadata (dtype, shape, device), so they cost nothing under ``torch.compile``;
the data-dependent ones (id range, negative or too-large position_ids) are one op shared
by every backend (pyembed.checks), skipped with ``validate=False``.
"""

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import _autograd, _coalesced, _dtensor, checks, dispatch, optim, reference


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
    validate: Union[bool, str] = True,
    dropout_p: float = 0.0,
    generator: Optional[torch.Generator] = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Token lookup, scaling, positional addition and dropout in one pass:
    ``out[b, t] = (W[ids[b, t]] * scale + PE(p(b, t))) * keep / (1 - dropout_p)``, computed in
    float32 and rounded once.

    Args:
        ids: (B, T) or (T,) int32/int64 token ids; any shape when there is no positional
            encoding (as ``nn.Embedding``). Or a jagged ``torch.nested`` tensor (B, j) of
            sequences of different lengths: a jagged (B, j, d) output over its offsets,
            positions counted from each sequence's start (``position_ids`` jagged too).
        weight: (V, d) float32/float16/bfloat16/float64 table. A table of another dtype
            (integer, complex, float8) is looked up as ``nn.Embedding`` does, without positions
            or scale; a tensor subclass of its own dispatch (torchao's quantized tables) through
            its own ``F.embedding``, the rest in torch ops (validate=True on a GPU: its checks).
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
        validate: check id / position ranges. True (default): on CPU tensors an
            IndexError (ValueError for a position) in the call; on CUDA tensors (cuda and
            triton backends) the check runs inside the forward kernel, so the host never
            waits for the device: the bad ids get zero rows and the error is raised by the
            next forward on that device (or ``pyembed.check_errors()``), the CUDA context
            intact; a compiled `triton` layer and a replayed CUDA graph leave it to the next
            eager forward or ``check_errors()`` (``wait=False``: no sync); a program saved to
            run elsewhere (torch.export, torch.jit.trace) checks in the call. "sync": the
            error in the call itself, everywhere (a device->host sync on a GPU). False: no
            check. Unchecked or deferred, an out-of-range id yields a zero row, never an
            out-of-bounds access.
        dropout_p: drop each output element with this probability (0: no dropout; apply
            it in training only). The mask is Philox4x32 keyed by a (seed, offset) drawn
            per call from ``generator`` or the device's default generator (so
            ``torch.manual_seed`` reproduces a call), the same on every backend, and
            regenerated by the backward: nothing (B, T, d)-sized is stored.
        generator: the ``torch.Generator`` the dropout key is drawn from.
        backend: "auto", "reference", "cpu", "cuda" or "triton" (DESIGN §2).

    Returns:
        ``ids.shape + (d,)`` tensor of ``weight.dtype``. Differentiable to any order, in
        forward mode too, and under ``torch.func`` transforms (``vmap``, ``grad``).
    """
    # Which tables have their optimizer in the backward (pyembed.optim); a plain flag read
    # when none do, so torch.compile guards on nothing more. An exported or traced program
    # holds no optimizer: torch.export and torch.jit.trace record the lookup as for any table
    # (strict export, which cannot break a graph, failed on the break that keeps such a call
    # out of compiled ones; the trace recorded the forward op without the range check).
    fused = (False, False)
    if optim.tables_are_fused and not _is_exporting() and not _is_tracing():
        fused = (optim.fused_optimizer(weight) is not None, optim.fused_optimizer(pos_weight) is not None)
    fused_table = fused[0] or fused[1]
    if (type(dropout_p) in (float, int) and type(offset) is int
            and (type(weight) in _PLAIN_TENSORS and type(ids) is torch.Tensor or _exported_fakes(weight, ids))
            and weight.dtype in checks.WEIGHT_DTYPES):
        # The common call -- plain tensors, a float table of the kernels (not float8), with or
        # without dropout (GPT-2's embedding dropout), a dense or sparse gradient, a table with
        # or without its optimizer in the backward.
        # (under make_fx or FakeTensorMode, checks.traced_or_fake, the general route: the length
        # of the dispatch modes' stack is asked first, a C call, ~0.05 us where none is active)
        if _autograd.autograd_may_be_cpp() and not (_dispatch_modes() and checks.traced_or_fake()):
            # Eager, no forward-mode AD, no torch.func transform: its backend's lookup op,
            # which checks its arguments and holds its autograd node (the C++ backends'
            # pyembed::embedding; triton's: the same, with Python kernels). Nothing else
            # runs before it: each layer of the general route below cost a one-token lookup
            # a few tenths of a microsecond (a one-token `cuda` lookup is ~10 us on a GPU host).
            device = weight.device
            try:
                fast = dispatch.resolve(backend, device)
            except (RuntimeError, ValueError):
                fast = None  # the general route raises it, after the argument checks
            lookup_op = None if fast is None else fast.fused_autograd_op if fused_table else fast.autograd_op
            if lookup_op is not None:
                if fused_table:
                    optim.check_call(weight, pos_weight, sparse)
                if pos_encoding is None or pos_encoding == "none":
                    pos_encoding = "learned" if pos_weight is not None else "none"
                sync_check, error_record = range_checks(validate, fast, device)
                if dropout_p:  # the op draws the key from generator, after its checks
                    checks.check_dropout_p(dropout_p)
                if sparse:
                    _coalesced.keep_flag(weight)  # .grad stays flagged coalesced (optimizers skip a re-sort)
                try:
                    return lookup_op(*(fused if fused_table else ()), ids, weight, pos_weight, position_ids,
                                     pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, sync_check,
                                     error_record, float(dropout_p), generator, bool(sparse))
                except (RuntimeError, TypeError, ValueError) as error:
                    if not _binding_refused(error):
                        raise checks.from_cpp(error) from None
                    # (an argument of a type the typed call cannot take -- pos_encoding=5, a list of
                    # position_ids --, refused before anything ran: the general route names it)
            if not fused_table and not sparse and generator is None and _is_tracing():
                # torch.jit.trace, a backend without such an op (the reference): what
                # torch.compile records -- the check op, then the lookup op whose autograd
                # the dispatcher holds -- so the trace keeps the range check and a saved trace
                # trains. The general route recorded its Function as a Python call (which
                # torch.jit.save cannot write, and whose trace differed from the check
                # trace's: TracingCheckError), or under no_grad the forward op alone (a
                # traced module without a backward), and ran its check eagerly, unrecorded.
                with warnings.catch_warnings():
                    # The tracer hands out sizes as tensors, and the metadata checks compare
                    # them (a TracerWarning each): the tables' sizes, constants of a traced
                    # module, and the ids' rank and length, whose positions the recorded
                    # check op checks in every call.
                    warnings.simplefilter("ignore", torch.jit.TracerWarning)
                    looked_up = _compiled_lookup(ids, weight, pos_weight, position_ids, pos_encoding, scale,
                                                 offset, padding_idx, scale_grad_by_freq, validate, backend,
                                                 dropout_p)
                if looked_up is not None:
                    return looked_up
        elif (not fused_table and not sparse and generator is None
              and (torch.compiler.is_compiling() and _autograd.no_transform() or _autograd.only_functionalize())):
            # (under torch.func.functionalize, which has no rule for an autograd.Function, the
            # lookup op, whose autograd the dispatcher holds, as for torch.jit.trace)
            looked_up = _compiled_lookup(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
                                         padding_idx, scale_grad_by_freq, validate, backend, dropout_p)
            if looked_up is not None:
                return looked_up
    if torch.compiler.is_compiling() and (fused_table or (sparse and _autograd.wants_gradient(weight, pos_weight)
                                                          and not _graph_may_hold_sparse_backward())):
        # Under torch.compile, a call whose backward the graph cannot hold: a graph break,
        # this call run again eagerly, where the route above applies as to any eager call
        # (once: Dynamo is off in there). A table whose optimizer runs in the backward
        # (pyembed.optim): AOTAutograd cannot mutate a parameter in a backward. A sparse
        # gradient where Dynamo allows no op whose output size depends on data (the rows
        # the ids touch): without the break AOTAutograd's trace of the backward failed, and
        # Dynamo gave up the function holding the call (the model's forward): its code ran
        # eagerly, only the submodules it called compiled, each alone.
        return optim.outside_compiled_graphs(
            fused_embedding, ids, weight, pos_weight, pos_encoding=pos_encoding, scale=scale,
            position_ids=position_ids, offset=offset, padding_idx=padding_idx,
            scale_grad_by_freq=scale_grad_by_freq, sparse=sparse, validate=validate, dropout_p=dropout_p,
            generator=generator, backend=backend)
    options = (pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, sparse, validate, dropout_p, generator,
               backend)
    if fused_table:
        # A table whose optimizer runs in the backward (pyembed.optim), on a call the route
        # above does not take (forward-mode AD, torch.func, the reference backend, tensor
        # subclasses): the Python Function, whose backward updates the tables.
        return _fused_embedding(ids, weight, pos_weight, position_ids, options, cpp_autograd=False)
    return _fused_embedding(ids, weight, pos_weight, position_ids, options)


def _binding_refused(error: Exception) -> bool:
    """Whether a typed C++ call refused its arguments' Python types (pybind11's message),
    before it ran: nothing was done, so the call may go the general route."""
    return isinstance(error, TypeError) and "incompatible function arguments" in str(error)


def _graph_may_hold_sparse_backward() -> bool:
    """Whether the graph torch.compile traces may hold a sparse gradient's backward, an op
    whose output size depends on data (the rows the ids touch): Dynamo allows such ops with
    ``fullgraph=True`` or ``torch._dynamo.config.capture_dynamic_output_shape_ops``, not by
    default; torch.export does. Dynamo calls it while tracing and keeps its answer as a
    constant of the graph; where it is False, what the graph break needs is made here."""
    context = torch._guards.TracingContext.try_get()
    shape_env = None if context is None or context.fake_mode is None else context.fake_mode.shape_env
    if context is None or (shape_env is not None and shape_env.allow_dynamic_output_shape_ops):
        return True
    optim.prepare_outside_compiled_graphs()
    return False


_graph_may_hold_sparse_backward._dynamo_marked_constant = True


def _fused_embedding(ids, weight, pos_weight, position_ids, options: tuple, cpp_autograd: bool = True):
    """fused_embedding's general route: its tensors, and its other arguments as given, in
    its order. cpp_autograd=False: never the C++ autograd node (a table with a fused
    optimizer needs the Python backward, where the update runs)."""
    pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, sparse, validate, dropout_p, generator, backend = \
        options
    checks.check_integer_tensor("ids", ids)  # first: a list or an array is not asked for .is_nested below
    if isinstance(weight, FakeTensor) and not checks.traced_or_fake():
        # Fake tensors out of their FakeTensorMode: an aten op enters the mode itself
        # (FakeTensor.__torch_dispatch__), so nn.Embedding's calls run on them; this call enters
        # it too, and then takes the mode's route (no value is read, the dropout key is fake).
        with weight.fake_mode:
            return _fused_embedding(ids, weight, pos_weight, position_ids, options, cpp_autograd)
    if ids.is_nested:
        return _jagged_lookup(ids, weight, pos_weight, position_ids, options, cpp_autograd)
    foreign = next((table for table in (weight, pos_weight) if checks.is_foreign_subclass(table)), None)
    if foreign is not None:
        if not cpp_autograd:  # the other table's fused optimizer (apply_optimizer_in_backward refuses these)
            raise checks.InputTypeError(
                "pyembed: a table with a fused optimizer (apply_optimizer_in_backward) cannot be looked up beside a "
                f"tensor subclass ({type(foreign).__name__}, e.g. a quantized table): that call runs through the "
                "subclass's own lookup, which has no fused update; keep the table on a torch optimizer")
        return _foreign_table_lookup(ids, weight, pos_weight, position_ids, options)
    if isinstance(weight, torch.Tensor) and weight.dtype not in checks.WEIGHT_DTYPES:
        return _plain_lookup(ids, weight, pos_weight, pos_encoding, scale, position_ids, padding_idx,
                             scale_grad_by_freq, sparse, validate)
    pos_encoding, position_ids = checks.check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset)
    if type(dropout_p) is not float or dropout_p != 0.0:  # the default needs no check
        checks.check_dropout_p(dropout_p)
    if padding_idx is not None:
        padding_idx = checks.normalize_padding_idx(padding_idx, weight.shape[0])
    if not cpp_autograd:
        optim.check_call(weight, pos_weight, sparse)
    chosen = dispatch.resolve(backend, weight.device)
    if checks.is_dtensor(weight):  # a table sharded by torch.distributed (parallelize_module)
        # Checked in the call (every rank sees the same global ids): the shards' kernels
        # hold local ids, which are out of range by design on all but one rank.
        config = _autograd.FusedConfig(pos_encoding, float(scale), offset, padding_idx, bool(scale_grad_by_freq),
                                       bool(sparse), range_checks(validate, chosen, torch.device("cpu"))[0],
                                       chosen.name, float(dropout_p))
        return _dtensor.fused_embedding(ids, weight, pos_weight, position_ids, config, generator)
    if sparse:
        _coalesced.keep_flag(weight)  # .grad stays flagged coalesced (optimizers skip a re-sort)
    sync_check, error_record = range_checks(validate, chosen, weight.device)
    dropout_key = None
    if dropout_p > 0:
        if sync_check:  # checked before the key is drawn: a refused call leaves the generator as it was
            ids = _autograd.checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)
            sync_check = False
        dropout_key = reference.draw_dropout_key(weight.device, generator)
    config = _autograd.FusedConfig(pos_encoding, float(scale), offset, padding_idx, bool(scale_grad_by_freq),
                                   bool(sparse), sync_check, chosen.name, float(dropout_p), error_record)
    return _autograd.apply_fused(ids, weight, pos_weight, position_ids, dropout_key, config, cpp_autograd=cpp_autograd)


def _foreign_table_lookup(ids, weight, pos_weight, position_ids, options: tuple) -> torch.Tensor:
    """The lookup of a table checks.is_foreign_subclass names, as nn.Embedding's: the subclass's own
    embedding (F.embedding: its padding_idx, scale_grad_by_freq and sparse gradients), then
    the scale, the positional term and dropout (the fused backends' Philox mask) in torch
    ops, in float32, rounded once into the table's dtype. Ranges are checked in the call on
    the CPU ("sync": everywhere); validate=True on a GPU leaves them to the subclass's lookup
    (a device-side assert, as nn.Embedding's): pyembed's in-kernel check has no kernel here.
    validate=False: the contract's zero rows (reference.embedding_forward), never the subclass's
    error or assert -- an out-of-range id's row, positional term included, and an
    out-of-range learned position's term are zeros."""
    pos_encoding, scale, offset, padding_idx, scale_grad_by_freq, sparse, validate, dropout_p, generator, _ = options
    pos_encoding, position_ids = checks.check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset)
    if dropout_p:
        checks.check_dropout_p(dropout_p)
    if padding_idx is not None:
        padding_idx = checks.normalize_padding_idx(padding_idx, weight.shape[0])
    # (validate read as for the reference backend, which has no in-kernel check, but for True
    # on a GPU: the subclass's lookup checks there)
    if not (validate is True and _device_type(weight.device) in checks.KERNEL_CHECKED_DEVICES) \
            and range_checks(validate, dispatch.get("reference"), weight.device)[0]:
        ids = _autograd.checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)
    acc = reference.compute_dtype(weight.dtype)
    unchecked = validate is False
    if unchecked:
        # An out-of-range id reads a row that exists -- the padding row, whose gradient is
        # zero, else row 0 -- and its output row is zeroed below. (Row 0 then counts it for
        # scale_grad_by_freq: a difference only where such a table takes gradients, which
        # quantized ones do not.)
        id_ok = (ids >= 0) & (ids < weight.shape[0])
        ids = torch.where(id_ok, ids, 0 if padding_idx is None else padding_idx)
    out = torch.nn.functional.embedding(ids, weight, padding_idx, None, 2.0, scale_grad_by_freq, sparse).to(acc)
    if scale != 1.0:
        out = out * scale
    if pos_encoding != "none":
        positions = reference.token_positions(ids, position_ids, offset)
        if pos_encoding == "learned":
            if unchecked:
                position_ok = (positions >= 0) & (positions < pos_weight.shape[0])
                positions = torch.where(position_ok, positions, 0)
            term = torch.nn.functional.embedding(positions, pos_weight).to(acc)  # (its backward sums in float32)
            if unchecked:
                term = torch.where(position_ok[:, None], term, 0)
        else:
            term = reference.sinusoid(positions, weight.shape[1]).to(acc)
        out = out + term.reshape(out.shape)
    if unchecked:
        out = torch.where(id_ok[..., None], out, 0)
    if dropout_p:
        keep = reference.dropout_keep(reference.draw_dropout_key(weight.device, generator), ids.numel(),
                                      weight.shape[1], dropout_p)
        out = torch.where(keep.reshape(out.shape), out * reference.dropout_scale(dropout_p), 0)
    return out.to(weight.dtype)


def _jagged_lookup(ids, weight, pos_weight, position_ids, options: tuple, cpp_autograd: bool):
    """ids a jagged NestedTensor ``(B, j)`` (sequences of different lengths packed end to end,
    ``torch.nested.nested_tensor(..., layout=torch.jagged)``): the lookup of its packed
    values, as a ``(B, j, d)`` jagged tensor over the same offsets -- what nn.Embedding gives
    it. A positional encoding counts each sequence's tokens from its start (plus offset), no
    padding to the longest sequence; position_ids, if given, has the ids' structure. The
    positions come from the offsets on the device (a search, no host sync)."""
    pos_encoding, offset = options[0], options[2]
    tokens, offsets = _jagged_values(ids), ids.offsets()
    if position_ids is not None:
        if not (position_ids.is_nested and position_ids.layout == torch.jagged
                and position_ids.shape == ids.shape):
            raise checks.InputValueError(
                f"pyembed: position_ids must be a jagged tensor of the ids' structure {tuple(ids.shape)}, got "
                f"{type(position_ids).__name__} of shape {tuple(position_ids.shape)}")
        position_ids = position_ids.values()
    elif pos_weight is not None or pos_encoding not in (None, "none"):
        token = torch.arange(tokens.shape[0], device=tokens.device)
        sequence_start = offsets[torch.searchsorted(offsets, token, right=True) - 1]
        position_ids = token - sequence_start + offset
    options = (*options[:2], 0, *options[3:])  # (the offset is in the positions now)
    looked_up = _fused_embedding(tokens, weight, pos_weight, position_ids, options, cpp_autograd)
    return torch.nested.nested_tensor_from_jagged(looked_up, offsets=offsets)


def _jagged_values(ids: torch.Tensor) -> torch.Tensor:
    """The packed ids of a nested ``ids``, which must be a contiguous jagged ``(B, j)`` tensor,
    as nn.Embedding takes them (a jagged tensor with holes -- ``lengths`` -- packs ids that
    belong to no sequence)."""
    if ids.layout != torch.jagged or ids.dim() != 2 or ids._lengths is not None:
        holes = " with holes (lengths)" if ids.layout == torch.jagged and ids._lengths is not None else ""
        raise checks.InputValueError(
            f"pyembed: nested ids must be a contiguous jagged tensor (B, j), as nn.Embedding takes them; got "
            f"{ids.layout} of shape {tuple(ids.shape)}{holes}")
    return ids.values()


def _compiled_lookup(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                     scale_grad_by_freq, validate, backend, dropout_p=0.0) -> Optional[torch.Tensor]:
    """The common call as torch.compile traces it, on a backend with a lookup op for it
    (``compiled_op``: the C++ backends' pyembed::embedding, triton's pyembed::triton_lookup),
    else None (the general route). The checks of metadata run here (once, when Dynamo
    traces them; the op checks nothing on fake tensors), the ranges in the call by the
    check_ranges op when validate asks for that, then the op, whose autograd (C++ for
    pyembed::embedding) AOTAutograd splits into the graphs' forward and backward ops --
    the ones the general route's autograd.Function gives. What differs is
    what Dynamo traces, and so guards on every call: a few functions, not that route and
    its Function's forward and backward. A compiled one-token `validate=False` forward (the
    graph a `cuda` call makes) on the development VM: 135 guards in ~9 us through that
    route, 87 in ~5.5 us here; compiled nn ops: 28 in ~2 us (python -m bench.compiled_host).
    With dropout (no generator) on a backend whose op takes it (``compiled_dropout``: the
    C++ backends', which draw the key as a random op of the graph); triton's does not."""
    pos_encoding, position_ids = checks.check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset)
    if padding_idx is not None:
        padding_idx = checks.normalize_padding_idx(padding_idx, weight.shape[0])
    chosen = dispatch.resolve(backend, weight.device)
    if chosen.compiled_op is None or (dropout_p and not chosen.compiled_dropout):
        return None
    if offset != 0 or (pos_encoding == "learned" and position_ids is None and _is_tracing()):
        # A decoder's offset, new every step: from its second value on Dynamo traces it as a
        # symbolic int, which pyembed::embedding's int argument would make a constant again
        # (a compile per step, every call eager past the recompile limit). As position_ids it
        # stays symbolic: one graph for every step after the first. Under torch.jit.trace the
        # learned positions are given too, so that the check op checks them in every call
        # (check_inputs compared the traced example's length with the table's).
        if pos_encoding != "none":
            position_ids = (torch.arange(ids.shape[-1], device=ids.device) + offset).expand(ids.shape)
        offset = 0
    if dropout_p:
        checks.check_dropout_p(dropout_p)
    sync_check, error_record = range_checks(validate, chosen, weight.device)
    if sync_check:
        ids = _autograd.checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)
    dropout = (float(dropout_p),) if dropout_p else ()  # the op draws the key (a random op), after the checks
    return chosen.compiled_op(ids, weight, pos_weight, position_ids, pos_encoding, float(scale), offset, padding_idx,
                              bool(scale_grad_by_freq), False, error_record, *dropout)


_PLAIN_TENSORS = frozenset((torch.Tensor, torch.nn.Parameter))  # a set: fewer guards (pyembed.checks.ID_DTYPES)


def _exported_fakes(weight, ids) -> bool:
    """Non-strict torch.export runs the model on FakeTensors, plain tensors to the program:
    they take the common call's op too, whose autograd the exported program keeps (the
    general route's Function is inlined there, its forward op recorded without a backward:
    a program trained through it gave its tables no gradient)."""
    if not _is_exporting():
        return False
    return type(weight) is FakeTensor and type(ids) is FakeTensor


_dispatch_modes = torch._C._len_torch_dispatch_stack
# Bound once: an eager GPU call asks both (two attribute lookups each cost it ~0.1 us).
_is_tracing = torch.jit.is_tracing


def _exporting_flag() -> bool:
    """torch.compiler.is_exporting(), right under torch.compile too: Dynamo before torch 2.13
    folded that call to True in every compiled graph (pytorch/pytorch#176347), so on torch
    2.12 and older (the GPU machine's 2.11) each compiled call took the synchronous range check
    -- a device->host sync: 10.3 ms a compiled GPT-2 forward on an H200 with the GPU busy,
    against 70 us -- and ignored a table's fused optimizer. The flag that call returns is
    set by torch.export alone, and Dynamo reads it as the constant it is while tracing."""
    return torch.compiler._is_exporting_flag


# The flag is a private name: a torch without it is one with the fix.
_is_exporting = _exporting_flag if hasattr(torch.compiler, "_is_exporting_flag") else torch.compiler.is_exporting
_DEVICE_TYPES: dict = {}  # torch.device -> its type: device.type builds a new str on every read (~0.2 us)


def _device_type(device: torch.device) -> str:
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        kind = _DEVICE_TYPES[device] = device.type
    return kind


_device_type._dynamo_marked_constant = True  # Dynamo calls it once while tracing (checks.error_record_address)


def range_checks(validate, backend: dispatch.Backend, device: torch.device) -> tuple[bool, int]:
    """(check the ranges synchronously, the error record the forward kernel checks into
    (0: none)) for ``validate`` on ``device``: True checks inside the kernel where the
    backend can and the device runs asynchronously (a GPU: no host sync), else in the call.
    A program saved to run in another process (torch.export, and through it AOTInductor;
    torch.jit.trace) checks in the call: the record is this process's pinned memory, and its
    address, a constant of such a program, would be a stray pointer for a kernel elsewhere."""
    if validate is True:
        if (backend.checks_in_kernel and _device_type(device) in checks.KERNEL_CHECKED_DEVICES
                and not _is_exporting() and not _is_tracing()):
            return False, checks.error_record_address(device)
        return True, 0
    if validate is False or validate == "sync":
        return validate == "sync", 0
    raise checks.InputValueError(f"pyembed: validate must be True, False or 'sync', got {validate!r}")


def _plain_lookup(ids, weight, pos_weight, pos_encoding, scale, position_ids, padding_idx, scale_grad_by_freq,
                  sparse, validate):
    """A table of a dtype the kernels do not take -- integer (``from_pretrained`` of ints),
    complex, float8 -- is looked up as ``nn.Embedding`` looks it up, by torch's op, its
    gradient too where torch gives one (none of these: nothing to fuse); positions and
    scaling are the kernels' part, for float32/float16/bfloat16/float64 tables."""
    if pos_weight is not None or pos_encoding not in (None, "none") or position_ids is not None or scale != 1.0:
        raise checks.InputTypeError(
            f"pyembed: a {weight.dtype} table takes no positional encoding or scale, only a plain lookup "
            "as nn.Embedding's (the fused op takes float32/float16/bfloat16/float64 tables)")
    if weight.dim() != 2:
        raise checks.InputValueError(f"pyembed: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")
    if validate:  # in place eagerly; under torch.compile the check op (as embedding_renorm_)
        ids = checks.checked_ids(ids, weight.shape[0], None, None)
    # The aten op, not F.embedding: a program that routes F.embedding to pyembed (test
    # harnesses, profilers patching it) would otherwise recurse here forever.
    padding_idx = checks.normalize_padding_idx(padding_idx, weight.shape[0])
    return torch.embedding(weight, ids, -1 if padding_idx is None else padding_idx, scale_grad_by_freq, sparse)


def embedding_renorm_(weight: torch.Tensor, ids: torch.Tensor, max_norm: float, norm_type: float,
                      backend: str = "auto") -> None:
    """``nn.Embedding``'s ``max_norm``: rescale, in place and without grad, the looked-up
    rows whose ``norm_type``-norm exceeds ``max_norm`` (as ``torch.embedding_renorm_``).
    torch's renorm indexes the table with the ids unchecked, so they are checked first: in
    place eagerly, by the check_ranges op under torch.compile (reading the ids' values while
    Dynamo traced failed the compile: a data-dependent guard) -- except an eager call on a
    GPU whose lookup checks inside its kernel (``backend``'s, validate=True): there the check
    would be a device->host sync per call, which torch's CUDA renorm does not make, so the
    rows are renormalised without reading the ids back (_renorm_in_range) and the lookup's
    kernel reports a bad id, as for any call."""
    if ids.is_nested:  # (nn.Embedding's max_norm does not take nested ids)
        ids = _jagged_values(ids)
    checks.check_integer_tensor("ids", ids)
    table = weight.detach()  # as F.embedding: no autograd, no forward-AD tangent
    if (type(table) is torch.Tensor and not torch.compiler.is_compiling()
            and not range_checks(True, dispatch.resolve(backend, weight.device), weight.device)[0]):
        with torch.no_grad():
            _renorm_in_range(table, ids, max_norm, norm_type)
        return
    ids = checks.checked_ids(ids, weight.shape[0], None, None)
    with torch.no_grad():
        torch.embedding_renorm_(table, ids.contiguous(), max_norm, norm_type)


def _renorm_in_range(table: torch.Tensor, ids: torch.Tensor, max_norm: float, norm_type: float) -> None:
    """torch.embedding_renorm_'s math (its CUDA kernel's: the norm and the factor in float32
    for float32 and narrower tables) without a host read: an id out of range is replaced by
    an id in range from the same call, so its slot writes what that id's slots write (if no
    id is in range, the first, clamped, is rewritten with its own rows: scale 1). Duplicates
    all write the same row, so the write's order does not matter."""
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return
    in_range = (flat >= 0) & (flat < table.shape[0])
    first = in_range.to(torch.uint8).argmax().reshape(1)  # of the ids in range (0 if none is), on the device
    rows_ids = torch.where(in_range, flat, flat.gather(0, first)).clamp(0, table.shape[0] - 1)
    acc = torch.float64 if table.dtype == torch.float64 else torch.float32
    rows = table.index_select(0, rows_ids).to(acc)
    norms = torch.linalg.vector_norm(rows, ord=norm_type, dim=1)
    renorm = (norms > max_norm) & in_range.gather(0, first)  # (none: the clamped rows keep their values)
    factor = torch.where(renorm, max_norm / (norms + 1e-7), 1.0)
    table.index_put_((rows_ids,), (rows * factor[:, None]).to(table.dtype))
