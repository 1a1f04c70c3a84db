"""Launching pyembed's Triton kernels with less host time per launch.

``kernel[grid](*args, **constexprs)`` goes through ``JITFunction.run``, which binds every
argument and re-derives its specialisation on every launch, hashes a cache key from them
and builds launch metadata for the (usually empty) profiler hooks: 6.9 us of host time
for the forward's 25 parameters, 3.0 us for a one-pointer kernel, on the development VM
with Triton's real JIT and a stand-in driver. A one-token lookup on a GPU pays it once
per kernel, five times for a forward and backward.

``cached(kernel)[grid](...)`` takes the same call. It keys each launch by what Triton's
specialisation depends on -- the constexprs, each tensor's dtype and 16-byte alignment,
each int's "== 1", "% 16 == 0" and 32/64-bit range, the device and the JIT's options --
and launches the ``CompiledKernel`` that Triton returned for that key with the compiled
kernel's own launcher, as Triton's run does (3.6 us for the forward) -- given each tensor's
address, not the tensor, as every launch here is (so the launcher neither calls data_ptr()
nor asks the driver about each pointer; Inductor's static launcher does the same), and by
the launcher's C call where ``direct_launch`` has seen which one it makes (its Python, ~2.5
us, skipped as Inductor's static launcher skips it). A key not seen yet
(the first launch, a new shape class, another device) goes through ``JITFunction.run``,
which compiles or finds the kernel and launches it; its result is remembered.
tests/test_triton_launch.py checks that it launches the binary and arguments Triton's
run would, for arguments that differ in each property Triton specialises on.

``bind(kernel, grid, args, constexprs, tensors=..., ints=...)`` goes one step further for a
caller that launches one kernel with the same metadata call after call: it launches once
and returns a function that launches the same compiled kernel again with new values for
the named tensors and ints, checking only what could make Triton choose another binary
(their alignment and specialisation, the device and options, the hooks). The eager
`triton` forward keeps one per metadata (pyembed/_triton.py): 0.4 us per launch instead of
4.2 us through ``cached``. ``LaunchPlan`` binds a helper's launches in order and replays
them, every tensor argument new: the dense backward's one to four, and where the helper
ran nothing but allocations, views and those launches, the whole call at once.

A launch may give Triton's compile options (``num_warps``, ``maxnreg``, ...: ``LAUNCH_OPTIONS``)
beside its constexprs, as ``kernel[grid]`` takes them: they key the launch with the
constexprs and are left out of what the compiled kernel's launcher is given.

Under the interpreter (TRITON_INTERPRET=1) and on Triton releases before 3.3 (whose
launcher took other arguments), ``cached`` returns the kernel itself and ``bind`` binds
nothing. A callable grid, kernels with pre-run hooks, a stage-inspection hook set, or
keywords out of the signature's order always take Triton's run; profiler launch hooks are
called as Triton calls them.
"""

from __future__ import annotations

import copy
import functools
import operator
import types
import weakref

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode
from triton.runtime.jit import JITFunction

try:  # the JIT's global options (Triton >= 3.3): part of every key
    from triton import knobs
except ImportError:  # pragma: no cover - older Triton: every launch takes Triton's run
    knobs = None

_INT32_MIN, _INT32_END = -(2**31), 2**31

# Triton's compile options a launch may give as keywords beside the constexprs
# (``kernel[grid](..., maxnreg=80)``): part of the key -- another value, another binary --
# and never an argument of the compiled kernel's launcher, which has them built in.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg"})


def _launcher_constexprs(constexprs: dict):
    """The constexprs' values as the compiled kernel's launcher takes them: the launch
    options left out."""
    if LAUNCH_OPTIONS.isdisjoint(constexprs):
        return constexprs.values()
    return [value for name, value in constexprs.items() if name not in LAUNCH_OPTIONS]


def _supported() -> bool:
    """Triton >= 3.3 (its launcher takes every parameter, constexprs included), with the
    global options this key reads (checked, not assumed, for releases between)."""
    if knobs is None:
        return False
    major, minor = (int(part) for part in triton.__version__.split(".")[:2])
    runtime = knobs.runtime
    return ((major, minor) >= (3, 3) and hasattr(knobs.compilation, "instrumentation_mode")
            and all(hasattr(runtime, name) for name in ("debug", "add_stages_inspection_hook", "launch_enter_hook",
                                                         "launch_exit_hook")))


def int_class(value: int):
    """What Triton specialises an int argument on: == 1, % 16 == 0, 32/64-bit (the entry
    ``_launch_key`` makes for it)."""
    if value == 1:
        return "one"
    if _INT32_MIN <= value < _INT32_END:
        return value & 15 == 0
    return (value & 15 == 0, "i64" if -(2**63) <= value < 2**63 else "u64")


