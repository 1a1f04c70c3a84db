"""Test set-up shared by every module.

TRITON_INTERPRET is read when triton is first imported, so it is set here, before any
test imports it: with no GPU, Triton kernels run on CPU tensors under the interpreter
(DESIGN §6).
"""

import os
import pathlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# CI runs the same hypothesis examples every time (a red run must be reproducible);
# local runs explore new ones.
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


ROOT = pathlib.Path(__file__).resolve().parents[1]

# Under pytest-xdist (`make test` runs a worker per core) each worker takes its share of the
# cores for ATen's threads: two workers of two threads each on two cores left each other's
# OpenMP threads waiting at every parallel region's barrier (the CPU backend's training
# test 12 -> 126 s). The kernels' thread-count independence is its own test
# (test_parity's bitwise-identical-across-thread-counts, at 1 and at least 2 threads).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


@pytest.fixture(scope="session")
def once_per_session(tmp_path_factory):
    """``once_per_session(name, compute)``: compute()'s JSON-able result, computed by one
    process of the test session and read back by the others -- pytest-xdist's workers share
    a temporary folder (pytest-xdist's documented recipe, with filelock, which torch brings).
    For a fixture whose work is long and the same on every worker (an nvcc compile of the
    CUDA kernels, the Triton AOT compiles): each worker running it cost ~2 minutes more."""
    import json

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def get(name: str, compute):
        path = root / f"{name}.json"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                path.write_text(json.dumps(compute()))
            return json.loads(path.read_text())
    return get


@pytest.fixture(scope="session")
def emulated():
    """The CUDA backend's kernels and host code compiled by g++ with the host emulation
    header (csrc/cuda/host_emulation.h), as a module for CPU tensors with the ops' schema.
    Built once; ninja keeps it up to date. One folder per torch version, so a venv with
    another torch (make test-compat) neither rebuilds this one nor waits on its lock."""
    from torch.utils.cpp_extension import load

    from pyembed._libstdcxx import link_args

    build_dir = ROOT / "build" / "cuda_emulation" / torch.__version__
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        "pyembed_cuda_emulated",
        [str(ROOT / "tests" / "emulation" / "cuda_emulated.cpp")],
        extra_include_paths=[str(ROOT / "csrc")],
        extra_cflags=["-O2"],
        extra_ldflags=link_args(),
        build_directory=str(build_dir),
    )


@pytest.fixture
def interpreted_launches(monkeypatch):
    """The names of the Triton kernels launched (under TRITON_INTERPRET=1). The interpreter
    runs each kernel with ATen ops of its own, on the host's tensors: they are hidden from
    the recorders, which count the host work around the launches."""
    pytest.importorskip("triton", reason="triton is not installed")
    import triton.runtime.interpreter as interpreter

    launched = []
    launch = interpreter.GridExecutor.__call__

    def unrecorded_launch(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        with torch.utils._python_dispatch._disable_current_modes():
            return launch(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", unrecorded_launch)
    return launched


@pytest.fixture
def interpreted_accesses(monkeypatch):
    """The element addresses the Triton interpreter loads and stores (the lanes a mask
    keeps), to count per tensor afterwards: ``loads(t)``, ``stores(t)``, ``unique_stores(t)``.
    CPU tensors keep their storage under the interpreter, so the addresses are theirs."""
    pytest.importorskip("triton", reason="triton is not installed")
    import numpy as np
    import triton.runtime.interpreter as interpreter

    loads, stores = [], []
    builder = interpreter.InterpreterBuilder
    masked_load, masked_store = builder.create_masked_load, builder.create_masked_store

    def counted_load(self, ptrs, mask, *args):
        loads.append(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.uint64))
        return masked_load(self, ptrs, mask, *args)

    def counted_store(self, ptrs, value, mask, *args):
        stores.append(np.broadcast_to(ptrs.data, mask.data.shape)[mask.data].astype(np.uint64))
        return masked_store(self, ptrs, value, mask, *args)

    monkeypatch.setattr(builder, "create_masked_load", counted_load)
    monkeypatch.setattr(builder, "create_masked_store", counted_store)

    def inside(found, t):
        addresses = np.concatenate(found) if found else np.empty(0, np.uint64)
        start = t.data_ptr()
        return addresses[(addresses >= start) & (addresses < start + t.numel() * t.element_size())]

    class Accesses:
        def clear(self):
            loads.clear(), stores.clear()

        def loads(self, t):
            return inside(loads, t).size

        def stores(self, t):
            return inside(stores, t).size

        def unique_stores(self, t):
            return np.unique(inside(stores, t)).size

    return Accesses()


# `make gpu-check` runs what needs the GPU first and must finish inside one 10-minute call
# on the H100 machine: there the selection by name ("cuda or gpu or triton") also took the
# CPU-only tests with those words (host emulation, AOT compiles, the stand-in driver): 400 s
# ran out with a third of the time in one emulated training test.
CPU_ONLY_MODULES = {"test_cuda_build.py", "test_cuda_emulation.py", "test_triton_aot.py", "test_triton_launch.py",
                    "test_host_sync.py", "test_import_and_trace.py", "test_packaging.py", "test_gpu_check.py"}


def pytest_addoption(parser):
    parser.addoption("--gpu-only", action="store_true",
                     help="only what runs on a GPU: tests/gpu, the '@cuda' parametrisations, and tests named for "
                          "cuda or gpu outside the CPU-only modules (host emulation, AOT compiles)")


def needs_gpu(item) -> bool:
    if item.path.parent.name == "gpu" or "@cuda" in item.nodeid:
        return True
    name = item.name.lower()
    return (item.path.name not in CPU_ONLY_MODULES and "emulat" not in name
            and any(word in name for word in ("cuda", "gpu")))


# The longest GPU tests at 26f0ba6 (H200, 16 workers): started first, one a worker (pytest-xdist
# hands the first tests out one by one), they no longer end the step after the rest have.
# There the 77 s convergence test (now one per backend), the compiled layers' 30 and 14 s
# and reduce-overhead's 19 and 10 s were among the last to start.
LONGEST_GPU_TESTS = ("test_convergence_gpu.py", "test_compiled_layer_has_no_graph_breaks_on_gpu",
                     "test_compiled_reduce_overhead_captures")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--gpu-only"):
        return
    keep, deselected = [], []
    for item in items:
        (keep if needs_gpu(item) else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    keep.sort(key=lambda item: not any(name in item.nodeid for name in LONGEST_GPU_TESTS))  # stable: else in order
    items[:] = keep
