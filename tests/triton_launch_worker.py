"""Run by tests/test_triton_launch.py in a subprocess (TRITON_INTERPRET unset: the real
JIT). Triton compiles for sm_90 with ptxas as on a GPU, but the driver is a stand-in
(bench/stand_in_driver.py): loading a binary names it by its bytes' hash, and the
launcher records what it is given (grid, stream, binary, arguments) instead of calling
cuLaunchKernel. Each check prints one JSON line; the test asserts on them.

What is checked: ``kernels.launch.cached`` launches exactly what Triton's own
``kernel[grid](...)`` launches -- the same binary with the same arguments, grid and
stream -- for arguments that differ in each property Triton specialises on, in every
order; a profiler's launch hook sees its launches as it sees Triton's; pyembed's
eager forward + backward reach the kernels through it; and the eager forward's and
backward's plans (``kernels.launch.bind``, ``LaunchPlan``) launch what Triton would,
replayed or not -- also in random interleavings of the entry points that plan them.
"""

import contextlib
import gc
import itertools
import json
import os
import pathlib
import sys
import weakref

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))
import stand_in_driver  # noqa: E402  (standalone: an installed copy's venv runs this file too)

stand_in_driver.install()
launches = stand_in_driver.launches

from pyembed.kernels import embedding as k  # noqa: E402  (after the driver is set)
from pyembed.kernels import launch  # noqa: E402


def _same(a, b) -> bool:
    """Launch ``a`` agrees with ``b`` (Triton's run): grid, stream, binary, and each argument
    -- where ``b`` has a tensor, ``a`` that tensor or its address (pyembed's launches pass
    addresses, launch._key_function)."""
    def same(x, y):
        if isinstance(y, torch.Tensor):
            return x is y or (type(x) is int and x == y.data_ptr())
        return (type(x), x) == (type(y), y)
    return a[:3] == b[:3] and len(a[3]) == len(b[3]) and all(map(same, a[3], b[3]))


def _what_triton_launches(kernel, grid, args, constexprs):
    launches.clear()
    kernel[grid](*args, **constexprs)
    return launches.pop()


def _what_cached_launches(kernel, grid, args, constexprs):
    launches.clear()
    launch.cached(kernel)[grid](*args, **constexprs)
    return launches.pop()


def forward_variants():
    """(grid, args, constexprs) of _embedding_forward_kernel, one varying property each."""
    ids = torch.zeros(64, dtype=torch.long)
    weight, out = torch.zeros(100, 768), torch.zeros(80 * 768)
    pos = torch.zeros(300, 768)

    def call(ids=ids, weight=weight, pos=pos, out=out, num_tokens=64, seq_len=32, dim=768, offset=0, record=0,
             scale=2.0, f64=False):
        args = (ids, weight, pos, ids, ids, out, num_tokens, seq_len, weight.shape[0], pos.shape[0], dim, offset,
                scale, -0.01, 0, 0, 1.0, *k.error_record_parts(record))
        constexprs = dict(POS_MODE=1, HAS_POSITION_IDS=False, HAS_DROPOUT=False, COMPUTE_F64=f64,
                          CHECK_RANGES=record != 0, WIDE_SLOTS=False, BLOCK_T=4, BLOCK_D=512)
        return (16, 2), args, constexprs

    return {
        "plain": call(),
        "int32 ids": call(ids=ids.int()),
        "misaligned table": call(weight=torch.zeros(100 * 768 + 1)[1:].view(100, 768)),  # 4-byte offset
        "table offset by 16 bytes": call(weight=torch.zeros(100 * 768 + 4)[4:].view(100, 768)),
        "misaligned output": call(out=torch.zeros(80 * 768 + 2)[2:]),
        "one token": call(num_tokens=1, seq_len=1),
        "d=100": call(dim=100),
        "d=16": call(dim=16),
        "offset 16": call(offset=16),
        "offset 17": call(offset=17),
        "offset 2^31": call(offset=2**31),
        "offset 2^31 + 1": call(offset=2**31 + 1),
        "error record": call(record=2**40),
        "error record 2^40 + 8": call(record=2**40 + 8),
        "error record 2^31 (high part 1)": call(record=2**31),
        "integer scale": call(scale=2),
        "fp64 compute": call(f64=True),
    }


def check_forward_variants():
    variants = forward_variants()
    kernel = k._embedding_forward_kernel
    expected = {name: _what_triton_launches(kernel, *v) for name, v in variants.items()}
    binaries = {name: e[2] for name, e in expected.items()}
    # Every variant after every other: a key too coarse would launch the first one's binary.
    mismatches, with_tensors = [], []
    for first, second in itertools.permutations(variants, 2):
        launch._launchers.clear()
        _what_cached_launches(kernel, *variants[first])
        for attempt in range(2):
            got = _what_cached_launches(kernel, *variants[second])
            if not _same(got, expected[second]):
                mismatches.append((first, second, attempt))
            if attempt and any(isinstance(a, torch.Tensor) for a in got[3]):
                with_tensors.append((first, second))  # a hit passes addresses
    hits = len(launch.cached(kernel).compiled)
    # The key unrolled for one launch's argument types (launch._key_function) is the loop's
    # key for arguments of those types, and declines (None) every other variant's.
    context = ("device", False, "")
    unrolled = {}
    for first, (_, args, constexprs) in variants.items():
        key_of = launch._key_function(args)
        for second, (_, other_args, other_constexprs) in variants.items():
            key, launched = key_of(context, other_args, other_constexprs)
            if key is not None and any(a.data_ptr() != b if isinstance(a, torch.Tensor) else a is not b
                                       for a, b in zip(other_args, launched)):
                key = "wrong arguments"  # each tensor's address in its place, every other argument itself
            unrolled.setdefault("declined" if key is None else "agree" if key == launch._launch_key(
                context, other_args, other_constexprs) else "differ", set()).add((first, second))
    print(json.dumps({"check": "forward variants", "mismatches": mismatches, "with_tensors": with_tensors,
                      "binaries": len(set(binaries.values())),
                      "variants": len(variants), "cached": hits,
                      "unrolled": {name: sorted(pairs) for name, pairs in unrolled.items()}}))