# A launch through a compiled kernel's launcher (``compiled.run``, Triton's CudaLauncher)
# runs its Python first -- the kernel's scratch memory (none for pyembed's kernels), the
# arguments of one call of its C launch, ~2.5 us a launch on the development VM (3.8's,
# its C launch stubbed) -- which the C call then takes apart again. Replays make that C
# call themselves, as Inductor's static launcher does, with what the launcher was seen to
# pass it: the launcher is called once, on a copy with its C launch replaced by a recorder,
# with stand-in objects for the grid, stream, function, metadata, hooks and arguments; the
# C call's other arguments must be values of the launcher's own (flags, the argument
# annotations), and those objects must reach it as given. Any other launcher -- scratch
# memory to allocate, more or fewer C calls, another release's form -- is called as it is.
# id(compiled) -> (compiled, direct_launch's result, the kernel's launch without hooks for
# CachedLauncher.launch): by id, the entry holding compiled (so the id stays its own).
_launch_paths: dict = {}


def direct_launch(compiled):
    """(C launch, layout) of ``compiled``'s launcher, or None: ``layout`` holds, per
    argument of the C call, ("in", k) for the k-th of the launcher's own first nine
    arguments (grid x, y, z, stream, function, packed metadata, launch metadata, enter
    hook, exit hook), ("args",) for the kernel's arguments as one tuple (Triton 3.8's
    launcher), ("spread",) for them one by one, last (3.6's), or ("fixed", value)."""
    return _launch_path(compiled)[1]


def _launch_path(compiled) -> tuple:
    """``compiled``'s entry of _launch_paths, made on its first launch here: the C call
    its launcher makes, and ``run(compiled, grid_x, grid_y, grid_z, stream, arguments)``,
    which makes it -- or, where none is known, calls the launcher."""
    found = _launch_paths.get(id(compiled))
    if found is None:
        direct = _c_call_layout(compiled.run)
        c_call, namespace = _c_call_code(direct) if direct is not None else (None, {})
        source = (f"def run(COMPILED, grid_x, grid_y, grid_z, stream, arguments):\n"
                  f"    {_launch_call(c_call, None)}\n")
        exec(compile(source, "<pyembed.kernels.launch.cached>", "exec"), namespace)
        found = _launch_paths[id(compiled)] = (compiled, direct, namespace["run"])
    return found


def _c_call_layout(run):
    launch = getattr(run, "launch", None)
    if not callable(launch):
        return None
    seen = []
    given, arguments = [_Given() for _ in range(9)], tuple(_Given() for _ in range(3))
    try:
        probe = copy.copy(run)
        probe.launch = lambda *args, **kwargs: seen.append((args, kwargs))
        probe(*given, *arguments)
    except Exception:  # e.g. scratch memory sized by the grid: launched by the launcher
        return None
    if len(seen) != 1 or seen[0][1]:
        return None
    layout, values = [], list(seen[0][0])
    if len(values) >= len(arguments) and all(map(operator.is_, values[-len(arguments):], arguments)):
        del values[-len(arguments):]  # the kernel's arguments one by one, last
        spread = [("spread",)]
    else:
        spread = []
    for value in values:
        if any(value is g for g in given):
            layout.append(("in", next(k for k, g in enumerate(given) if value is g)))
        elif type(value) is tuple and len(value) == len(arguments) and all(map(operator.is_, value, arguments)):
            layout.append(("args",))
        elif isinstance(value, _Given) or (isinstance(value, (tuple, list)) and any(isinstance(v, _Given)
                                                                                    for v in value)):
            return None  # an argument passed otherwise than as given
        else:
            layout.append(("fixed", value))
    layout += spread
    if (sum(entry[0] in ("args", "spread") for entry in layout) != 1
            or sorted(k for kind, *k in layout if kind == "in") != [[k] for k in range(9)]):
        return None
    return launch, tuple(layout)


def _c_call_code(direct) -> tuple:
    """(the layout of direct_launch's C call without its fixed values -- a key for the code
    that makes it --, the globals that code reads: C_LAUNCH, and F<i> for fixed value i)."""
    launch, layout = direct
    namespace = {f"F{i}": entry[1] for i, entry in enumerate(layout) if entry[0] == "fixed"}
    namespace["C_LAUNCH"] = launch
    return tuple(entry if entry[0] != "fixed" else ("fixed",) for entry in layout), namespace


class _Given:
    """A stand-in argument of the launcher's probe call (compared by identity)."""


def device_getter(driver):
    """``driver.get_current_device``, or where that is ``torch.cuda.current_device`` (Triton's
    CUDA driver under torch), the C function it ends in, ``torch._C._cuda_getDevice``, which
    initialises CUDA itself if need be: the Python function's own lazy-init check first
    made it ~2.0 us a call on the H200's host, the C function ~0.6 (profile.log at 26f0ba6:
    seven calls in a `triton` 8x2048 forward + backward, 14.6 us)."""
    get = driver.get_current_device
    return torch._C._cuda_getDevice if get is torch.cuda.current_device else get


