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