def check_eager_calls():
    """fused_embedding forward + dense backward, twice: the second time every launch is a
    cache hit and launches what the first launched. 600 tokens: two tiles of the tile sort,
    so its merge too, whose launch gives a compile option (maxnreg) beside its constexprs."""
    import pyembed
    from pyembed import _triton

    _triton._INTERPRETED = True  # lets the backend take CPU tensors; the kernels still go through the JIT
    launch._launchers.clear()
    ids = torch.randint(0, 500, (2, 300), generator=torch.Generator().manual_seed(0))
    weight, pos = torch.randn(500, 64, requires_grad=True), torch.randn(300, 64, requires_grad=True)
    jit_runs = []
    run = triton.runtime.jit.JITFunction.run

    def counted_run(self, *args, **kwargs):
        jit_runs[-1] += 1
        return run(self, *args, **kwargs)

    triton.runtime.jit.JITFunction.run = counted_run
    recorded = []
    for _ in range(2):
        launches.clear()
        jit_runs.append(0)
        out = pyembed.fused_embedding(ids, weight, pos, scale=8.0, validate=False, backend="triton")
        out.backward(torch.ones_like(out))
        recorded.append([(grid, stream, function) for grid, stream, function, _ in launches])
    names = sorted(c.kernel.fn.__name__ for c in launch._launchers.values())
    print(json.dumps({"check": "eager calls", "first": recorded[0], "second": recorded[1], "kernels": names,
                      "jit_runs": jit_runs}))


def _address(x):
    """A pointer argument as the memory it names: a replay (launch.bind) passes a tensor's
    address, an int, where Triton's run passes the tensor."""
    return x.data_ptr() if isinstance(x, torch.Tensor) else x


def _same_kind(a, b) -> bool:
    """Launch ``a`` agrees with ``b`` (Triton's run) up to which tensor objects they got:
    grid, stream, binary, each tensor's dtype, size and alignment -- for an address in
    ``a`` (a replay's), its alignment -- every other argument's type and value."""
    def same(x, y):
        if isinstance(y, torch.Tensor):
            if isinstance(x, torch.Tensor):
                return (x.dtype, x.numel(), x.data_ptr() & 15) == (y.dtype, y.numel(), y.data_ptr() & 15)
            return type(x) is int and x & 15 == y.data_ptr() & 15
        return (type(x), x) == (type(y), y)
    return a[:3] == b[:3] and len(a[3]) == len(b[3]) and all(map(same, a[3], b[3]))


class _KeepAlive(TorchDispatchMode):
    """Holds every tensor the ops under it make until it is dropped: launches given
    addresses (not tensors) keep no temporary alive, so a call's later allocation may take
    a freed one's address -- safe in stream order, but a wiring that Triton's run, whose
    recorded launches hold their tensors, never shows."""

    def __init__(self):
        super().__init__()
        self.made, self.allocations = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.made.append(out)
        self.allocations += func in launch._RecordedOps.ALLOCATING
        return out


def _wiring(recorded: list, like: list = None) -> list:
    """Which pointer arguments of a call's launches are the same memory: for each, in order,
    the index of the first argument at its address (a replay that hands a launch another
    launch's buffer, or a fresh one where it should share, differs from Triton's run). The
    pointers are the arguments that are tensors in ``like`` (Triton's run of the same call;
    by default ``recorded`` itself)."""
    first, wiring = {}, []
    for (*_, arguments), (*_, reference) in zip(recorded, like or recorded):
        for a, r in zip(arguments, reference):
            if isinstance(r, torch.Tensor):
                wiring.append(first.setdefault(_address(a), len(first)))
    return wiring


def _launched_as_triton(got: list, tritons: list) -> bool:
    """A call's launches ``got`` agree with ``tritons``, Triton's own run of the same call:
    as many, in order, each of the same kind (_same_kind), their pointers wired alike (_wiring)."""
    return len(got) == len(tritons) and all(map(_same_kind, got, tritons)) and _wiring(got, tritons) == _wiring(tritons)


def _count_cached_launches() -> list:
    """From now on, each launch through the cached launcher adds one to the list's last entry
    (a call that adds none launched only replays)."""
    counts = []
    launch_method = launch.CachedLauncher.launch

    def counted(self, *args):
        counts[-1] += 1
        return launch_method(self, *args)

    launch.CachedLauncher.launch = counted
    return counts


@contextlib.contextmanager
def _profiler_hook(on: bool):
    """A profiler's launch hook (one that does nothing) set while the block runs, where ``on``."""
    from triton import knobs

    hook = lambda metadata: None  # noqa: E731
    if on:
        knobs.runtime.launch_enter_hook.add(hook)
    try:
        yield
    finally:
        if on:
            knobs.runtime.launch_enter_hook.remove(hook)