def _jit_context(device) -> tuple:
    """What of the JIT's state a compiled kernel was chosen under: the device and the
    global options that are part of Triton's key."""
    return device, knobs.runtime.debug, knobs.compilation.instrumentation_mode


def _launch_key(context: tuple, args: tuple, constexprs: dict):
    """One flat tuple of what Triton specialises a launch on (None: an argument of a type
    whose specialisation is not known here): ``context`` (the device and the JIT's global
    options); the constexprs' names, values and types (True == 1 in a tuple, not as a
    constexpr); for an int argument, == 1 (then a constant), divisible by 16, and 32-bit,
    64-bit or unsigned; for a tensor, its dtype and whether its address is 16-byte
    aligned; for a float, a bool or None, its type. Flat, because it is built and hashed
    on every launch."""
    key = [*context, *constexprs, *constexprs.values(), *map(type, constexprs.values())]
    append = key.append
    for arg in args:
        kind = type(arg)
        if kind is int:
            append(int_class(arg))
        elif kind is torch.Tensor or kind is torch.nn.Parameter:
            append(arg.dtype)
            append(arg.data_ptr() & 15 == 0)
        elif kind is float or kind is bool or arg is None:
            append(kind)
        else:
            return None
    return tuple(key)


_KEYED_TYPES = {int: "int", torch.Tensor: "tensor", torch.nn.Parameter: "tensor", float: "plain", bool: "plain",
                type(None): "plain"}


def _key_function(args: tuple):
    """``_launch_key`` unrolled for arguments of the types ``args`` has (None where one has
    a type the key does not know): a function, written once per kernel as Triton writes its
    binder, that returns (the same key, the arguments with each tensor's address in its
    place) for arguments of those types -- ints in 32 bits -- and (None, None) for any
    others (the caller then takes ``_launch_key``). Its loop, with a type test per argument,
    was 2.6 us of a 6.4 us one-token forward launch; unrolled, ~2 us. The addresses: Triton's
    launcher takes an int pointer as it is, where for a tensor it calls data_ptr() and asks
    the driver to check the address (cuPointerGetAttribute) on every launch; the key reads
    each address anyway (its alignment). Tensors on different devices (a CPU tensor beside
    CUDA ones) are declined, so that Triton's launcher refuses the stray pointer as before."""
    guards, items, launched, addresses = [], [], [], []
    for i, arg in enumerate(args):
        kind, name = _KEYED_TYPES.get(type(arg)), f"a{i}"
        if kind == "int":
            guards.append(f"type({name}) is int and {_INT32_MIN} <= {name} < {_INT32_END}")
            items.append(f"'one' if {name} == 1 else {name} & 15 == 0")
        elif kind == "tensor":
            guards.append(f"(type({name}) is Tensor or type({name}) is Parameter)")
            addresses.append(f"    p{i} = {name}.data_ptr()\n")
            items += [f"{name}.dtype", f"p{i} & 15 == 0"]
            name = f"p{i}"
        elif kind == "plain":
            guards.append(f"type({name}) is {type(arg).__name__}")
            items.append(type(arg).__name__)
        else:
            return None
        launched.append(name)
    tensors = [f"a{i}" for i, arg in enumerate(args) if _KEYED_TYPES.get(type(arg)) == "tensor"]
    if len(tensors) > 1:  # a tensor on another device: Triton's own launch, which checks each pointer
        guards.append(" == ".join(f"{t}.get_device()" for t in tensors))
    names = "".join(f"a{i}, " for i in range(len(args)))
    source = (f"def key(context, args, constexprs):\n"
              f"    if len(args) != {len(args)}:\n"
              f"        return None, None\n"
              f"    ({names}) = args\n"
              f"    if not ({' and '.join(guards) or 'True'}):\n"
              f"        return None, None\n"
              + "".join(addresses) +
              f"    return ((*context, *constexprs, *constexprs.values(), *map(type, constexprs.values()), "
              f"{''.join(item + ', ' for item in items)}), ({''.join(name + ', ' for name in launched)}))\n")
    namespace = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter, "NoneType": type(None)}
    exec(source, namespace)
    return namespace["key"]


def _keyed_by_loop(context: tuple, args: tuple, constexprs: dict):
    """(``_launch_key``, the arguments as given): for a kernel whose first launch had
    arguments ``_key_function`` does not unroll."""
    return _launch_key(context, args, constexprs), args


