"""The Triton kernels' cached launcher (kernels/launch.py) launches what Triton's own
``kernel[grid](...)`` launches, with the real JIT compiling for sm_90 and a stand-in
driver recording each launch (tests/triton_launch_worker.py, in a subprocess: it needs
TRITON_INTERPRET unset)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _worker(check: str, *args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The checkout after what PYTHONPATH holds: make gpu-check's staged build comes first.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_launch_worker.py"), check, *args],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cached_launches_equal_tritons_for_every_specialisation_in_every_order():
    # 16 forward calls, each differing from the first in one property Triton specialises on
    # (dtype, 16-byte alignment, an int == 1, % 16, past 32 bits, a constexpr) or in one it
    # does not (an int scale for an fp64 parameter, an offset of 16 vs 0): after any one of
    # them is cached, any other launches the binary and arguments Triton launches for it.
    result = _worker("forward")
    assert result["mismatches"] == []
    # The variants Triton compiles apart: 6 share the plain call's binary, the two offsets
    # past 2^31 one (the offset's % 16 tells the compiler nothing about an address since
    # learned positions take their tokens in position-major order), and the three error
    # records one (the kernel does not specialise on the record's address: a high part of
    # 1 was a binary of its own).
    assert result["binaries"] == 9
    assert result["cached"] == 2  # the last pair, each under its own key
    # The unrolled key agrees with the loop wherever it answers; it declines only where an
    # argument's type differs (an int scale) or an int is past 32 bits (the 2^31 offsets).
    unrolled = result["unrolled"]
    assert "differ" not in unrolled
    declined = {tuple(pair) for pair in unrolled["declined"]}
    wide = {"offset 2^31", "offset 2^31 + 1"}
    for first, second in declined:
        assert first == "integer scale" or second == "integer scale" or second in wide, (first, second)
    assert ("plain", "integer scale") in declined and ("plain", "offset 2^31") in declined
    assert len(unrolled["agree"]) > len(result["unrolled"]["declined"])
    # A cache hit passes each tensor's address, not the tensor (Triton's launcher would call
    # data_ptr() and cuPointerGetAttribute for it), wherever the unrolled key answered.
    # (The launches pair distinct variants.)
    assert {tuple(pair) for pair in result["with_tensors"]} == {(a, b) for a, b in declined if a != b}


def test_eager_forward_and_backward_launch_through_the_cache():
    result = _worker("eager")
    assert result["kernels"] == ["_chunk_kernel", "_embedding_forward_kernel", "_finish_segments_kernel",
                                 "_merge_tiles_kernel", "_tile_rank_kernel"]  # the positions' gradient in finish
    assert result["jit_runs"] == [5, 0]  # the second step never enters JITFunction.run (the merge, with maxnreg, too)
    assert result["second"] == result["first"]  # same binaries, grids and stream


def test_a_profilers_launch_hook_sees_cached_launches_as_it_sees_tritons():
    result = _worker("hooks")
    assert len(result["by_triton"]) == 4 and result["cached"] == result["by_triton"]
    assert result["same_launches"]


@pytest.mark.parametrize("entry", ["planned", "planned-node"])
def test_the_eager_forward_replays_its_plan_and_launches_what_triton_would(entry):
    # planned-node: through pyembed::embedding's node (a one-token lookup's path), which
    # replays the plans itself -- the calls listed launched without node_forward's Python.
    result = _worker(entry)
    assert result["mismatches"] == []  # every call, replayed or not, launched Triton's binary and arguments
    # A metadata's third call on replays (its first is remembered, its second bound), with
    # the call's own tensors; an offset of the bound specialisation (% 16, not 1) replays
    # the same plan; a misaligned table, non-contiguous ids, a profiler hook and offsets of
    # another specialisation (1; 5, whose key is new until its second call) do not.
    # Position ids (int32 ones converted, as the kernel reads int64) and dropout keys are the
    # call's own too.
    assert result["replayed"] == ["third", "new tensors", "offset 16", "offset 7", "error record, third",
                                  "int32 ids, third", "sinusoid, third", "no positions, third",
                                  "position ids, third", "new position ids", "int32 position ids", "dropout, third",
                                  "dropout, position ids, third"]
    assert all(result["own_tensors"])
    # Their addresses, as ints: Triton's launcher then neither calls data_ptr() nor asks the
    # driver about each pointer (cuPointerGetAttribute) on every launch.
    assert result["addresses"] and all(result["addresses"])
    assert result["held_after_release"] == 0  # a plan keeps no table, ids or output alive


def test_a_lookups_backward_replays_its_plan_from_the_node_and_launches_what_triton_would():
    result = _worker("planned-node-backward")
    assert result["mismatches"] == []  # every call's launches, in order, are Triton's binaries and arguments
    # From a metadata's third call on the node replays the whole plan itself (no
    # _triton.backward, no cached launch), with the call's own output gradient and ids, into
    # the tables' gradients; a misaligned output gradient and a profiler hook do not.
    assert result["replayed"] == ["third", "new tensors", "offset 3, third", "table alone, third", "few tokens, third"]
    assert result["own_tensors"] and all(result["own_tensors"])


def test_the_eager_backward_replays_its_plan_and_launches_what_triton_would():
    result = _worker("planned-backward")
    assert result["mismatches"] == []  # every call's launches, in order, are Triton's binaries and arguments
    # From a metadata's third call on, every launch replays (offsets, scale_grad_by_freq with
    # a padding row, position_ids, either table's gradient alone, a batch of one chunk -- no
    # long segment's pieces --, a short batch's one kernel, a batch past one tile of the
    # tile sort -- its merge too --, dropout, torch's sort between launches), with the call's
    # own output gradient and ids (and dropout key), into the gradients it returns; a
    # misaligned output gradient and a profiler hook take the cached launcher.
    assert result["replayed"] == ["third", "new tensors", "offset 3, third", "by freq, padding, third",
                                  "position ids, third", "positions alone, third", "table alone, third",
                                  "one chunk, third", "few tokens, third", "few tokens, fourth",
                                  "few tokens, table alone, third", "two tiles, third", "dropout, third",
                                  "few tokens, dropout, third", "torch's sort, third"]
    # Replayed whole (allocations and launches, no Python of the helpers) but where torch's
    # sort runs between the launches, and where a replay refuses (misaligned, a hook).
    assert result["by_launch"] == ["misaligned dout", "profiler hook", "few tokens, misaligned dout",
                                   "torch's sort, third"]
    assert all(result["own_tensors"])
    # Replayed whole, the sort's keys and order, the bounds and the partial sums are one
    # workspace: three allocations with the two gradients, where the bound call made six.
    assert result["allocations"]["second"] == 6 and result["allocations"]["third"] == 3
    assert result["held_after_release"] == 0  # a plan keeps no output gradient, ids or gradient alive


def test_the_optimizer_backward_replays_its_sort_and_launches_what_triton_would():
    result = _worker("planned-optimizer-backward")
    # Every call's launches, in order, are Triton's binaries and arguments -- the step's
    # scalars (another learning rate and bias corrections each call) included.
    assert result["mismatches"] == []
    # From a metadata's third call on, no launch takes the cached launcher: the sort's and
    # chunks' launches replay (whole: none of their Python), the update's launch replays with
    # this step's scalars, as do the few-token path (the touched rows' sums, the row map, the
    # update) and the learned positions' update; a misaligned output gradient declines the
    # replays, a new offset is a new plan.
    assert result["replayed"] == ["third", "new tensors", "padding, by freq, third", "two tiles, third",
                                  "dropout, third", "few tokens, third", "positions, third"]
    assert result["by_launch"] == ["misaligned dout"]  # the others' sort replayed whole
    assert all(result["own_tensors"])


def test_a_plan_replays_whole_only_a_call_of_allocations_views_and_launches():
    # kernels.launch.LaunchPlan.bind_call, on small helpers: whole where the helper only
    # allocates, views and launches; not where a torch op runs between the launches (the
    # replay would skip it), a launch gets a view past an allocation's start, or the call
    # returns what it did not allocate. A whole replay launches what Triton's run launches for
    # the new input, into new allocations shared between the launches as in that run.
    result = _worker("whole")
    assert result.pop("replay") == {"same_launches": True, "same_wiring": True, "reads_the_input": True,
                                    "writes_its_output": True, "output_shape": True}
    assert result == {"copies": True, "sorts": False, "offset view": False, "returns input": False}


class _Launcher:
    """A launcher of Triton 3.8's form (CudaLauncher): scratch memory sized by the grid
    when it has any, then one call of its C launch with attributes of its own and the
    kernel's arguments as a tuple."""

    def __init__(self, calls, scratch=0, twice=False, as_list=False):
        self.calls, self.scratch, self.twice, self.as_list = calls, scratch, twice, as_list
        self.cooperative, self.annotations = False, [("kernel", 1), ("constexpr", 0)]
        self.launch = lambda *args: calls.append(args)

    def __call__(self, grid_x, grid_y, grid_z, stream, function, metadata, launch_metadata, enter_hook, exit_hook,
                 *args):
        scratch = bytearray(grid_x * grid_y * grid_z * self.scratch) if self.scratch else None
        for _ in range(1 + self.twice):
            self.launch(grid_x, grid_y, grid_z, stream, function, self.cooperative, metadata, launch_metadata,
                        enter_hook, exit_hook, scratch, self.annotations, list(args) if self.as_list else args)


