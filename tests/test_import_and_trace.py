"""`import pyembed` stays cheap (Triton and Inductor are imported when the triton backend
is first used), and torch.compile still sees the Triton forward kernel itself, as
torch.library.triton_op would give it. Both in subprocesses: TRITON_INTERPRET, which the
test session sets on machines without a GPU, must be unset here."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed")
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _run(code: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_pyembed_imports_neither_triton_nor_inductor():
    out = _run("import sys, torch, pyembed\n"
               "print(sorted(m for m in ('triton', 'torch._inductor', 'matplotlib') if m in sys.modules))")
    assert out.strip() == "[]", out


def test_compiled_graph_holds_the_triton_kernel_not_an_opaque_call():
    # AOTAutograd's functionalisation (what torch.compile runs) on fake CUDA tensors: the
    # forward graph must call the Triton kernel through triton_kernel_wrapper_functional.
    out = _run(
        "import torch, pyembed\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from functorch.compile import aot_function\n"
        "graphs = []\n"
        "def keep(gm, _):\n"
        "    graphs.append(gm.code)\n"
        "    return gm\n"
        "f = lambda ids, w: torch.ops.pyembed.triton_forward(ids, w, None, None, 'sinusoidal', 2.0, 0, None, 0.0)\n"
        "with FakeTensorMode():\n"
        "    ids = torch.empty(2, 8, dtype=torch.long, device='cuda')\n"
        "    w = torch.empty(100, 64, device='cuda')\n"
        "    aot_function(f, fw_compiler=keep)(ids, w)\n"
        "print(graphs[0])\n")
    assert "triton_kernel_wrapper_functional" in out and "pyembed.triton_forward" not in out, out