def check_planned_forward(through_node: bool = False):
    """pyembed/_triton.py's forward plans (kernels.launch.bind): a call after a call of the
    same metadata replays the bound kernel, and every call -- replayed or declined to
    ``cached`` (an offset of another specialisation, a misaligned or non-contiguous tensor,
    a profiler hook) -- launches what Triton's own run launches for it, with the call's own
    tensors, position ids (as Hugging Face models pass them) and dropout key among them.
    ``through_node``: each call is a lookup's, pyembed::embedding's node
    with Python kernels (csrc/pyembed.cpp), which replays the plans node_forward gave it
    (set_forward_replay) itself: ``replayed`` then lists the calls that launched without
    node_forward and without the cached launcher."""
    from pyembed import _C, _triton, checks, reference

    _triton._INTERPRETED = True
    _triton.clear_plans(backward=False)
    through_cached = _count_cached_launches()
    node_calls = []
    if through_node:
        def counted_node_forward(*args):
            node_calls[-1] += 1
            return _triton.node_forward(*args)
        _C.set_python_kernels(counted_node_forward, _triton.backward, _triton.sparse_backward)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 100, (2, 16), generator=gen)
    weight, pos = torch.randn(100, 64, generator=gen), torch.randn(40, 64, generator=gen)
    # The node reads an error record before it launches: a real one (its slots stay zero).
    record = checks.error_record_address(torch.device("cpu")) if through_node else 2**40
    position_ids = torch.randint(0, 40, (2, 16), generator=gen)
    base = dict(ids=ids, weight=weight, pos=pos, encoding="learned", offset=0, record=0, position_ids=None,
                dropout=False)
    calls = [("first", {}), ("second", {}), ("third", {}), ("new tensors", dict(ids=ids.clone(), weight=weight.clone(),
                                                                                 pos=pos.clone())),
             ("offset 16", dict(offset=16)), ("offset 5", dict(offset=5)), ("offset 5 again", dict(offset=5)),
             ("offset 7", dict(offset=7)), ("offset 1", dict(offset=1)),
             ("misaligned table", dict(weight=torch.randn(100 * 64 + 1)[1:].view(100, 64))),
             ("non-contiguous ids", dict(ids=ids.t().contiguous().t())),
             ("profiler hook", dict(hook=True)),
             ("error record", dict(record=record)), ("error record again", dict(record=record)),
             ("error record, third", dict(record=record)),
             ("int32 ids", dict(ids=ids.int())), ("int32 ids again", dict(ids=ids.int())),
             ("int32 ids, third", dict(ids=ids.int())),
             ("sinusoid", dict(pos=None, encoding="sinusoidal")), ("sinusoid again", dict(pos=None, encoding="sinusoidal")),
             ("sinusoid, third", dict(pos=None, encoding="sinusoidal")),
             ("no positions", dict(pos=None, encoding="none")), ("no positions again", dict(pos=None, encoding="none")),
             ("no positions, third", dict(pos=None, encoding="none")),
             ("position ids", dict(position_ids=position_ids)), ("position ids again", dict(position_ids=position_ids)),
             ("position ids, third", dict(position_ids=position_ids)),
             ("new position ids", dict(position_ids=position_ids.clone())),
             ("int32 position ids", dict(position_ids=position_ids.int())),
             ("dropout", dict(dropout=True)), ("dropout again", dict(dropout=True)),
             ("dropout, third", dict(dropout=True)),
             ("dropout, position ids", dict(dropout=True, position_ids=position_ids)),
             ("dropout, position ids again", dict(dropout=True, position_ids=position_ids)),
             ("dropout, position ids, third", dict(dropout=True, position_ids=position_ids))]
    keys = torch.Generator().manual_seed(1)  # the dropout keys' (the node draws them from it)

    def lookup(ids, weight, pos, encoding, offset, record, position_ids=None, dropout=False):
        """The output, and the dropout key the call used (None without dropout)."""
        state = keys.get_state()
        key = reference.draw_dropout_key(torch.device("cpu"), keys) if dropout else None
        if through_node:
            keys.set_state(state)  # drawn again by the node: the same key
            out = _C.embedding_python_kernels(ids, weight, pos, position_ids, encoding, 2.0, offset, None, False,
                                              False, record, 0.1 if dropout else 0.0, keys, False)
            return out, key
        return _triton.forward(ids, weight, pos, position_ids, encoding, 2.0, offset, key, 0.1 if dropout else 0.0,
                               0, 0, record), key

    mismatches, replayed, own_tensors, addresses = [], [], [], []
    for name, change in calls:
        call = {**base, **change}
        launches.clear()
        through_cached.append(0)
        node_calls.append(0)
        with _profiler_hook(call.get("hook")):
            out, key = lookup(call["ids"], call["weight"], call["pos"], call["encoding"], call["offset"],
                              call["record"], call["position_ids"], call["dropout"])
        got = launches.pop()
        positions = None if call["position_ids"] is None else call["position_ids"].long()
        if not through_cached[-1] and not node_calls[-1]:
            replayed.append(name)
            # A replay launches the call's own tensors (the ids in the unused pointers' places);
            # not compared: int32 position ids' int64 copy, the key the node drew (the same values).
            pos_or_weight = call["weight"] if call["pos"] is None else call["pos"]
            own = (call["ids"], call["weight"], pos_or_weight, call["ids"] if positions is None else positions,
                   call["ids"] if key is None else key, out)
            copies = {3} if positions is not None and positions is not call["position_ids"] else set()
            copies |= {4} if key is not None and through_node else set()
            own_tensors.append(all(_address(a) == b.data_ptr() for j, (a, b) in enumerate(zip(got[3][:6], own))
                                   if j not in copies))
            addresses.append(all(type(a) is int for a in got[3][:6]))
        launches.clear()  # what Triton's own run launches for the same call
        k.embedding_forward(call["ids"].contiguous(), call["weight"].contiguous(), call["pos"], positions,
                            checks.POS_CODES[call["encoding"]], 2.0, call["offset"], key,
                            reference.dropout_threshold(0.1) if key is not None else 0,
                            reference.dropout_scale(0.1) if key is not None else 1.0, 0, 64, out,
                            launch=lambda kernel: kernel, error_record=call["record"])
        if not _same_kind(got, launches.pop()):
            mismatches.append(name)
    # A plan holds none of the tensors it was bound with: the table, ids and output go when
    # the caller lets them go.
    table, table_ids = torch.randn(300, 64), torch.randint(0, 300, (3, 5))
    held = [weakref.ref(table), weakref.ref(table_ids)]
    for _ in range(3):
        held.append(weakref.ref(lookup(table_ids, table, None, "none", 0, 0)[0]))
    del table, table_ids
    launches.clear()  # the stand-in driver's record of them
    gc.collect()
    print(json.dumps({"check": "planned forward", "mismatches": mismatches, "replayed": replayed,
                      "own_tensors": own_tensors, "addresses": addresses,
                      "held_after_release": sum(ref() is not None for ref in held)}))


