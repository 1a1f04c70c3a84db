"""Every Triton specialisation the test suite launches, compiled by another Triton.

    python tests/triton_specs.py record OUT.json [pytest args]   # under the interpreter
    python tests/triton_specs.py compile IN.json                 # the real JIT, for sm_90
    python tests/triton_specs.py warm IN.json [JOBS [SECONDS [FOLDERS.json]]]  # into Triton's cache

``record`` runs the triton tests (and the sanitizer workload, and one step of each GPU
benchmark case, recorded without running) under the interpreter and writes down each
launch: the kernel, each argument as Triton specialises it (a tensor's dtype and 16-byte
alignment, an int or float as given) and the constexprs. ``compile``
builds each distinct one with the Triton it runs under -- `make test-compat` runs it with
the GPU machine's (3.6) -- through its real JIT for sm_90 with a stand-in driver
(bench/stand_in_driver.py), and fails listing any that do not compile. Triton 3.6 once failed to compile the dense
backward at d = 16-64, which no test here could see: the interpreter does not compile.
``warm`` compiles them into Triton's on-disk cache, for this machine's GPU (the stand-in's
sm_90 where none is visible), in JOBS processes (default: the cores less two), starting no
compile after SECONDS (default 150) and stopping its processes 10 s later (each reports what
it compiled); it never fails (a spec that does not compile is named,
and a test that launches it reports it). FOLDERS.json, if named, gets the cache folders of the
kernels it compiled or found (what `make gpu-prepare` packs). gpu-check runs it beside its build, whose CUDA
compile leaves most cores idle for a minute or more, and each of the test step's 16 workers
compiles what it launches first for itself (at 26f0ba6, H200, the step's slowest tests were
mostly small-shape triton ones at 9-23 s, which compiling would explain).
"""

import base64
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/test_parity.py", "tests/test_dropout.py", "tests/test_optim.py", "tests/test_host_sync.py",
                 "tests/test_modules.py", "tests/test_dropin.py", "-k", "triton or auto"]


def _as_specialised(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0]
    return getattr(value, "value", value)  # a constexpr's value, or the int / float / bool / None itself


EXECUTE = True  # False: launches are recorded, not run (their outputs stay as allocated)


def recording() -> dict:
    """Record every launch of pyembed's kernels from now on, under the interpreter (set
    before triton is imported): {its JSON: [kernel name, arguments as specialised, constexprs]}."""
    import triton.runtime.interpreter as interpreter

    launched = {}
    launch = interpreter.GridExecutor.__call__

    def recording_launch(self, *args, **kwargs):
        # pyembed's kernels only (a test may launch a kernel of its own around one of their helpers)
        if getattr(self.fn, "__module__", None) == "pyembed.kernels.embedding":
            entry = [self.fn.__name__, [_as_specialised(a) for a in args],
                     {name: _as_specialised(v) for name, v in kwargs.items()}]
            launched[json.dumps(entry)] = entry
        return launch(self, *args, **kwargs) if EXECUTE else None

    interpreter.GridExecutor.__call__ = recording_launch
    return launched


def write_record(out: str, launched: dict) -> None:
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(list(launched.values())))
    print(f"{len(launched)} launches recorded in {out}")


def record(out: str, pytest_args: list) -> int:
    """The triton tests' launches (DEFAULT_TESTS unless ``pytest_args``), and by default the
    sanitizer workload's too (tests/gpu/sanitizer_workload.py on CPU tensors: gpu-check's
    compute-sanitizer runs of the triton backend compile what it launches)."""
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest

    launched = recording()
    os.chdir(ROOT)  # the default test paths are the repository's
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(pytest_args or DEFAULT_TESTS)])
    if not pytest_args:
        import importlib.util

        import torch

        spec = importlib.util.spec_from_file_location("sanitizer_workload", ROOT / "tests" / "gpu" /
                                                      "sanitizer_workload.py")
        workload = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(workload)
        print(f"sanitizer workload: {workload.run_backend('triton', torch.device('cpu'))} triton calls")
        print(f"GPU benchmark: {benchmark_calls()} triton calls")
    write_record(out, launched)
    return int(code)