class _Launcher36(_Launcher):
    """Triton 3.6's form: everything after the function passed on one by one."""

    def __call__(self, grid_x, grid_y, grid_z, stream, function, *args):
        scratch = bytearray(grid_x * grid_y * grid_z * self.scratch) if self.scratch else None
        self.launch(grid_x, grid_y, grid_z, stream, function, self.cooperative, True, scratch, None, *args)


@pytest.mark.parametrize("form", [_Launcher, _Launcher36], ids=["3.8", "3.6"])
def test_a_launch_makes_the_launchers_c_call_itself_where_the_launcher_makes_one_of_its_own_values(form):
    # kernels.launch.direct_launch: the C call a launcher makes, seen once with stand-in
    # arguments, made by the cached launcher and the replays without the launcher's Python
    # (~2.5 us a launch on the development VM): the same arguments as the launcher gives it.
    # Not where the launcher sizes scratch memory by the grid, calls its C launch twice,
    # passes the kernel's arguments otherwise than as given, or has no C launch.
    import types

    from pyembed.kernels import launch

    calls = []
    compiled = types.SimpleNamespace(run=form(calls), function=77, packed_metadata=(3, 4))
    compiled.run(8, 2, 1, 5, 77, (3, 4), None, None, None, 10, 2.5, "x")
    launch._launch_path(compiled)[2](compiled, 8, 2, 1, 5, (10, 2.5, "x"))
    assert len(calls) == 2 and calls[0] == calls[1] and (10, 2.5, "x") in (calls[1][-1], calls[1][-3:])
    assert launch.direct_launch(compiled) is not None
    refusals = [dict(scratch=4)] + ([dict(twice=True), dict(as_list=True)] if form is _Launcher else [])
    for refused in refusals:
        other = types.SimpleNamespace(run=form([], **refused), function=77, packed_metadata=(3, 4))
        assert launch.direct_launch(other) is None, refused
        calls.clear()  # and launched through the launcher, as before
        other.run.launch = lambda *args: calls.append(args)
        launch._launch_path(other)[2](other, 8, 2, 1, 5, (10,))
        assert calls and calls[0][:4] == (8, 2, 1, 5)
    plain = types.SimpleNamespace(run=lambda *args: None, function=77, packed_metadata=None)
    assert launch.direct_launch(plain) is None
    # A bound launch's replay (kernels.launch._replay_code) makes the same C call.
    import torch

    tensor, stream = torch.empty(4), 5
    driver = types.SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda device: stream)
    c_call, c_globals = launch._c_call_code(launch.direct_launch(compiled))
    namespace = dict(triton=types.SimpleNamespace(runtime=types.SimpleNamespace(driver=types.SimpleNamespace(
                     active=driver))), knobs=types.SimpleNamespace(runtime=types.SimpleNamespace(
                     add_stages_inspection_hook=None)), launch_hooks=lambda runtime: False,
                     jit_context=lambda device: "context", CONTEXT="context", DRIVER=driver,
                     CURRENT_DEVICE=driver.get_current_device, int_class=launch.int_class, CLASSES=(),
                     COMPILED=compiled, GRID=(8, 2, 1), A1=2.5, A2="x", **c_globals)
    replay = types.FunctionType(launch._replay_code(((0,),), (), 3, c_call), namespace)
    calls.clear()
    assert replay(tensor)
    compiled.run(8, 2, 1, stream, 77, (3, 4), None, None, None, tensor.data_ptr(), 2.5, "x")
    assert len(calls) == 2 and calls[0] == calls[1]