def check_planned_backward():
    """pyembed/_triton.py's backward plans (kernels.launch.LaunchPlan): from a metadata's
    third call on, every launch of the dense backward replays the bound one; every call --
    replayed or declined to ``cached`` (a misaligned output gradient, a profiler hook) --
    launches what Triton's own run launches for it, in the same order, with the call's own
    output gradient and ids and into the gradients it returns."""
    from pyembed import _triton

    _triton._INTERPRETED = True
    _triton.clear_plans(forward=False)
    through_cached = _count_cached_launches()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 300, (4, 64), generator=gen)
    dout = torch.randn(4, 64, 32, generator=gen)
    base = dict(dout=dout, ids=ids, position_ids=None, offset=0, rows=300, positions=80, scale=2.0, padding=None,
                by_freq=False, table=True, pos=True)
    position_ids = torch.randint(0, 80, (4, 64), generator=gen)
    calls = [("first", {}), ("second", {}), ("third", {}),
             ("new tensors", dict(dout=dout.clone(), ids=ids.clone())),
             ("misaligned dout", dict(dout=torch.randn(dout.numel() + 1)[1:].view(dout.shape))),
             ("profiler hook", dict(hook=True)),
             ("offset 3", dict(offset=3)), ("offset 3 again", dict(offset=3)), ("offset 3, third", dict(offset=3)),
             ("by freq, padding", dict(by_freq=True, padding=7)), ("by freq, padding again", dict(by_freq=True, padding=7)),
             ("by freq, padding, third", dict(by_freq=True, padding=7)),
             ("position ids", dict(position_ids=position_ids)), ("position ids again", dict(position_ids=position_ids)),
             ("position ids, third", dict(position_ids=position_ids)),
             ("positions alone", dict(table=False)), ("positions alone again", dict(table=False)),
             ("positions alone, third", dict(table=False)),
             ("table alone", dict(pos=False)), ("table alone again", dict(pos=False)),
             ("table alone, third", dict(pos=False)),
             ("one chunk", dict(dout=dout[:1, :40].contiguous(), ids=ids[:1, :40].contiguous())),
             ("one chunk again", dict(dout=dout[:1, :40].contiguous(), ids=ids[:1, :40].contiguous())),
             ("one chunk, third", dict(dout=dout[:1, :40].contiguous(), ids=ids[:1, :40].contiguous())),
             ("few tokens", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())),
             ("few tokens again", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())),
             ("few tokens, third", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())),
             ("few tokens, fourth", dict(dout=dout[1:2, :8].contiguous(), ids=ids[1:2, :8].contiguous())),
             ("few tokens, misaligned dout", dict(dout=torch.randn(257)[1:].view(1, 8, 32), ids=ids[:1, :8].contiguous())),
             ("few tokens, table alone", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous(), pos=False)),
             ("few tokens, table alone again", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous(),
                                                    pos=False)),
             ("few tokens, table alone, third", dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous(),
                                                     pos=False))]
    # Past one tile of the tile sort (512 tokens): its merge kernel too.
    tiles = dict(dout=torch.randn(4, 200, 32, generator=gen), ids=torch.randint(0, 300, (4, 200), generator=gen),
                 positions=200)
    calls += [("two tiles", tiles), ("two tiles again", tiles), ("two tiles, third", tiles)]
    # With dropout: the forward's key, a new tensor every call, is one more replaced tensor.
    keys = [torch.randint(0, 2**62, (2,), generator=gen) for _ in range(6)]
    few = dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())
    calls += [("dropout", dict(key=keys[0])), ("dropout again", dict(key=keys[1])),
              ("dropout, third", dict(key=keys[2])), ("few tokens, dropout", dict(few, key=keys[3])),
              ("few tokens, dropout again", dict(few, key=keys[4])),
              ("few tokens, dropout, third", dict(few, key=keys[5]))]
    # torch's sort (the tile sort switched off): a torch op between launches, so the plan
    # replays launch by launch, never whole (its allocations and launches alone would skip the sort).
    sorted_by_torch = dict(dout=torch.randn(2, 48, 32, generator=gen), ids=torch.randint(0, 300, (2, 48), generator=gen),
                           torch_sort=True)
    calls += [("torch's sort", sorted_by_torch), ("torch's sort again", sorted_by_torch),
              ("torch's sort, third", sorted_by_torch)]
    by_launch = []  # calls of a planned metadata not replayed whole (LaunchPlan.replaying)
    replaying = k.LaunchPlan.replaying
    k.LaunchPlan.replaying = lambda plan: by_launch.append(name) or replaying(plan)
    mismatches, replayed, own_tensors, allocations = [], [], [], {}
    for name, change in calls:
        call = {**base, **change}
        key = call.get("key")
        args = (call["dout"], call["ids"], call["position_ids"], call["offset"], call["rows"], call["positions"],
                call["scale"], call["padding"], call["by_freq"], call["table"], call["pos"], key,
                0.0 if key is None else 0.1)
        if call.get("torch_sort"):
            os.environ["PYEMBED_TRITON_TILE_SORT"] = "0"
        launches.clear()
        through_cached.append(0)
        with _profiler_hook(call.get("hook")), _KeepAlive() as kept:
            grads = _triton.backward(*args)
        allocations[name] = kept.allocations
        got = list(launches)
        if not through_cached[-1]:
            replayed.append(name)
            pointers = {_address(a) for *_, arguments in got for a in arguments if isinstance(a, (torch.Tensor, int))}
            own = ([call["dout"]] + ([call["ids"], grads[0]] if call["table"] else [])
                   + ([grads[1]] if call["pos"] else []) + ([key] if key is not None else []))
            own_tensors.append({t.data_ptr() for t in own} <= pointers)
        launches.clear()  # what Triton's own run launches for the same call
        _triton._backward(*args, launch=lambda kernel: kernel)
        os.environ.pop("PYEMBED_TRITON_TILE_SORT", None)
        if not _launched_as_triton(got, launches):
            mismatches.append(name)
    # A plan holds none of the tensors it was bound with.
    # (A batch of the sorted path and one of a few tokens, both replayed whole from their third call.)
    held_dout, held_ids = torch.randn(2, 40, 16), torch.randint(0, 50, (2, 40))
    few_dout, few_ids = torch.randn(2, 4, 16), torch.randint(0, 50, (2, 4))
    held = [weakref.ref(held_dout), weakref.ref(held_ids), weakref.ref(few_dout), weakref.ref(few_ids)]
    for _ in range(4):
        held += map(weakref.ref, _triton.backward(held_dout, held_ids, None, 0, 50, 40, 1.0, None, False, True, True))
        held += map(weakref.ref, _triton.backward(few_dout, few_ids, None, 0, 50, 40, 1.0, None, False, True, True))
    del held_dout, held_ids, few_dout, few_ids
    launches.clear()
    gc.collect()
    k.LaunchPlan.replaying = replaying
    print(json.dumps({"check": "planned backward", "mismatches": mismatches, "replayed": replayed,
                      "by_launch": by_launch, "own_tensors": own_tensors, "allocations": allocations,
                      "held_after_release": sum(ref() is not None for ref in held)}))