class CachedLauncher:
    """``cached(kernel)``: the kernel's launches, each specialisation found by a dict lookup."""

    def __init__(self, kernel: JITFunction):
        self.kernel = kernel
        self.names = tuple(kernel.arg_names)
        self.compiled = {}  # launch key -> CompiledKernel
        self.key_of = None  # _key_function of the first launch's arguments (else _keyed_by_loop)

    def __getitem__(self, grid):
        return lambda *args, **constexprs: self.launch(grid, args, constexprs)

    def launch(self, grid, args: tuple, constexprs: dict):
        driver = triton.runtime.driver.active
        device = device_getter(driver)()
        runtime = knobs.runtime
        # A grid given as a tuple, and no hook that Triton's run calls before compiling or
        # launching; else Triton's own path (a callable grid is evaluated there).
        plain = self._plain(grid)
        context = _jit_context(device)
        if self.key_of is None:
            self.key_of = _key_function(args) or _keyed_by_loop
        key, launched = self.key_of(context, args, constexprs)
        if key is None and self.key_of is not _keyed_by_loop:  # other argument types than the first launch's
            key, launched = _launch_key(context, args, constexprs), args
        compiled = self.compiled.get(key) if plain else None
        if compiled is None:
            compiled = self.kernel[grid](*args, **constexprs)  # compiles a new specialisation, launches
            if plain and compiled is not None and key is not None and self._in_signature_order(args, constexprs):
                self.compiled[key] = compiled
        elif not _launch_hooks(runtime):
            # What compiled[grid](...) does when no profiler hooks in (None or an empty
            # HookChain), without its closure, launch metadata and calls of empty hooks --
            # and, where direct_launch knows the launcher's C call, without its Python.
            run = _launch_path(compiled)[2]
            run(compiled, grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                driver.get_current_stream(device), (*launched, *_launcher_constexprs(constexprs)))
        else:
            compiled[tuple(grid) + (1,) * (3 - len(grid))](*args, *_launcher_constexprs(constexprs))
        return compiled

    def _plain(self, grid) -> bool:
        return (type(grid) is tuple and not getattr(self.kernel, "pre_run_hooks", None)
                and knobs.runtime.add_stages_inspection_hook is None)

    def _in_signature_order(self, args: tuple, constexprs: dict) -> bool:
        """Every parameter given, keywords in the signature's order (launch options aside):
        the compiled kernel's launcher takes them positionally."""
        given = tuple(name for name in constexprs if name not in LAUNCH_OPTIONS)
        return self.names == self.names[:len(args)] + given


def _launch_hooks(runtime) -> bool:
    """A profiler hooks into launches (a hook set, or a non-empty HookChain)."""
    return bool(getattr(runtime.launch_enter_hook, "calls", runtime.launch_enter_hook)
                or getattr(runtime.launch_exit_hook, "calls", runtime.launch_exit_hook))


def bind(kernel, grid: tuple, args: tuple, constexprs: dict, tensors: tuple = (), ints: tuple = (),
         floats: tuple = ()):
    """Launch ``kernel[grid](*args, **constexprs)`` through ``cached`` and return
    ``replay(*tensors, *ints, *floats) -> bool``, which launches the same again with new values
    for the parameters named in ``tensors`` (each a name, or a tuple of names that take the
    same tensor), ``ints`` and ``floats``, the grid, constexprs and every other argument fixed: the
    ``CompiledKernel`` Triton chose for this launch, run directly. A caller that launches
    one kernel for the same metadata call after call (a one-token lookup) skips the launch
    key and the argument list: ~0.5 us on the development VM with the stand-in driver,
    where ``cached(kernel)`` takes 4.2 us for the forward's 25 arguments.

    ``replay`` returns False, launching nothing, wherever Triton could choose another binary
    than the bound one: a tensor not 16-byte aligned (the bound ones were), an int of another
    specialisation (== 1, % 16), anything but a float for a float, another device or JIT
    option; and where a profiler's launch
    hook or a stage-inspection hook is set (``cached`` calls those). The tensors' dtypes and
    the fixed arguments are the caller's to keep: it binds a launch per key that determines
    them. None where the launch cannot be bound (the interpreter, a launch that took
    Triton's own path, a bound tensor not 16-byte aligned, an int past 32 bits): it was
    launched all the same."""
    launcher = cached(kernel)
    if not isinstance(launcher, CachedLauncher):
        launcher[grid](*args, **constexprs)
        return None
    names = launcher.names
    tensor_positions = [(names.index(name),) if isinstance(name, str) else tuple(map(names.index, name))
                        for name in tensors]
    return _bind(launcher, grid, args, constexprs, tensor_positions, [names.index(name) for name in ints],
                 tuple(names.index(name) for name in floats))