def test_the_node_never_replays_a_column_shards_sinusoid_for_a_plain_lookup():
    # A column shard's forward (DTensor's ColwiseParallel: its sinusoid columns at their
    # global index) binds a plan of the same shapes as a plain lookup of the shard; the
    # node, whose replay key holds no sinusoid columns, must not be given it.
    assert _worker("node-after-column-shard") == {"same": True}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_interleavings_of_the_planning_entry_points_launch_what_triton_launches(seed):
    # 160 calls over six random metadata and their one-property neighbours, through the
    # Python forward (a column shard's too), the node's forward and backward, and the Python
    # backward, each checked against Triton's own run of the same call. Two seeds of the
    # three fail or more with the column-shard fix above undone, or the scale or the error
    # record left out of the forward's plan key; the dropout left out of the backward's, all.
    result = _worker("random-calls", str(seed))
    assert result["mismatches"] == [], result
    assert {"forward", "node", "backward"} <= set(result["replayed"])  # plans were replayed from each


# One call's launches (forward, and a backward past a tile and a chunk: every kernel of the
# dense backward), on CPU tensors: under the interpreter for `record`, through the real JIT
# with the stand-in driver afterwards.
_WARM_CALL = """
import torch, pyembed
weight = torch.randn(1000, 64, requires_grad=True)
pos_weight = torch.randn(512, 64, requires_grad=True)
ids = torch.randint(0, 1000, (2, 300), generator=torch.Generator().manual_seed(0))
pyembed.fused_embedding(ids, weight, pos_weight, scale=8.0, backend="triton").sum().backward()
"""