def check_planned_node_backward():
    """The dense backward as a lookup's ``.backward()`` runs it (pyembed::embedding's node
    with Python kernels, csrc/pyembed.cpp): from a metadata's third call on the node calls
    the whole replay that pyembed._triton.backward planned itself (set_backward_replay),
    without _triton.backward; every call -- replayed there or not (a misaligned output
    gradient, a profiler hook: _triton.backward's own path) -- launches what Triton's own run
    launches for it, in the same order, with the call's own output gradient and ids and
    into the gradients the tables get."""
    from pyembed import _C, _triton

    _triton._INTERPRETED = True
    _triton.clear_plans()
    through_cached = _count_cached_launches()
    backward_calls = []

    def counted_backward(*args):
        backward_calls[-1] += 1
        return _triton.backward(*args)
    _C.set_python_kernels(_triton.node_forward, counted_backward, _triton.sparse_backward)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 300, (4, 64), generator=gen)
    dout = torch.randn(4, 64, 32, generator=gen)
    table, positions = torch.randn(300, 32, generator=gen), torch.randn(80, 32, generator=gen)
    few = dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())
    calls = [("first", {}), ("second", {}), ("third", {}), ("new tensors", dict(dout=dout.clone(), ids=ids.clone())),
             ("misaligned dout", dict(dout=torch.randn(dout.numel() + 1)[1:].view(dout.shape))),
             ("profiler hook", dict(hook=True)),
             ("offset 3", dict(offset=3)), ("offset 3 again", dict(offset=3)), ("offset 3, third", dict(offset=3)),
             ("table alone", dict(pos=False)), ("table alone again", dict(pos=False)),
             ("table alone, third", dict(pos=False)),
             ("few tokens", few), ("few tokens again", few), ("few tokens, third", few)]
    mismatches, replayed, own_tensors = [], [], []
    for name, change in calls:
        call = {"dout": dout, "ids": ids, "offset": 0, "pos": True, **change}
        weight, pos = table.clone().requires_grad_(), positions.clone().requires_grad_(call["pos"])
        through_cached.append(0)  # (the forward's)
        out = _C.embedding_python_kernels(call["ids"], weight, pos, None, "learned", 2.0, call["offset"], None, False,
                                          False, 0, 0.0, None, False)
        launches.clear()
        through_cached.append(0)
        backward_calls.append(0)
        with _profiler_hook(call.get("hook")):
            out.backward(call["dout"])
        got = list(launches)
        if not through_cached[-1] and not backward_calls[-1]:
            replayed.append(name)
            pointers = {_address(a) for *_, arguments in got for a in arguments if isinstance(a, (torch.Tensor, int))}
            own = [call["dout"], call["ids"], weight.grad] + ([pos.grad] if call["pos"] else [])
            own_tensors.append({t.data_ptr() for t in own} <= pointers)
        launches.clear()  # what Triton's own run launches for the same call
        _triton._backward(call["dout"], call["ids"], None, call["offset"], 300, 80, 2.0, None, False, True,
                          call["pos"], launch=lambda kernel: kernel)
        if not _launched_as_triton(got, launches):
            mismatches.append(name)
    launches.clear()
    print(json.dumps({"check": "planned node backward", "mismatches": mismatches, "replayed": replayed,
                      "own_tensors": own_tensors}))