def benchmark_calls(cases: list | None = None, execute: bool = False) -> int:
    """One step of each case of the GPU benchmark (bench/cases.py's gpu suite, or ``cases``)
    through the `triton` backend on CPU tensors, as its `pyembed-triton` and (steps)
    `pyembed-triton-fused` providers make it (bench/run.py's step_fn), run or (``execute``
    False) only recorded; how many calls. Their launches are the kernels gpu-check's timing
    call compiles on the GPU machine, whose shapes the tests lack. Recorded, not run (the
    interpreter would take hours over these tables): no launch depends on what a kernel
    wrote -- the default path never waits for the device -- but for a sparse gradient's size,
    so the sparse step is left out. Compiled pyembed's kernels are Inductor's to compile."""
    global EXECUTE
    import gc

    import torch

    sys.path.insert(0, str(ROOT))
    from bench import providers, run, cases as suites

    # The benchmark's own providers (on CPU tensors, under the interpreter, triton's are among them).
    triton = [p for p in providers.providers(torch.device("cpu")) if p.name.startswith("pyembed-triton")]
    calls, EXECUTE = 0, execute
    try:
        for case in suites.suite("gpu") if cases is None else cases:
            if case.grad == "sparse":
                continue
            tables, ids, dout = run.case_inputs(case, "cpu")
            for p in triton:
                if p.why_not(case) is None:
                    run.step_fn(p, case, ids, run.own_copy(tables, parameters=p.optimizer_in_backward), dout)()
                    calls += 1
            del tables, ids, dout
            gc.collect()  # an optimizer in the backward and its tables refer to each other (Llama-3: GBs)
    finally:
        EXECUTE = True
    return calls


def _specialisations(path: str, device: str) -> list:
    """(kernel name, arguments, constexprs) of each distinct recorded launch (by the cached
    launcher's key), the tensors made on ``device`` as they were specialised."""
    import torch

    def argument(value):
        if isinstance(value, list) and value[:1] == ["tensor"]:
            base = torch.zeros(64, dtype=getattr(torch, value[1]), device=device)
            return base if value[2] else base[1:]  # one element in: not 16-byte aligned
        return value

    return _distinct([(name, tuple(map(argument, recorded)), constexprs)
                      for name, recorded, constexprs in json.loads(pathlib.Path(path).read_text())])


def _with_both_range_checks(entries: list) -> list:
    """``entries`` and each forward's other CHECK_RANGES variant: the tests ran on CPU
    tensors, whose default check is synchronous (CHECK_RANGES off), where their GPU runs
    check inside the kernel -- with a record address of the process's own, which the kernel
    does not specialise on (any nonzero parts stand in for it)."""
    from pyembed.kernels import embedding as kernels

    names = kernels._embedding_forward_kernel.arg_names
    high, low = names.index("error_record_high"), names.index("error_record_low")
    variants = []
    for name, args, constexprs in entries:
        if name == "_embedding_forward_kernel" and "CHECK_RANGES" in constexprs:
            checked = not constexprs["CHECK_RANGES"]
            other = list(args)
            other[high], other[low] = (3, 16) if checked else (0, 0)
            variants.append((name, tuple(other), {**constexprs, "CHECK_RANGES": checked}))
    return _distinct(entries + variants)


def _distinct(entries: list) -> list:
    """One entry per distinct launch, by the cached launcher's key."""
    from pyembed.kernels.launch import _launch_key

    found = {}
    for name, args, constexprs in entries:
        found.setdefault((name, _launch_key((), args, constexprs)), (name, args, constexprs))
    return list(found.values())


def cache_folder(kernel) -> str:
    """The folder of Triton's cache holding a compiled kernel: the base32 of its hash, as
    triton.runtime.cache.get_cache_manager names it (Triton 3.x)."""
    return base64.b32encode(bytes.fromhex(kernel.hash)).decode().rstrip("=")


def _warm_up(entries: list, stop_at: float = float("inf")) -> tuple[int, list, set]:
    """Compile each entry through its kernel's JIT (warmup: nothing launched); (how many
    compiled, the failures, their cache folders), none started after ``stop_at`` (time.time())."""
    from pyembed.kernels import embedding as kernels

    done, failed, folders = 0, [], set()
    for name, args, constexprs in entries:
        if time.time() > stop_at:
            break
        try:
            folders.add(cache_folder(getattr(kernels, name).warmup(*args, grid=(1,), **constexprs)))
            done += 1
        except KeyboardInterrupt:  # warm's time is up (its parent stops it): report what is done
            break
        except Exception as error:  # noqa: BLE001 - every failure is reported
            failed.append(f"{name} {constexprs}: {str(error).splitlines()[0][:200]}")
    return done, failed, folders