def test_warmed_specialisations_are_what_the_same_call_launches_later(tmp_path):
    """tests/triton_specs.py warm (gpu-check runs it beside its build, so that the test
    step's workers find their kernels compiled): a call's launches recorded under the
    interpreter and compiled by `warm` into a fresh Triton cache are the ones the same
    call, run through the real JIT in another process, finds there -- it compiles nothing
    (a specialisation or launch option recorded otherwise than launched would be compiled
    again: a new entry in the cache)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT), str(ROOT / "tests"),
                                                      str(ROOT / "bench")]))
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    specs = tmp_path / "specs.json"

    def run(*args, interpret=False):
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path,
                              env={**env, "TRITON_INTERPRET": "1"} if interpret else env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    run("-c", f"import triton_specs\nlaunched = triton_specs.recording()\n{_WARM_CALL}\n"
              f"triton_specs.write_record({str(specs)!r}, launched)", interpret=True)
    kernels = {name for name, _, _ in json.loads(specs.read_text())}
    assert kernels == {"_embedding_forward_kernel", "_tile_rank_kernel", "_merge_tiles_kernel", "_chunk_kernel",
                       "_finish_segments_kernel"}
    # and the forward's other range check: on a GPU the default check is in the kernel
    report = run(str(ROOT / "tests" / "triton_specs.py"), "warm", str(specs), "2", "300")
    assert report.startswith("6 of 6 specialisations compiled"), report
    warmed = sorted(os.listdir(tmp_path / "cache"))
    assert len(warmed) == 6
    # CPU tensors through the JIT: the backend told it is interpreted (as triton_launch_worker
    # does); the call with the synchronous check recorded, then as a GPU makes it, the
    # ranges checked in the kernel (bench/triton_host.py's way) into this process's record;
    # and that forward at a record address whose high part is a multiple of 16, as in one
    # process of 16 -- which the kernel must not specialise on.
    checked_elsewhere = f"""
forward = [e for e in triton_specs._with_both_range_checks(triton_specs._specialisations({str(specs)!r}, "cpu"))
           if e[0] == "_embedding_forward_kernel" and e[2]["CHECK_RANGES"]][0]
args = list(forward[1])
names = _triton._kernels()._embedding_forward_kernel.arg_names
args[names.index("error_record_high")], args[names.index("error_record_low")] = 32, 4096
_triton._kernels()._embedding_forward_kernel.warmup(*args, grid=(1,), **forward[2])
"""
    run("-c", f"import stand_in_driver, triton_specs\nstand_in_driver.install()\nfrom pyembed import _triton, checks\n"
              f"_triton._INTERPRETED = True\n{_WARM_CALL}\n"
              f"checks.KERNEL_CHECKED_DEVICES = (*checks.KERNEL_CHECKED_DEVICES, 'cpu')\n{_WARM_CALL}\n"
              f"{checked_elsewhere}")
    assert sorted(os.listdir(tmp_path / "cache")) == warmed


def test_launches_recorded_without_running_them_are_those_running_makes():
    """tests/triton_specs.py records the GPU benchmark's launches without running them (the
    interpreter would take hours over its tables), which holds while no launch depends on
    what a kernel wrote (the default path never waits for the device). Small cases past the
    few-token path -- every mode, the optimizer in the backward, dropout, the sinusoid,
    bf16 -- recorded both ways: the same launches."""
    code = """import json, sys, triton_specs
from bench.cases import Case
launched = triton_specs.recording()
cases = [Case("tiny", 4, 64, mode) for mode in ("fwd", "bwd", "fwd+bwd", "step")]
cases += [Case("tiny", 4, 64, "fwd+bwd", dropout=0.1), Case("tiny", 4, 64, "step", "bf16", "sinusoidal")]
calls = triton_specs.benchmark_calls(cases, execute=sys.argv[1] == "run")
print(json.dumps([calls, sorted(launched)]))
"""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(ROOT), str(ROOT / "tests")]))}
    found = {}
    for how in ("run", "record"):
        proc = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, env=env)
        assert proc.returncode == 0, proc.stderr[-4000:]
        found[how] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["record"] == found["run"]
    calls, launches = found["run"]
    assert calls == 8  # a step runs twice: torch's AdamW, and the optimizer in the backward
    kernels = {json.loads(launch)[0] for launch in launches}
    assert {"_embedding_forward_kernel", "_tile_rank_kernel", "_finish_segments_kernel",
            "_segment_update_kernel"} <= kernels, kernels