def check_planned_optimizer_backward():
    """pyembed/_triton.py's optimizer_backward: its sort and chunks' pass planned per
    metadata as the dense backward's launches, and the update's launch planned with the
    step's scalars (floats) given anew (LaunchPlan(floats=True), launch by launch); below
    FEW_TOKENS tokens the touched rows' sums and the update (with its row map), and the
    learned positions' update (position_update), planned the same way. From a metadata's
    third call on nothing goes through the cached launcher; every call launches what
    Triton's own run launches for it, in the same order, with the call's own output
    gradient, ids, table and state (and dropout key) -- and this step's scalars: each call
    takes another step's bias corrections and learning rate."""
    from pyembed import _triton, optim

    _triton._INTERPRETED = True
    for plans in (_triton._segment_plans, _triton._update_plans, _triton._touched_plans):
        plans.clear()
    through_cached = _count_cached_launches()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (4, 64), generator=gen)
    dout = torch.randn(4, 64, 32, generator=gen)
    tiles = dict(dout=torch.randn(4, 200, 32, generator=gen), ids=torch.randint(0, 300, (4, 200), generator=gen))
    few = dict(dout=dout[:1, :8].contiguous(), ids=ids[:1, :8].contiguous())
    keys = [torch.randint(0, 2**62, (2,), generator=gen) for _ in range(3)]
    calls = [("first", {}), ("second", {}), ("third", {}), ("new tensors", dict(dout=dout.clone(), ids=ids.clone())),
             ("misaligned dout", dict(dout=torch.randn(dout.numel() + 1)[1:].view(dout.shape))),
             ("padding, by freq", dict(padding=7, by_freq=True)), ("padding, by freq again", dict(padding=7, by_freq=True)),
             ("padding, by freq, third", dict(padding=7, by_freq=True)),
             ("two tiles", tiles), ("two tiles again", tiles), ("two tiles, third", tiles),
             ("dropout", dict(key=keys[0])), ("dropout again", dict(key=keys[1])), ("dropout, third", dict(key=keys[2])),
             ("few tokens", few), ("few tokens again", few), ("few tokens, third", few),
             ("positions", dict(positions=True)), ("positions again", dict(positions=True)),
             ("positions, third", dict(positions=True)), ("positions, offset 5", dict(positions=True, offset=5))]
    by_launch = []  # calls whose sort plan was not replayed whole (LaunchPlan.replaying of a plan without floats)
    replaying = k.LaunchPlan.replaying

    def replaying_noted(plan):
        if not plan.floats:  # (a plan with floats always replays launch by launch)
            by_launch.append(name)
        return replaying(plan)
    k.LaunchPlan.replaying = replaying_noted
    mismatches, replayed, own_tensors = [], [], []
    for step, (name, change) in enumerate(calls, start=1):
        call = {"dout": dout, "ids": ids, "padding": None, "by_freq": False, "key": None, "positions": False,
                "offset": 0, **change}
        # AdamW's scalars at this step: lr (as a schedule gives it), the bias corrections
        hyper = [1e-3 / step, 0.9, 0.999, 1e-8, 0.01, 1.0, 0.0, 1 - 0.9**step, (1 - 0.999**step) ** 0.5]
        rows = 80 if call["positions"] else 300
        table = torch.randn(rows, 32, generator=gen)
        state1, state2 = torch.zeros_like(table), torch.zeros_like(table)
        dropout_p = 0.0 if call["key"] is None else 0.1
        launches.clear()
        through_cached.append(0)
        with _KeepAlive():  # no temporary's address reused within the call: Triton's run holds them
            if call["positions"]:
                _triton.position_update(call["dout"], call["ids"], call["offset"], call["key"], dropout_p, table, state1,
                                        state2, optim.ADAM, hyper)
            else:
                _triton.optimizer_backward(call["dout"], call["ids"], 1.5, call["padding"], call["by_freq"], call["key"],
                                           dropout_p, table, state1, state2, optim.ADAM, hyper, True)
        got = list(launches)
        if through_cached[-1] == 0:
            replayed.append(name)
            pointers = {_address(a) for *_, arguments in got for a in arguments if isinstance(a, (torch.Tensor, int))}
            own = [call["dout"], table, state1, state2] + ([] if call["positions"] else [call["ids"]])
            own_tensors.append({t.data_ptr() for t in own + ([call["key"]] if call["key"] is not None else [])}
                               <= pointers)
        launches.clear()  # what Triton's own run launches for the same call
        direct = lambda kernel: kernel  # noqa: E731
        dout2d, dropout = call["dout"].contiguous().reshape(-1, 32), _triton._dout_dropout(call["key"], dropout_p)
        skip = -1 if call["padding"] is None else call["padding"]
        if call["positions"]:
            seq_len = call["ids"].shape[-1]
            k.position_update(dout2d, table, state1, state2, call["ids"].numel() // seq_len, seq_len, call["offset"],
                              optim.ADAM, hyper, dropout=dropout, launch=direct)
        elif call["ids"].numel() <= k.FEW_TOKENS:
            touched, values = k.used_row_sums(dout2d, call["ids"], 300, skip, 1.5, call["by_freq"], exact=False,
                                              dropout=dropout, launch=direct)
            k.optimizer_update(table, state1, state2, touched, values, optim.ADAM, hyper, True, launch=direct)
        else:
            segments = k.sorted_segments(dout2d, call["ids"], 300, skip, by_row=True, launch=direct, dropout=dropout)
            k.optimizer_backward(dout2d, segments, 1.5, call["by_freq"], table, state1, state2, optim.ADAM, hyper,
                                 True, dropout=dropout, launch=direct)
        if not _launched_as_triton(got, launches):
            mismatches.append(name)
    k.LaunchPlan.replaying = replaying
    print(json.dumps({"check": "planned optimizer backward", "mismatches": mismatches, "replayed": replayed,
                      "by_launch": by_launch, "own_tensors": own_tensors}))


