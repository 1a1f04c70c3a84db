"""``make gpu-check``: everything GPU-side proven in one command (DESIGN §6).

On a machine whose python already has a CUDA torch, offline:
  1. stages an importable package under build/gpu-check/site (pyembed + kernels/ as
     pyembed.kernels) and builds pyembed._C into it for the visible GPU's architecture
     only (MAX_JOBS = all cores) -- or copies in the one `make gpu-prepare` built for it
     beforehand (build/gpu-prepared, carried here: tests/gpu/gpu_prepare.py), and seeds
     Triton's cache with the kernels it compiled; the source tree and any installed copy
     are untouched; beside it, where build/triton_specs.json was carried here, compiles the
     Triton specialisations it lists (tests/triton_specs.py warm) into Triton's cache;
  2. runs tests/ and tests/gpu/ on it (CUDA tensors wherever a test has a GPU variant),
     with junit XML, pytest-xdist workers where installed; side by side with
  3. compute-sanitizer memcheck, racecheck and initcheck over
     tests/gpu/sanitizer_workload.py (every kernel, small);
  4. then alone, torch.profiler and Nsight Compute over tests/gpu/profile_workload.py,
     compiled pyembed's host time by layer of torch.compile's runtime
     (python -m bench.compiled_host), the GPU's timeline of eager and compiled calls and
     steps (profile_workload.py --timeline), and the layer inside a
     small model's training step, eager and compiled (python -m bench.model);
  5. then the GPU benchmark suite (results.csv / .md / PNG), and issues #29 and #30's
     targets against its cases (python -m bench.targets: targets.md);
and writes everything under GPU_CHECK_OUT (default gpu-check/): logs, junit.xml, the
benchmark's CSV / markdown / PNG, and summary.md naming the device and versions with
pass/fail counts, sanitizer error counts, the profile's medians, the benchmark table and
the targets met or not.
On the H100 machine (16 cores, at d81f5b2) the build took 76 s, the tests 163 s beside the
sanitizers (~173 s each), the profile 40 s and the benchmark ~560 s (76 cases, 8
providers): more than the 10 minutes a command may run there, and than the 15 minutes of
device time a session has. ``--time-limit SECONDS`` fits the run into one command: each
step's timeout leaves the later steps their minimum, and the benchmark, whose cases run
in priority order (bench/cases.py gpu_priority: the issues' targets first), measures
cases while its share lasts and names those it left out (README, "Tests on a GPU").

Without a CUDA device it prints one line and exits 2. Exit 0 when every step passed,
1 otherwise. ``--rehearse`` runs the CPU-side parts here (build for sm_90, staging, a
few tests, the workload on CPU, the summary) to check the script without a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import gpu_prepare
from gpu_prepare import ROOT, stage_package

SANITIZER_TOOLS = ("memcheck", "racecheck", "initcheck")


class Check:
    """Runs the steps, each a subprocess whose stdout + stderr go to out/log, and records
    (name, ok, seconds, log). Steps may run side by side (``start`` several, then ``wait``):
    the correctness steps share the GPU without harm, and one device call must hold them."""

    def __init__(self, out: Path, env: dict):
        self.out, self.env, self.steps, self.running, self.ended = out, env, [], [], {}
        self.skipped: list[tuple[str, str]] = []
        self.notes: list[str] = []

    def start(self, name: str, cmd: list[str], log: str, timeout: int, env: dict | None = None,
              cwd: Path = ROOT) -> None:
        print(f"gpu-check: {name} ...", flush=True)
        f = (self.out / log).open("w")
        proc = subprocess.Popen(cmd, cwd=cwd, env={**self.env, **(env or {})}, stdout=f, stderr=subprocess.STDOUT)
        self.running.append((name, proc, f, log, time.time(), timeout))
        # When it ends, which may be before wait() reaches it (steps side by side).
        threading.Thread(target=lambda: (proc.wait(), self.ended.setdefault(name, time.time())), daemon=True).start()

    def wait(self) -> dict[str, tuple[bool, str]]:
        """Wait for every started step. One past its time gets SIGINT first (pytest then still
        writes its summary and junit XML), SIGKILL 30 s later."""
        results = {}
        for name, proc, f, log, start, timeout in self.running:
            try:
                proc.wait(timeout=max(1.0, start + timeout - time.time()))
                timed_out = False
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
                timed_out = True
            f.close()
            if timed_out:
                with (self.out / log).open("a") as f:
                    f.write(f"\n[gpu-check: timed out after {timeout} s]\n")
            ok = proc.returncode == 0 and not timed_out
            seconds = self.ended.pop(name, time.time()) - start
            self.steps.append((name, ok, seconds, log))
            print(f"gpu-check: {name}: {'ok' if ok else 'FAILED'} ({seconds:.0f} s, {log})", flush=True)
            results[name] = (ok, (self.out / log).read_text(errors="replace"))
        self.running = []
        return results

    def run(self, name: str, cmd: list[str], log: str, timeout: int, env: dict | None = None,
            cwd: Path = ROOT) -> tuple[bool, str]:
        self.start(name, cmd, log, timeout, env, cwd)
        return self.wait()[name]

    def note(self, line: str) -> None:
        """A line for the summary, under its table of steps."""
        print(f"gpu-check: {line}", flush=True)
        self.notes.append(line)

    def skip(self, name: str, why: str) -> None:
        """A step not run, and why (the summary's table says so)."""
        print(f"gpu-check: {name}: skipped ({why})", flush=True)
        self.skipped.append((name, why))


class Deadline:
    """--time-limit: the whole run within ``seconds`` (None: no limit). A step's timeout is
    its own cap, cut to what is left once the steps after it are kept their minimum time
    (``reserve``); never under ``floor`` seconds, so each step at least starts."""

    def __init__(self, seconds: int | None, floor: int = 30):
        self.end = None if seconds is None else time.time() + seconds
        self.floor = floor

    def timeout(self, cap: int, reserve: int = 0) -> int:
        if self.end is None:
            return cap
        return int(min(cap, max(self.floor, self.end - time.time() - reserve)))


# Minimum seconds kept for what follows a step under --time-limit: each profile step (the
# torch.profiler workload took 40 s on the H100 at d81f5b2), the benchmark's first cases
# (its 8 target cases took ~65 s there), and the summary. The tests come first: at d81f5b2
# they took 163 s, beside the sanitizers (~173 s each), after a 76 s build.
PROFILE_MIN, BENCH_MIN, SUMMARY_MIN = 40, 90, 15
# The least time a benchmark is started with: its process's start and a first case (a GPT-2
# 8x2048 forward, every provider: at 82eabd8 two such cases ran in a 30 s limit) before the
# 45 s it keeps to finish a case and write its table.
BENCH_START = 60


def reserves(args: argparse.Namespace) -> tuple[int, int, int]:
    """Seconds each step leaves for those after it under --time-limit: the profile steps (the
    benchmark and the summary), the model step (with ncu's share) and the tests (with the
    profile's five other steps). Without the profile (a first call: correctness first) the
    tests leave the summary's time alone, and a benchmark takes what they leave (BENCH_START
    at least, else none). At 82eabd8 they had 130 s, with 40 s more kept for ncu, which such a
    call does not run (theirs now); a reserve of BENCH_MIN would have cut the 130 to 40."""
    profiling = not args.skip_profile and not args.rehearse
    after_profile = (0 if args.skip_bench else BENCH_MIN) + SUMMARY_MIN
    after_model = after_profile + (PROFILE_MIN if profiling and not args.skip_ncu else 0)
    return after_profile, after_model, (after_model + 5 * PROFILE_MIN if profiling else SUMMARY_MIN)


def xdist_args(python: str, workers: int) -> list[str]:
    """-n WORKERS where pytest-xdist is installed: the suite's CPU-heavy half then uses the
    GPU machine's cores (each test is independent; distributed tests rendezvous by file)."""
    if workers <= 0:
        return []
    found = subprocess.run([python, "-c", "import xdist"], capture_output=True).returncode == 0
    return ["-n", str(workers)] if found else []


def _junit_root(path: Path):
    """junit.xml's root element, or None where the file is missing or unreadable (a test step
    killed while pytest wrote it): the summary is still written."""
    try:
        return ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None


def junit_counts(path: Path) -> dict:
    root = _junit_root(path)
    if root is None:
        return {}
    suites = [root] if root.tag == "testsuite" else list(root)
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def junit_failures(path: Path, limit: int = 30) -> list[str]:
    root = _junit_root(path)
    if root is None:
        return []
    names = []
    for case in root.iter("testcase"):
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                message = (node.get("message") or "").splitlines()[0][:160] if node.get("message") else ""
                names.append(f"{case.get('classname')}::{case.get('name')} ({tag}): {message}")
    return names[:limit]


BACKEND_PARAMS = ("cuda", "triton", "reference")


def junit_seconds(path: Path, rows: int = 15) -> list[str]:
    """Where the test step's worker-seconds went: junit.xml's test times summed by module
    and by the backend a test's parameters name (``triton@cuda`` or ``triton``; "-" for
    none), the largest first, beside the whole -- the GPU test step's length (issue #29),
    whose 30 slowest tests were ~15% of it at 26f0ba6."""
    root = _junit_root(path)
    if root is None:
        return []
    totals, count = {}, {}
    for case in root.iter("testcase"):
        name = case.get("name") or ""
        params = name[name.find("[") + 1:-1].split("-") if name.endswith("]") else []
        backend = next((p.removesuffix("@cuda") for p in params if p.removesuffix("@cuda") in BACKEND_PARAMS), "-")
        key = (case.get("classname") or "?", backend)
        totals[key] = totals.get(key, 0.0) + float(case.get("time") or 0)
        count[key] = count.get(key, 0) + 1
    whole = sum(totals.values())
    lines = [f"{whole:.0f} worker-seconds over {sum(count.values())} tests; by module and backend:", "",
             "| module | backend | tests | seconds | share |", "|---|---|---|---|---|"]
    for key in sorted(totals, key=totals.get, reverse=True)[:rows]:
        lines.append(f"| {key[0]} | {key[1]} | {count[key]} | {totals[key]:.0f} | {totals[key] / (whole or 1):.0%} |")
    return lines


def sanitizer_errors(text: str) -> int | None:
    """The error count of compute-sanitizer's closing line: "ERROR SUMMARY: N errors"
    (memcheck, initcheck) or "RACECHECK SUMMARY: H hazards displayed (N errors, ...)"."""
    found = re.findall(r"ERROR SUMMARY: (\d+) error|RACECHECK SUMMARY: \d+ hazards? displayed \((\d+) error", text)
    return int(next(n for n in found[-1] if n)) if found else None


def main() -> int:
    ap = argparse.ArgumentParser(description="Build, test, sanitize and benchmark pyembed on this machine's GPU.")
    ap.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT", "gpu-check"))
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--skip-sanitizer", action="store_true")
    ap.add_argument("--skip-bench", action="store_true")
    ap.add_argument("--skip-profile", action="store_true", help="no torch.profiler / ncu breakdown")
    ap.add_argument("--skip-ncu", action="store_true",
                    help="no Nsight Compute step (~70 s at 82eabd8): where no kernel changed since the last run")
    ap.add_argument("--workers", type=int, default=min(16, os.cpu_count() or 1),
                    help="pytest-xdist workers for the test suite, where xdist is installed (0: none)")
    ap.add_argument("--tests-timeout", type=int, default=1800, help="seconds for the tests and each sanitizer")
    ap.add_argument("--all-tests", action="store_true",
                    help="the whole suite, CPU-only tests included (default: tests/gpu and the CUDA / triton tests)")
    ap.add_argument("--bench-timeout", type=int, default=1800, help="seconds for the benchmark")
    ap.add_argument("--bench-args", default="", help="extra arguments for python -m bench")
    ap.add_argument("--time-limit", type=int, default=None, metavar="SECONDS",
                    help="the whole run within SECONDS (a host's limit on one command, less a margin): each step's "
                         "timeout leaves the later ones their minimum, and the benchmark measures its cases in "
                         "priority order while its share lasts (bench --time-limit)")
    ap.add_argument("--rehearse", action="store_true", help="no GPU: check the CPU-side parts of this script")
    args = ap.parse_args()

    info = gpu_prepare.stack(args.python)
    if info["torch"] is None:
        print(f"gpu-check: {args.python} cannot import torch ({info['error']}); nothing to check here")
        return 2
    if "device" not in info and not args.rehearse:
        print(f"gpu-check: no CUDA device visible to {args.python} (torch {info['torch']}, "
              f"CUDA {info['cuda']}); nothing to check here")
        return 2
    out = (ROOT / args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    stage = ROOT / "build" / "gpu-check" / "site"
    arch = info.get("capability", "9.0")
    # Everything runs from the stage, so `import pyembed` finds the staged package before
    # the source tree (python -m puts the working directory first on sys.path).
    # Whatever PYTHONPATH already holds (e.g. carried wheels: Liger-Kernel) stays, after them.
    paths = [str(stage), str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    # Every step's Triton kernels in one cache, kept between calls on one machine.
    triton_cache = ROOT / "build" / "gpu-check" / "triton-cache"
    # Inductor compiles in the calling process, not in a pool of workers: at 82eabd8 the
    # profile step, its output all written, was found stopped at its 104 s (82 s in all at
    # 26f0ba6) in the pool's shutdown at exit (torch 2.11), time the steps after it lacked.
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", **os.environ, "PYTHONPATH": os.pathsep.join(paths),
           "PYTHONDONTWRITEBYTECODE": "1", "TRITON_CACHE_DIR": str(triton_cache)}
    env.pop("TRITON_INTERPRET", None)
    check = Check(out, env)
    started = time.time()
    deadline = Deadline(args.time_limit)
    after_profile, after_model, after_tests = reserves(args)

    # 1. Stage the package the tests import, with _C built for this GPU: beforehand where
    # `make gpu-prepare` made one that fits this machine and it was carried here
    # (tests/gpu/gpu_prepare.py), else into the stage now, for this GPU only. Its Triton
    # kernels, compiled beforehand too, seed the cache (a first call's: later ones find it).
    stage_package(stage)
    prepared_dir = ROOT / "build" / "gpu-prepared"
    prepared = gpu_prepare.load(prepared_dir)
    if prepared is not None and not triton_cache.exists():
        check.note(gpu_prepare.unpack_triton_cache(prepared_dir, prepared, info, triton_cache))
    cached_before = gpu_prepare.cache_entries(triton_cache)
    mismatch = gpu_prepare.extension_mismatch(prepared, info, arch) if prepared else "none was carried here"
    # PYEMBED_ALLOW_OLD_TORCH: the GPU machine's torch may be older than the declared floor
    # (2.11 there); this run is how such a version gets tested before it is declared.
    build_env = {"TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(os.cpu_count() or 4), "PYEMBED_BUILD_CUDA": "1",
                 "PYTHONPATH": "", "PYEMBED_ALLOW_OLD_TORCH": "1"}
    build = f"build (sm_{arch.replace('.', '')})"

    def start_build():
        check.start(build, [args.python, "setup.py", "build_ext", "--build-lib", str(stage), "--build-temp",
                            str(ROOT / "build" / "gpu-check" / "temp")], "build.log",
                    deadline.timeout(900, SUMMARY_MIN), build_env)

    def imports(log: str = "import.log") -> bool:  # the tests must see the staged build, with its CUDA kernels
        code = ("import pyembed, sys; info = pyembed.build_info(); print(pyembed.__file__, info, "
                "pyembed.available_backends()); sys.exit(not (pyembed.__file__.startswith(sys.argv[1]) and "
                "info['cuda_built']))")
        return check.run("import the staged build", [args.python, "-c", code, str(stage)], log, 300, cwd=stage)[0]

    if mismatch is None:
        shutil.copy2(prepared_dir / prepared["so"], stage / "pyembed")
        if imports("import-prepared.log"):
            check.note(f"pyembed._C: built beforehand for sm_{arch.replace('.', '')} (make gpu-prepare at "
                       f"{prepared['commit']}), not here")
        else:  # then built as without one: this attempt a note, not a failed step
            check.steps.pop()
            mismatch = "it did not import here (import-prepared.log)"
    if mismatch is not None:
        check.note(f"pyembed._C built here, not beforehand (make gpu-prepare): {mismatch}")
        start_build()
    # Beside it, the Triton specialisations the tests launch, compiled into Triton's cache
    # (tests/triton_specs.py warm), where a recorded list was carried here: the build's one
    # CUDA translation unit leaves the other cores idle, and the test step's workers would
    # each compile what they launch first. Not a check: a spec that does not compile is the
    # tests' to report.
    specs = ROOT / "build" / "triton_specs.json"
    # It must end with the build: the tests wait for both. At 82eabd8 (H200) it was given
    # 90 s to start compiles and 210 s in all, and took them all (its processes starting
    # beside the build's compilers made that build 132 s, 93 at 26f0ba6); the tests then
    # had 130 s (1118 of their 1119 done, 91% in 217 s at 26f0ba6, without it).
    # With the kernels compiled beforehand, it finds them in the cache (ms each) and compiles
    # what is missing.
    if specs.exists() and not args.skip_tests:
        jobs, seconds = max(1, (os.cpu_count() or 4) - 2), 30 if args.rehearse else 75  # within the build's time
        check.start("Triton specialisations compiled into Triton's cache (tests/triton_specs.py warm)",
                    [args.python, str(ROOT / "tests" / "triton_specs.py"), "warm", str(specs), str(jobs),
                     str(seconds)], "triton-warm.log", seconds + 20, cwd=stage)
    ended = check.wait()
    built = mismatch is None or (ended[build][0] and imports())

    # 2. The test suite on CUDA tensors and 3. the sanitizers, side by side; 4. the profile
    # and 5. the benchmark alone afterwards (their timings must not share the GPU).
    sanitizer = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    san_logs, results = {}, {}
    if built:
        tests_dir, workload = str(ROOT / "tests"), str(ROOT / "tests" / "gpu" / "sanitizer_workload.py")
        if args.rehearse:
            tests = [f"{tests_dir}/test_dispatch.py", f"{tests_dir}/gpu", "-k", "opcheck or gpu"]
            check.run("sanitizer workload on CPU (rehearsal)", [args.python, workload, "--device", "cpu"],
                      "sanitizer-rehearsal.log", 600, {"TRITON_INTERPRET": "1"}, cwd=stage)
        elif args.all_tests:
            tests = [f"{tests_dir}/gpu", tests_dir]
        else:
            # What needs the GPU: tests/gpu and the suite's '@cuda' parametrisations
            # (tests/conftest.py's --gpu-only). The CPU-only rest (host emulation, AOT
            # compiles, Inductor on CPU, packaging) is CI's, and would not fit one 10-minute
            # call (--all-tests runs it too).
            tests = [f"{tests_dir}/gpu", tests_dir, "--gpu-only"]
        tests_timeout = deadline.timeout(args.tests_timeout, after_tests)
        if not args.skip_tests:
            check.start("pytest tests/ tests/gpu/",
                        [args.python, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", f"--rootdir={ROOT}",
                         "--durations=30", f"--junitxml={out / 'junit.xml'}", *xdist_args(args.python, args.workers)],
                        "pytest.log", tests_timeout, cwd=stage)
        if not args.rehearse and not args.skip_sanitizer:
            # A run per tool and backend: at 1b594a4 (H200) one run per tool over both backends
            # was cut at its 149 s inside `triton`'s part (each new kernel compiled under the
            # sanitizer), so not even `cuda`'s finished part had its error count.
            for tool, backend in itertools.product(SANITIZER_TOOLS, ("cuda", "triton")):
                name = f"compute-sanitizer {tool} ({backend})"
                cmd = [sanitizer, "--tool", tool, "--print-limit", "50", args.python, workload, "--backend", backend]
                # Each tensor and each of the cuda backward's scratch arrays an allocation of its
                # own, so that an access past one is past an allocation, which memcheck reports.
                check.start(name, cmd, f"sanitizer-{tool}-{backend}.log", tests_timeout,
                            {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1", "PYEMBED_CUDA_SCRATCH": "separate"}, cwd=stage)
                san_logs[f"{tool} ({backend})"] = name
        results = check.wait()
        if not args.rehearse and not args.skip_profile:
            # 4. Where the time goes: torch.profiler per backend, then Nsight Compute on the
            # forward and backward kernels (DRAM throughput, occupancy) -- minutes, so before the benchmark,
            # which a host's time limit may cut short (its rows reach the CSV case by case).
            profiler = str(ROOT / "tests" / "gpu" / "profile_workload.py")
            check.run("profile (torch.profiler)", [args.python, profiler], "profile.log",
                      deadline.timeout(300, after_model + 4 * PROFILE_MIN), cwd=stage)
            # Compiled pyembed against compiled nn ops, host time by layer of torch.compile's
            # runtime (guards, graph, frame, backward), GPT-2 8x2048, fp32 and bf16, backwards
            # on autograd's device thread as the benchmark runs them: at
            # d81f5b2 compiled pyembed cost ~120 us more host per 8x2048 step; at 26f0ba6 (H200)
            # every compiled provider's flushed 8x2048 forward took 28-67 us more in bf16 than
            # in fp32 (GPT-2: compiled pyembed `cuda` 116 against 49 us, nn ops 96 against 68),
            # the GPU work being half: this says whether their host time differs. (Runs up to
            # 26f0ba6 also timed one token, and backwards on the calling thread: figures in
            # docs/bench-h200/; left out to give the timeline and the model steps their time.)
            check.run("compiled host time (python -m bench.compiled_host)",
                      [args.python, "-m", "bench.compiled_host", "--rounds", "3", "--shape", "8x2048", "--dtype",
                       "fp32", "--dtype", "bf16"], "compiled-host-threads.log",
                      deadline.timeout(300, after_model + 3 * PROFILE_MIN), cwd=stage)
            # Inductor launches a compiled graph's user-defined Triton kernels (compiled
            # `triton`'s) through Triton's own launcher, its own kernels through its static
            # CUDA launcher, unless this setting says otherwise (off by default in torch 2.13
            # and 2.14; the GPU machine's 2.11 reads it too if it has it, else this run is the
            # first's): this run's `triton` row against the one above says what it is worth.
            check.run("compiled host time, user Triton kernels launched statically (python -m bench.compiled_host)",
                      [args.python, "-m", "bench.compiled_host", "--rounds", "3", "--layer", "triton", "--shape",
                       "8x2048"], "compiled-host-static-launch.log",
                      deadline.timeout(120, after_model + 2 * PROFILE_MIN),
                      {"TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS": "1"}, cwd=stage)
            # Where a compiled forward + backward's GPU waits (Llama-3 8x2048, fp32 and bf16, eager
            # and compiled pyembed): at 26f0ba6 compiled `cuda` took 905 us at bf16, eager 575, both
            # 568 us of GPU work; at fp32 both ~800, their GPU time. Then the benchmark's GPT-2
            # 8x2048 steps, learned and sinusoidal: every compiled provider's sinusoidal step took
            # ~400 us more than its learned one there (compiled nn ops 948 against 522 us).
            check.run("compiled timeline (torch.profiler)", [args.python, profiler, "--timeline"],
                      "compiled-timeline.log", deadline.timeout(210, after_model + PROFILE_MIN), cwd=stage)
            # The layer inside a small model's training step, eager and compiled as one graph,
            # written with nn ops and with pyembed (python -m bench.model): a compiled layer
            # alone is mostly torch.compile's runtime, which a compiled model pays once for
            # all its layers (at 26f0ba6 compiled pyembed's GPT-2 8x2048 fwd+bwd alone took
            # 541 us, eager 175). fp32 first: its table prints before bf16's compiles start.
            check.run("the input layer in a model (python -m bench.model)",
                      [args.python, "-m", "bench.model", "--dtype", "fp32", "--dtype", "bf16"], "model.log",
                      deadline.timeout(150, after_model), cwd=stage)
            ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
            if os.path.exists(ncu) and not args.skip_ncu:
                check.run("ncu on the forward and backward kernels",
                          [ncu, "--clock-control", "none", "--kernel-name",
                           "regex:forward|sort_inputs|tile_rank|merge_tiles|chunk_kernel|finish_segments|"
                           "batch_sum|few_tokens|optimizer_update|segment_update",
                           "--launch-count", "48",  # the workload runs 38 (40 with the forward at both row shapes)
                           "--section", "SpeedOfLight", "--section", "Occupancy", "--section", "LaunchStats",
                           # L1 / L2 hit rates: whether streaming stores keep the backward's bounds in L2
                           "--section", "MemoryWorkloadAnalysis",
                           # Sectors per request by access kind, and what warps stall on: at 26f0ba6
                           # triton's tile merge took 20.7 us at 86% L1 throughput for the searches
                           # cuda's makes in 8.3 at 11%, and cuda's finish_segments issued at 50% of
                           # the SMs at 55% of DRAM bandwidth (Llama-3 bf16): neither said why.
                           "--section", "MemoryWorkloadAnalysis_Tables", "--section", "WarpStateStats",
                           args.python, profiler, "--ncu"], "ncu.log", deadline.timeout(300, after_profile),
                          cwd=stage)
        benchmark = not args.rehearse and not args.skip_bench
        bench_timeout = deadline.timeout(args.bench_timeout, SUMMARY_MIN)
        if benchmark and bench_timeout < BENCH_START:
            check.skip("benchmark (python -m bench --suite gpu)", f"{bench_timeout} s left under --time-limit")
        elif benchmark:
            # Under a time limit the benchmark stops starting cases in time to finish the one
            # it is in (a Llama-3 step with every provider: ~30 s) and write its table.
            limit = ["--time-limit", str(bench_timeout - 45)] if args.time_limit is not None else []
            check.run("benchmark (python -m bench --suite gpu)",
                      [args.python, "-m", "bench", "--suite", "gpu", "--out", str(out / "bench"), *limit,
                       *args.bench_args.split()], "bench.log", bench_timeout, cwd=stage)
            results_csv, profile_log = out / "bench" / "results.csv", out / "profile.log"
            if results_csv.exists():  # issues #29 and #30's targets, each case of this run against them
                check.run("issue targets (python -m bench.targets)",
                          [args.python, "-m", "bench.targets", str(results_csv),
                           *(["--profile", str(profile_log)] if profile_log.exists() else [])],
                          "targets.md", deadline.timeout(60), cwd=stage)
    san_counts = {tool: sanitizer_errors(results[name][1]) for tool, name in san_logs.items()}
    check.note(gpu_prepare.compiled_since(triton_cache, cached_before))

    summary = write_summary(out, info, check, san_counts, time.time() - started, args.rehearse)
    print(f"gpu-check: summary in {summary}")
    return 0 if all(ok for _, ok, _, _ in check.steps) and all(n == 0 for n in san_counts.values()) else 1


def write_summary(out: Path, info: dict, check: Check, san_counts: dict, seconds: float, rehearse: bool) -> Path:
    lines = [f"# pyembed gpu-check{' (rehearsal, no GPU)' if rehearse else ''}", "",
             f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
             f"- device: {info.get('device', 'none')} (sm_{info.get('capability', '-').replace('.', '')}, "
             f"{info.get('sms', '-')} SMs, {info.get('memory_gib', '-')} GiB, {info.get('devices', 0)} visible)",
             f"- torch {info['torch']}, CUDA {info['cuda']}, Triton {info['triton']}, Python {info['python']}",
             f"- total time: {seconds:.0f} s", "", "| step | result | time | log |", "|---|---|---|---|"]
    lines += [f"| {name} | {'ok' if ok else '**FAILED**'} | {sec:.0f} s | {log} |" for name, ok, sec, log in check.steps]
    lines += [f"| {name} | skipped: {why} | - | - |" for name, why in check.skipped]
    lines += [""] + [f"- {line}" for line in check.notes] if check.notes else []
    counts = junit_counts(out / "junit.xml")
    if counts:
        passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
        lines += ["", f"Tests: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
                      f"{counts['skipped']} skipped (junit.xml)"]
        lines += [f"- {f}" for f in junit_failures(out / "junit.xml")]
        lines += ["", "## Test time (junit.xml)", ""] + junit_seconds(out / "junit.xml")
    if san_counts:
        lines += ["", "compute-sanitizer errors: " + ", ".join(
            f"{tool} {'?' if n is None else n}" for tool, n in san_counts.items())]
    profile = out / "profile.log"
    if profile.exists():
        lines += ["", "## Profile (profile.log: host us per call, medians, GPU ops per call)", ""]
        lines += [f"- {line}" for line in profile.read_text().splitlines()
                  if re.match(r"(\d+x\d+ .*: fwd |host |sort |forward |the gradient table)", line)]
    model = out / "model.log"
    if model.exists():  # markdown tables
        lines += ["", "## The input layer in a model (model.log: python -m bench.model)", ""]
        lines += [line for line in model.read_text().splitlines() if line.startswith(("|", "The input layer"))]
    for log in ("compiled-host.log", "compiled-host-threads.log", "compiled-host-static-launch.log"):
        compiled = out / log
        if compiled.exists():
            lines += ["", f"## Compiled host time ({log})", "", "```", compiled.read_text().strip(), "```"]
    tables = sorted((out / "bench").glob("*.md")) if (out / "bench").exists() else []
    for table in tables:
        lines += ["", f"## Benchmark ({table.name})", "", table.read_text()]
    targets = out / "targets.md"
    if targets.exists():
        lines += ["", "## Issue targets (targets.md: python -m bench.targets)", "", targets.read_text()]
    path = out / "summary.md"
    path.write_text("\n".join(lines) + "\n")
    return path


if __name__ == "__main__":
    sys.exit(main())