def _install_stand_in() -> None:
    """Triton's real JIT for sm_90 with no GPU (bench/stand_in_driver.py), before any compile."""
    sys.path.insert(0, str(ROOT / "bench"))
    import stand_in_driver

    stand_in_driver.install()


def _stand_in_unless_gpu() -> str:
    """The device the specialisations are compiled for: this machine's GPU, else the
    stand-in driver's sm_90 (CPU tensors)."""
    import torch

    if torch.cuda.is_available():
        return "cuda"
    _install_stand_in()
    return "cpu"


def compile_all(path: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    _install_stand_in()
    import triton

    entries = _specialisations(path, "cpu")
    done, failed, _ = _warm_up(entries)
    print(f"Triton {triton.__version__}: {done} of {len(entries)} specialisations compiled "
          "for sm_90", *failed, sep="\n")
    return 1 if failed else 0


def warm(path: str, jobs: int, seconds: float, folders_path: str | None = None) -> int:
    """``warm``: the specialisations in ``jobs`` processes, each every jobs-th one; their
    kernels' cache folders into ``folders_path`` (a json list), if given."""
    started = time.time()
    shards = [subprocess.Popen([sys.executable, __file__, "warm-shard", path, str(k), str(jobs), str(seconds)],
                               stdout=subprocess.PIPE, text=True) for k in range(jobs)]
    outputs = []
    try:
        for shard in shards:
            outputs.append(shard.communicate(timeout=max(0.1, started + seconds + 10 - time.time()))[0])
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        # Time is up: a compile started before SECONDS may run on (at 82eabd8 on an H200
        # gpu-check stopped this process alone after 210 s, its shards compiling on beside
        # the tests, and nothing said how far they had come). Each shard stops after its
        # current compile and reports.
        for shard in shards:
            shard.send_signal(signal.SIGINT)
        outputs += [shard.communicate()[0] for shard in shards[len(outputs):]]
    reports = []
    for k, output in enumerate(outputs):
        lines = output.strip().splitlines()
        try:
            reports.append(json.loads(lines[-1]))
        except (IndexError, ValueError):  # the shard died: its output says why
            reports.append({"done": 0, "total": 0, "failed": [f"shard {k}: " + "; ".join(lines[-3:])],
                            "device": "?", "folders": []})
    done, total = sum(r["done"] for r in reports), sum(r["total"] for r in reports)
    print(f"{done} of {total} specialisations compiled into Triton's cache for {reports[0]['device']} in "
          f"{time.time() - started:.0f} s, {jobs} processes", *(f for r in reports for f in r["failed"]), sep="\n")
    if folders_path is not None:
        pathlib.Path(folders_path).write_text(json.dumps(sorted({f for r in reports for f in r["folders"]})))
    return 0


def warm_shard(path: str, shard: int, jobs: int, seconds: float) -> None:
    stop_at = time.time() + seconds
    os.environ.pop("TRITON_INTERPRET", None)
    done, entries, failed, target, folders = 0, [], [], "?", set()
    try:
        device = _stand_in_unless_gpu()
        target = "sm_90 (stand-in)" if device == "cpu" else "this GPU"
        entries = _with_both_range_checks(_specialisations(path, device))[shard::jobs]
        done, failed, folders = _warm_up(entries, stop_at)
    except KeyboardInterrupt:  # stopped before its first compile (imports are slow beside a build)
        failed.append(f"shard {shard}: stopped before compiling")
    print(json.dumps({"done": done, "total": len(entries), "failed": failed, "device": target,
                      "folders": sorted(folders)}))


if __name__ == "__main__":
    command, path, *rest = sys.argv[1:]
    if command == "record":
        sys.exit(record(path, rest))
    if command == "warm":
        sys.exit(warm(path, int(rest[0]) if rest else max(1, (os.cpu_count() or 4) - 2),
                      float(rest[1]) if len(rest) > 1 else 150.0, rest[2] if len(rest) > 2 else None))
    if command == "warm-shard":
        warm_shard(path, *map(int, rest[:2]), float(rest[2]))
        sys.exit(0)
    sys.exit(compile_all(path))