def check_profiler_hooks():
    """A profiler's launch hook (as Proton sets one) sees every launch, with its metadata,
    cached or not -- as many calls and the same kernel names as under Triton's own run."""
    from triton import knobs

    variants = forward_variants()
    kernel = k._embedding_forward_kernel
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        for name in ("plain", "one token", "plain", "plain"):
            _what_triton_launches(kernel, *variants[name])
        by_triton, seen[:] = list(seen), []
        launch._launchers.clear()
        launched = [_what_cached_launches(kernel, *variants[name]) for name in ("plain", "one token", "plain", "plain")]
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    expected = [_what_triton_launches(kernel, *variants[name]) for name in ("plain", "one token", "plain", "plain")]
    print(json.dumps({"check": "profiler hooks", "by_triton": by_triton, "cached": seen,
                      "same_launches": all(map(_same, launched, expected))}))


@triton.jit
def _copy_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):  # a launch that reads one tensor, writes another
    offsets = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=offsets < n), mask=offsets < n)


def check_whole_plans():
    """kernels.launch.LaunchPlan planned whole -- or not -- for helpers of each kind: only
    allocations, views and launches (whole: a replay launches with the call's input and new
    allocations, wired as bound, and returns the new output); a torch op between launches,
    a launch given a view past an allocation's start, an output that is no allocation (not
    whole: the replay would skip the op or misname the memory)."""
    def copies(x, launch):  # x -> a temporary -> the output
        tmp, out = torch.empty_like(x), x.new_empty(x.shape)
        launch(_copy_kernel)[(1,)](x, tmp, x.numel(), BLOCK=64)
        launch(_copy_kernel)[(1,)](tmp, out, x.numel(), BLOCK=64)
        return (out,)

    def sorts(x, launch):
        out = x.new_empty(x.shape)
        launch(_copy_kernel)[(1,)](x.sort().values, out, x.numel(), BLOCK=64)
        return (out,)

    def offset_view(x, launch):
        buf = x.new_empty(2 * x.numel())
        launch(_copy_kernel)[(1,)](x, buf[16:], x.numel(), BLOCK=64)
        return (buf,)

    def returns_input(x, launch):
        launch(_copy_kernel)[(1,)](x, x.new_empty(x.shape), x.numel(), BLOCK=64)
        return (x,)

    x = torch.randn(40)
    result = {}
    for name, helper in {"copies": copies, "sorts": sorts, "offset view": offset_view,
                         "returns input": returns_input}.items():
        plan = k.LaunchPlan()
        plan.bind_call(lambda launch: helper(x, launch), (x,))
        result[name] = plan.whole is not None
    plan = k.LaunchPlan()
    plan.bind_call(lambda launch: copies(x, launch), (x,))
    y = torch.randn(40)
    launches.clear()
    replayed = plan.replay_whole((y,))
    got = list(launches)
    launches.clear()
    reference = copies(y, lambda kernel: kernel)
    result["replay"] = {"same_launches": len(got) == 2 and all(map(_same_kind, got, launches)),
                        "same_wiring": _wiring(got, launches) == _wiring(launches),
                        "reads_the_input": _address(got[0][3][0]) == y.data_ptr(),
                        "writes_its_output": _address(got[1][3][1]) == replayed[0].data_ptr(),
                        "output_shape": list(replayed[0].shape) == list(reference[0].shape)}
    print(json.dumps(result))


def check_node_after_column_shard():
    """A sinusoidal lookup through the node, after two calls of the same shapes as a column
    shard's (sinusoid_column_offset, sinusoid_dim given; the second binds a replay): the node
    launches what it launches with no plans at all (its key holds no sinusoid columns)."""
    from pyembed import _C, _triton

    _triton._INTERPRETED = True
    ids, weight = torch.randint(0, 100, (2, 16)), torch.randn(100, 8)

    def node_launch():
        launches.clear()
        _C.embedding_python_kernels(ids, weight, None, None, "sinusoidal", 2.0, 0, None, False, False, 0, 0.0,
                                    None, False)
        return launches[-1]

    _triton.clear_plans()
    alone = node_launch()
    _triton.clear_plans()
    for _ in range(2):
        _triton.forward(ids, weight, None, None, "sinusoidal", 2.0, 0, None, 0.0, 2, 16, 0)
    after_shard = node_launch()
    print(json.dumps({"same": _same_kind(after_shard, alone) and _wiring([after_shard], [alone]) == _wiring([alone])}))