def _bind(launcher: CachedLauncher, grid: tuple, args: tuple, constexprs: dict, tensor_positions: list,
          int_positions: list, float_positions: tuple = ()):
    """``bind`` by argument positions: a tuple of positions per tensor, a position per int,
    and per float (``LaunchPlan(floats=True)``'s: a float is not specialised on, only its type)."""
    driver = triton.runtime.driver.active
    current_device = device_getter(driver)
    context = _jit_context(current_device())
    compiled = launcher.launch(grid, args, constexprs)
    if (compiled is None or not launcher._plain(grid) or _launch_hooks(knobs.runtime)
            or not launcher._in_signature_order(args, constexprs)
            or any(args[p].data_ptr() & 15 for group in tensor_positions for p in group)
            or any(not (type(args[p]) is int and _INT32_MIN <= args[p] < _INT32_END) for p in int_positions)
            or any(type(args[p]) is not float for p in float_positions)):
        return None
    # The replay written out for these arguments, as Triton writes its binder: the fixed
    # values are its globals, the new ones its parameters. One code object per layout of
    # the arguments (compiling it is ~150 us), a function of it per bound launch (~us).
    fixed = (*args, *_launcher_constexprs(constexprs))
    direct = direct_launch(compiled)
    c_call, c_globals = _c_call_code(direct) if direct is not None else (None, {})
    layout = (tuple(tensor_positions), tuple(int_positions), len(fixed), c_call, (), tuple(float_positions))
    code = _replay_code(*layout)
    # Not the bound call's tensors: a plan must not keep a table (or its output) alive.
    replaced = {p for group in tensor_positions for p in group} | set(int_positions) | set(float_positions)
    namespace = {f"A{p}": value for p, value in enumerate(fixed) if p not in replaced}
    namespace.update(knobs=knobs, triton=triton, launch_hooks=_launch_hooks, jit_context=_jit_context,
                     int_class=int_class, DRIVER=driver, CURRENT_DEVICE=current_device, CONTEXT=context,
                     CLASSES=tuple(int_class(args[p]) for p in int_positions), COMPILED=compiled,
                     GRID=tuple(grid) + (1,) * (3 - len(grid)), **c_globals)  # c_globals: direct_launch's C call
    replay = types.FunctionType(code, namespace, "replay")
    replay.layout = layout  # (_unchecked_launch writes a variant of it)
    return replay


class _LaunchSeam:
    """A ``launch=`` of kernels/embedding.py's helpers (``launch(kernel)[grid](*args,
    **constexprs)``): calling it with the kernel keeps the kernel, for ``[grid]``'s launch."""

    kernel = None

    def __call__(self, kernel):
        self.kernel = kernel
        return self


class Binding(_LaunchSeam):
    """A ``launch=`` for a helper that launches one kernel (kernels/embedding.py's take one):
    launches it through ``bind`` with these ``tensors`` and ``ints`` and keeps the replay in
    ``replay`` (None: nothing launched, or nothing could be bound)."""

    def __init__(self, tensors: tuple = (), ints: tuple = ()):
        self.tensors, self.ints, self.replay = tensors, ints, None

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.replay = bind(self.kernel, grid, args, constexprs, self.tensors, self.ints)
        return launch


class LaunchPlan:
    """The launches a helper makes for one metadata, in order, bound once and replayed after:
    for a helper that launches several kernels call after call (the `triton` dense backward's
    one to four), whose launch arguments other than tensors -- sizes, grids, constexprs --
    the metadata fixes.

    ``binding()`` is a ``launch=`` that launches each kernel through ``bind`` with every
    tensor argument replaced and keeps the replays; ``complete`` says whether every launch
    could be bound. ``replaying()`` is a ``launch=`` whose k-th launch is the k-th replay
    with that launch's tensors (and floats, for ``LaunchPlan(floats=True)``: a step's
    scalars): the launch key and Triton's argument handling skipped
    (~4 -> ~1 us a launch on the development VM, stand-in driver). A launch the plan cannot
    replay -- another kernel than bound, a replay that refuses (a tensor not 16-byte
    aligned, another device, a hook) -- goes through ``cached``. The caller keys its plans
    by everything that fixes those other arguments; the plan holds none of the tensors.

    Replayed whole (bound by ``bind_call``, then ``replay_whole``): where the bound
    call ran no torch op but allocations and views, and every tensor its launches took was
    one of its inputs or a whole allocation, the call is its allocations and replays alone:
    not the helper's Python either (the `triton` one-token backward op ~13 -> ~6 us, the
    8x2048 one ~32 -> ~15 us on the development VM, stand-in driver), and what each replay
    checks before its launch checked once for all. Not with ``floats``: the floats are no
    inputs of the call."""

    def __init__(self, floats: bool = False):
        # (kernel, the positions of the arguments replaced -- tensors, then floats --, replay
        # or None, the bound tensors' (address, starts its storage), the allocations
        # bind_call had recorded before the launch)
        self.launches = []
        self.floats = floats
        self.whole = None  # the call replayed whole: a function of its inputs, or None
        self._recorded = None  # while bind_call runs: its _RecordedOps

    @property
    def complete(self) -> bool:
        return bool(self.launches) and all(replay is not None for _, _, replay, _, _ in self.launches)

    def binding(self):
        return _PlanBinder(self)

    def replaying(self):
        return _PlanReplayer(self.launches)

    def bind_call(self, call, inputs: tuple):
        """``call(launch)`` with this plan's ``binding()`` as its launch, the torch ops it
        runs recorded, and planned whole where it can be (``whole``); returns its result, a
        tuple of tensors. ``inputs``: the tensors it was given (None allowed), the same
        ``replay_whole`` gets."""
        self._recorded = _RecordedOps()
        try:
            with self._recorded:
                result = call(self.binding())
            whole = self.complete and not self.floats  # (a float is no input of the whole call)
            self.whole = _whole_call(self.launches, self._recorded, inputs, result) if whole else None
        finally:
            self._recorded = None
        return result

    def replay_whole(self, inputs: tuple):
        """The bound call again on new ``inputs`` (as ``bind_call`` had them: same metadata,
        contiguous, the caller's key says so): its allocations made and its launches replayed;
        None, launching nothing, where it was not planned whole or its checks refuse (an
        input not 16-byte aligned or on another device, another JIT state, a hook)."""
        return None if self.whole is None else self.whole(*inputs)