def check_random_calls(seed: int):
    """Random interleavings of every entry point that keeps launch plans -- pyembed._triton's
    forward (a column shard's too), the node's forward (embedding_python_kernels, which
    replays what node_forward gave it) and backward (which replays what backward gave it),
    and backward itself -- over a few metadata drawn at random, each call with new tensors
    and a new offset of the same class, now and then a misaligned table or a profiler hook:
    every call launches what Triton's own run launches for it (binaries, arguments, wiring),
    whichever entry point planned its metadata before. A plan one entry point made that
    another replays wrongly (as a column shard's forward was, for the node) shows here."""
    import random

    from pyembed import _C, _triton, checks, reference

    _triton._INTERPRETED = True
    _triton.clear_plans()
    _C.set_python_kernels(_triton.node_forward, _triton.backward, _triton.sparse_backward)
    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    rows, positions, dim = 100, 400, 32
    record = checks.error_record_address(torch.device("cpu"))
    direct = lambda kernel: kernel  # noqa: E731

    choices = dict(shape=[(1, 1), (1, 8), (2, 16), (4, 64), (2, 300), (24,)],  # one token ... two sort tiles
                   table=[torch.float32, torch.float16], encoding=["none", "learned", "sinusoidal"],
                   ids=[torch.int64, torch.int32], scale=[1.0, 2.0], offset=[0, 1, 3, 16], record=[0, record],
                   dropout=[False, False, True], position_ids=[None, "full", "row"])

    def consistent(m):  # position ids only with an encoding and a batch
        return dict(m, position_ids=None if m["encoding"] == "none" or len(m["shape"]) == 1 else m["position_ids"])

    kinds = [consistent({name: rng.choice(values) for name, values in choices.items()}) for _ in range(6)]
    through_cached = _count_cached_launches()
    replayed = []  # calls that launched through no cached launcher: every launch a plan's replay
    keys = torch.Generator().manual_seed(seed + 1)  # the node's dropout keys (drawn again for the reference)
    mismatches, calls = [], []
    for index in range(160):
        base, changed = rng.randrange(len(kinds)), None
        m = kinds[base]
        if rng.random() < 0.25:  # a neighbour: one property other than the drawn metadata's (a key that
            changed = rng.choice(sorted(choices))  # leaves it out replays the neighbour's plan here)
            m = consistent(dict(m, **{changed: rng.choice([v for v in choices[changed] if v != m[changed]])}))
        entry = rng.choice(["forward", "node", "node", "backward"] + ["shard"] * (m["encoding"] == "sinusoidal"))
        offset = {0: 0, 1: 1, 3: rng.choice([3, 5, 7]), 16: rng.choice([16, 32])}[m["offset"]]
        offset = 0 if m["position_ids"] else offset  # (position ids take no offset)
        ids = torch.randint(0, rows, m["shape"], generator=gen).to(m["ids"])
        weight = torch.randn(rows, dim, generator=gen).to(m["table"])
        if rng.random() < 0.1:  # a table one element into its buffer: not 16-byte aligned, the replay declines
            weight = torch.empty(rows * dim + 1, dtype=m["table"])[1:].view(rows, dim).copy_(weight)
        pos = torch.randn(positions, dim, generator=gen).to(m["table"]) if m["encoding"] == "learned" else None
        position_ids = None
        if m["position_ids"]:
            position_ids = torch.randint(0, positions, (1 if m["position_ids"] == "row" else m["shape"][0],
                                                        m["shape"][-1]), generator=gen)
        hook = rng.random() < 0.05
        calls.append((entry, base, changed, offset))
        launches.clear()
        through_cached.append(0)
        state = keys.get_state()
        key = reference.draw_dropout_key(torch.device("cpu"), keys) if m["dropout"] and entry != "backward" else None
        columns = (2, dim + 4) if entry == "shard" else (0, 0)  # the shard's columns at its global index
        if entry in ("forward", "shard"):
            expanded = None if position_ids is None else position_ids.expand(ids.shape)
            with _profiler_hook(hook):
                out = _triton.forward(ids, weight, pos, expanded, m["encoding"], m["scale"], offset, key,
                                      0.1 if key is not None else 0.0, *columns, m["record"])
        elif entry == "node":
            keys.set_state(state)  # drawn again by the node: the same key
            weight.requires_grad_()
            if pos is not None:
                pos.requires_grad_()
            with _profiler_hook(hook):
                out = _C.embedding_python_kernels(ids, weight, pos, position_ids, m["encoding"], m["scale"], offset,
                                                  None, False, False, m["record"], 0.1 if m["dropout"] else 0.0, keys,
                                                  False)
        if entry != "backward":
            got = launches.pop()
            launches.clear()  # what Triton's own run launches for the same call (not through the cached launcher)
            expanded = None if position_ids is None else position_ids.expand(ids.shape).long().contiguous()
            k.embedding_forward(ids.contiguous(), weight.detach().contiguous(), pos, expanded,
                                checks.POS_CODES[m["encoding"]], m["scale"], offset, key,
                                reference.dropout_threshold(0.1) if key is not None else 0,
                                reference.dropout_scale(0.1) if key is not None else 1.0, columns[0],
                                columns[1] or dim, out.detach(), launch=direct, error_record=m["record"])
            if not _launched_as_triton([got], launches):
                mismatches.append((index, "forward"))
        if entry in ("node", "backward"):
            dout = torch.randn(*m["shape"], dim, generator=gen).to(m["table"])
            if entry == "backward":
                key = torch.randint(0, 2**62, (2,), generator=gen) if m["dropout"] else None
            saved = None if position_ids is None else position_ids.expand(ids.shape)
            args = (dout, ids, saved, offset, rows, positions if pos is not None else 0, m["scale"], None, False, True,
                    pos is not None, key, 0.1 if key is not None else 0.0)
            launches.clear()
            with _profiler_hook(hook), _KeepAlive():
                if entry == "node":
                    out.backward(dout)
                else:
                    _triton.backward(*args)
            got = list(launches)
            launches.clear()
            with _KeepAlive():
                _triton._backward(*args, launch=direct)
            if not _launched_as_triton(got, launches):
                mismatches.append((index, "backward"))
        if not through_cached[-1]:
            replayed.append(entry)
    print(json.dumps({"check": "random calls", "seed": seed, "calls": len(calls), "mismatches": mismatches,
                      "replayed": {entry: replayed.count(entry) for entry in sorted(set(replayed))},
                      "metadata": [{name: str(v) for name, v in m.items()} for m in kinds],
                      "first_mismatch_after": calls[:mismatches[0][0] + 1] if mismatches else []}))


if __name__ == "__main__":
    {"forward": check_forward_variants, "eager": check_eager_calls, "hooks": check_profiler_hooks,
     "planned": check_planned_forward, "planned-node": lambda: check_planned_forward(through_node=True),
     "planned-backward": check_planned_backward, "planned-node-backward": check_planned_node_backward,
     "planned-optimizer-backward": check_planned_optimizer_backward,
     "whole": check_whole_plans, "node-after-column-shard": check_node_after_column_shard,
     "random-calls": lambda: check_random_calls(int(sys.argv[2]))}[sys.argv[1]]()