class _RecordedOps(TorchDispatchMode):
    """What a call's torch ops were: its allocations in order (a weak reference to each --
    holding the tensor itself would make the dispatcher hand an outer mode a detach of it
    -- and its address, shape, dtype, device, contiguity, read as it is made: a temporary
    may be freed before the call ends), and whether it ran any other op than an allocation
    or a view (a sort, a fill, a copy: a whole replay would skip it)."""

    ALLOCATING = frozenset((torch.ops.aten.empty.memory_format, torch.ops.aten.new_empty.default,
                            torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
                            torch.ops.aten.new_empty_strided.default))

    def __init__(self):
        super().__init__()
        self.allocated, self.computed = [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in self.ALLOCATING:
            self.allocated.append((weakref.ref(out), out.data_ptr(), tuple(out.shape), out.dtype, out.device,
                                   out.is_contiguous()))
        elif not func.is_view:
            self.computed = True
        return out


WORKSPACE_ALIGNMENT = 256  # bytes between a whole replay's temporaries, as torch's allocators align blocks


def _same_tensor(made: torch.Tensor | None, t: torch.Tensor) -> bool:
    """``t`` is the allocation ``made`` (None: freed): the same object, or the same memory
    seen the same way (storage, offset, shape, strides, dtype) -- what _RecordedOps gets
    under another TorchDispatchMode that holds the tensors its ops make: another tensor
    object over the caller's memory (a debugging mode, the launch tests' _KeepAlive)."""
    if made is None:
        return False
    return made is t or (made.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() != 0
                         and (made.storage_offset(), made.shape, made.stride(), made.dtype)
                         == (t.storage_offset(), t.shape, t.stride(), t.dtype))


def _whole_call(launches: list, ops: _RecordedOps, inputs: tuple, outputs: tuple):
    """LaunchPlan.whole for a bound call, or None: where it ran another op than
    allocations and views, or a launch took a tensor that is neither an input nor the
    latest allocation at its address (a view at an offset), or an input shares the address
    (empty tensors). Written out as bind's replays are: a function of the inputs that makes
    the allocations (on the first input's device), checks once what each launch's replay
    checks, and launches each with its tensors and the stream.

    The allocations it returns are made as the call made them; the others, temporaries
    that only its launches see (a sort's keys and order, segment bounds, partial sums), are
    one workspace, each at its offset, passed to the launches as addresses: one allocation
    where there were up to five (each an op through Python, ~1-2 us of host time on the
    development VM, more on a GPU's host)."""
    template = inputs[0]
    if ops.computed or any(not contiguous or device != template.device
                           for *_, device, contiguous in ops.allocated):
        return None
    input_names = {t.data_ptr(): f"i{k}" for k, t in enumerate(inputs) if t is not None}
    if len(input_names) != sum(t is not None for t in inputs):
        return None
    returned = [next((j for j, (ref, *_) in enumerate(ops.allocated) if _same_tensor(ref(), t)), None)
                for t in outputs]
    if None in returned:
        return None
    offsets, size = {}, 0  # a temporary's byte offset in the workspace
    for k, (_, _, shape, dtype, *_) in enumerate(ops.allocated):
        if k not in returned:
            offsets[k] = size
            numel = 1
            for extent in shape:
                numel *= extent
            size += -(-numel * dtype.itemsize // WORKSPACE_ALIGNMENT) * WORKSPACE_ALIGNMENT
    # The JIT's state each launch was bound under: one for all (bound in one call), checked once.
    bound = {name: launches[0][2].__globals__[name] for name in ("DRIVER", "CURRENT_DEVICE", "CONTEXT")}
    if any(replay.__globals__[name] != value for _, _, replay, _, _ in launches for name, value in bound.items()):
        return None
    namespace = {"DTYPES": tuple(dtype for _, _, _, dtype, *_ in ops.allocated), "torch": torch, "triton": triton,
                 "knobs": knobs, "jit_context": _jit_context, "launch_hooks": _launch_hooks, **bound}
    tensors = list(input_names.values())
    # What each launch's replay checks, checked once here, before any launch: the inputs'
    # alignment and device (the allocations are aligned, as torch's allocators align every
    # block, and on the first input's device), the JIT's state (_READY); the launches then
    # take their tensors' addresses and the stream alone. A misaligned input would make a
    # later launch refuse after earlier ones ran; an input on another device would reach a
    # launch as an address.
    lines = [f"def replay_whole({', '.join(f'i{k}' for k in range(len(inputs)))}):",
             f"    if ({' | '.join(f'{name}.data_ptr()' for name in tensors)}) & 15:",
             "        return None"]
    if len(tensors) > 1:
        lines += [f"    if not ({' == '.join(f'{name}.get_device()' for name in tensors)}):", "        return None"]
    lines.append(_READY.format(refused="None").rstrip("\n"))
    if offsets:
        lines += [f"    workspace = i0.new_empty({size}, dtype=torch.uint8)", "    base = workspace.data_ptr()"]
    for k, (_, _, shape, dtype, *_) in enumerate(ops.allocated):
        if k in offsets:
            lines.append(f"    a{k} = base + {offsets[k]}")
        else:
            sizes = "".join(f"{extent}, " for extent in shape)
            lines.append(f"    a{k} = i0.new_empty({sizes}{'' if dtype == template.dtype else f'dtype=DTYPES[{k}]'})")
    for k, (_, _, replay, addresses, made) in enumerate(launches):
        names, given = [], []
        for j, (address, starts_storage) in enumerate(addresses):
            latest = next((a for a in range(made - 1, -1, -1) if ops.allocated[a][1] == address), None)
            if not starts_storage:
                latest = None  # an input's view (by its address), or nothing this can replay
            if (latest is None) == (address not in input_names):  # neither, or both
                return None
            names.append(input_names[address] if latest is None else f"a{latest}")
            if latest in offsets:
                given.append(j)
        namespace[f"L{k}"] = _unchecked_launch(replay, tuple(given))
        lines.append(f"    L{k}({', '.join(['stream'] + names)})")
    lines.append(f"    return ({''.join(f'a{j}, ' for j in returned)})")
    exec("\n".join(lines), namespace)
    return namespace["replay_whole"]


def _unchecked_launch(replay, given: tuple):
    """``replay``'s launch (a bound launch's) without its checks, ``launch(stream,
    *tensors)``, taking the tensors at ``given`` (indices among its tensors) as addresses:
    the same globals, the code written for those."""
    tensors, ints, count, c_call, _, floats = replay.layout
    code = _replay_code(tensors, ints, count, c_call, given, floats, checked=False)
    return types.FunctionType(code, replay.__globals__, "launch")


class _PlanBinder(_LaunchSeam):
    def __init__(self, plan: LaunchPlan):
        self.plan = plan

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            launcher, launches = cached(self.kernel), self.plan.launches
            if not isinstance(launcher, CachedLauncher):
                launcher[grid](*args, **constexprs)
                launches.append((self.kernel, (), None, (), 0))
                return
            positions = tuple(p for p, arg in enumerate(args) if isinstance(arg, torch.Tensor))
            floats = tuple(p for p, arg in enumerate(args) if type(arg) is float) if self.plan.floats else ()
            replay = _bind(launcher, grid, args, constexprs, [(p,) for p in positions], [], floats)
            recorded = self.plan._recorded
            # Each tensor's address and whether it starts its storage (a view inside an
            # allocation could share the address of one freed before: never taken for it).
            launches.append((self.kernel, positions + floats, replay,
                             tuple((args[p].data_ptr(), args[p].storage_offset() == 0) for p in positions),
                             0 if recorded is None else len(recorded.allocated)))
        return launch


class _PlanReplayer(_LaunchSeam):
    def __init__(self, launches: list):
        self.launches, self.next = launches, 0

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            k = self.next
            self.next = k + 1
            if k < len(self.launches):
                kernel, positions, replay, _, _ = self.launches[k]
                if kernel is self.kernel and replay(*[args[p] for p in positions]):
                    return
            cached(self.kernel)[grid](*args, **constexprs)
        return launch


# What a replay checks of the JIT's state before it launches, and its stream: the driver it
# was bound under, the current device's context and options as bound, no hook that Triton's
# run would call. A whole replay checks it once for all its launches.
_READY = ("    driver, runtime = triton.runtime.driver.active, knobs.runtime\n"
          "    if driver is not DRIVER:\n"
          "        return {refused}\n"
          "    device = CURRENT_DEVICE()\n"
          "    if (jit_context(device) != CONTEXT or runtime.add_stages_inspection_hook is not None\n"
          "            or launch_hooks(runtime)):\n"
          "        return {refused}\n"
          "    stream = driver.get_current_stream(device)\n")


@functools.lru_cache(maxsize=None)
def _replay_code(tensor_positions: tuple, int_positions: tuple, count: int, c_call: tuple = None, given: tuple = (),
                 float_positions: tuple = (), checked: bool = True):
    """The code of bind's replay for tensors at ``tensor_positions`` (a group per tensor),
    ints at ``int_positions`` and floats at ``float_positions`` (its parameters in that
    order), of ``count`` launcher arguments, launched by the launcher's C call of layout
    ``c_call`` (direct_launch's, its fixed values F0, F1, ... by position) or, None, by the
    launcher; the tensors whose indices are in ``given`` are passed as addresses (a whole
    replay's workspace: the caller checked its device). Unchecked, the launch alone,
    ``launch(stream, *tensors)``: a whole replay's, which checked its inputs and the JIT's
    state (_READY) once for all its launches."""
    values = {p: f"p{j}" for j, group in enumerate(tensor_positions) for p in group}
    values.update({p: f"i{j}" for j, p in enumerate(int_positions)})
    values.update({p: f"f{j}" for j, p in enumerate(float_positions)})
    tensors = [f"t{j}" for j in range(len(tensor_positions))]
    ints = [f"i{j}" for j in range(len(int_positions))]
    floats = [f"f{j}" for j in range(len(float_positions))]
    devices = [f"t{j}.get_device()" for j in range(len(tensors)) if j not in given]
    # The tensors' addresses, not the tensors: Triton's launcher takes an int pointer as it
    # is, where for a tensor it calls data_ptr() and asks the driver to check the address
    # (cuPointerGetAttribute) on every launch -- as Inductor's static launcher passes them.
    # That check refused a CPU tensor beside CUDA ones; here a tensor on another device
    # than the others refuses the replay (the caller's launch then takes Triton's path).
    addresses = "".join(f"    p{j} = t{j}{'' if j in given else '.data_ptr()'}\n" for j in range(len(tensors)))
    launch = f"    {_launch_call(c_call, [values.get(p, f'A{p}') for p in range(count)])}\n"
    if not checked:
        assert not ints and not floats, "a whole replay's launches take tensors alone"
        source = f"def launch({', '.join(['stream'] + tensors)}):\n" + addresses + launch
    else:
        source = (
            f"def replay({', '.join(tensors + ints + floats)}):\n" + addresses +
            f"    if ({' | '.join(f'p{j}' for j in range(len(tensors))) or '0'}) & 15:\n"
            f"        return False\n"
            f"    if not ({' == '.join(devices) if len(devices) > 1 else 'True'}):\n"
            f"        return False\n"
            f"    if ({''.join(f'int_class({i}), ' for i in ints)}) != CLASSES:\n"
            f"        return False\n"
            # an int where a float was bound would be another specialisation (int_class)
            + (f"    if not ({' and '.join(f'type({f}) is float' for f in floats)}):\n"
               f"        return False\n" if floats else "")
            + _READY.format(refused="False") + launch + "    return True\n")
    module = compile(source, "<pyembed.kernels.launch.bind>", "exec")
    return next(c for c in module.co_consts if isinstance(c, types.CodeType))


def _launch_call(c_call, arguments) -> str:
    """A launch statement: through the launcher, or its C call (``c_call``), given the
    kernel's ``arguments`` as names and the grid as GRID (a replay's) or, None, as the tuple
    ``arguments`` with the grid as grid_x, grid_y, grid_z (_launch_path's); the stream as
    ``stream``."""
    grid_and_stream = (["GRID[0]", "GRID[1]", "GRID[2]"] if arguments is not None
                       else ["grid_x", "grid_y", "grid_z"]) + ["stream"]
    launcher_arguments = grid_and_stream + ["COMPILED.function", "COMPILED.packed_metadata", "None", "None", "None"]
    packed = f"({''.join(a + ', ' for a in arguments)})" if arguments is not None else "arguments"
    if c_call is None:
        given = arguments if arguments is not None else ["*arguments"]
        return f"COMPILED.run({', '.join(launcher_arguments + given)})"
    spread = ", ".join(arguments) if arguments is not None else "*arguments"
    parts = [launcher_arguments[entry[1]] if entry[0] == "in" else packed if entry[0] == "args"
             else spread if entry[0] == "spread" else f"F{i}" for i, entry in enumerate(c_call)]
    return f"C_LAUNCH({', '.join(part for part in parts if part)})"


# id(kernel) -> its launcher, which holds the kernel (so the id stays its own). By id:
# hashing a JITFunction hashes its source's cache key, ~1 us per launch.
_launchers: dict = {}


def cached(kernel):
    """The launcher of ``kernel`` (the kernel itself where launches cannot be cached)."""
    launcher = _launchers.get(id(kernel))
    if launcher is None:
        launcher = CachedLauncher(kernel) if isinstance(kernel, JITFunction) and _supported() else kernel
        _launchers[id(kernel)] = launcher
    return launcher
