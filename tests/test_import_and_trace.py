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
    # Dynamo either (torch.compiler.disable imports it: the fused-optimizer path makes its wrapper on first use).
    out = _run("import sys, torch, pyembed\n"
               "print(sorted(m for m in ('triton', 'torch._inductor', 'torch._dynamo', 'matplotlib') "
               "if m in sys.modules))")
    assert out.strip() == "[]", out


@pytest.mark.parametrize("op", ["triton_forward", "triton_lookup"])
def test_compiled_graph_holds_the_triton_kernel_not_an_opaque_call(op):
    # AOTAutograd's functionalisation (what torch.compile runs) on fake CUDA tensors: the
    # forward graph must call the Triton kernel through triton_kernel_wrapper_functional --
    # from the forward op, and from the lookup op a compiled plain call is (functionalised
    # into the forward op). (Its backward, the triton_backward op, is traced below; the joint
    # graph needs a CUDA device for autograd's engine.)
    args = {"triton_forward": "None, 0.0", "triton_lookup": "None, False, False, 0"}[op]
    out = _run(
        "import torch, pyembed\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from functorch.compile import aot_function\n"
        "graphs = []\n"
        "def keep(gm, _):\n"
        "    graphs.append(gm.code)\n"
        "    return gm\n"
        f"f = lambda ids, w: torch.ops.pyembed.{op}(ids, w, None, None, 'sinusoidal', 2.0, 0, {args})\n"
        "with FakeTensorMode():\n"
        "    ids = torch.empty(2, 8, dtype=torch.long, device='cuda')\n"
        "    w = torch.empty(100, 64, device='cuda')\n"
        "    aot_function(f, fw_compiler=keep)(ids, w)\n"
        "print(graphs[0])\n")
    assert "triton_kernel_wrapper_functional" in out and "pyembed." not in out, out


# A script's start for tracing a compiled graph on fake CUDA tensors with an sm_90 target
# (what Inductor's mutation analysis of a Triton kernel needs): the graphs land in `graphs`.
SM90_TRACE = (
        "import re, torch, pyembed, triton\n"
        "from triton.backends.compiler import GPUTarget\n"
        "from torch._subclasses.fake_tensor import FakeTensorMode\n"
        "from functorch.compile import aot_function\n"
        "class Sm90:\n"
        "    def get_current_target(self):\n"
        "        return GPUTarget('cuda', 90, 32)\n"
        "triton.runtime.driver.set_active(Sm90())\n"
        "graphs = []\n"
        "def keep(gm, _):\n"
        "    graphs.append(gm.code)\n"
        "    return gm\n"
)


def _traced_backward(batch: int, seq_len: int, num_positions: int, dropout: bool = False) -> tuple[str, list]:
    """The triton dense backward of (batch, seq_len) tokens with num_positions learned
    positions (and the forward's dropout key), under AOTAutograd's functionalisation on
    fake CUDA tensors (sm_90 target for Inductor's mutation analysis): ("traced" or
    "opaque" and whether the graph sorts, the pointers each kernel launch writes)."""
    out = _run(SM90_TRACE +
        f"f = lambda dout, ids, key: torch.ops.pyembed.triton_backward(dout, ids, None, 0, 1000, {num_positions},\n"
        "                                                             2.0, None, False, True, True,\n"
        f"                                                             {'key, 0.1' if dropout else 'None, 0.0'})\n"
        "with FakeTensorMode():\n"
        f"    ids = torch.empty({batch}, {seq_len}, dtype=torch.long, device='cuda')\n"
        f"    dout = torch.empty({batch}, {seq_len}, 64, device='cuda')\n"
        "    key = torch.empty(2, dtype=torch.long, device='cuda')\n"
        "    aot_function(f, fw_compiler=keep)(dout, ids, key)\n"
        "print('opaque' if 'pyembed.triton_backward' in graphs[0] else 'traced', 'aten.sort' in graphs[0])\n"
        "print(re.findall(r'tensors_to_clone = (\\[[^\\]]*\\])', graphs[0]))\n")
    first, clones = out.strip().splitlines()
    return first, [eval(names) for names in eval(clones)]


@pytest.mark.parametrize("batch, seq_len, sort", [(4, 512, "tile sort"), (8, 4096, "torch's sort")])
def test_compiled_backward_holds_the_triton_kernels_and_copies_no_input(batch, seq_len, sort):
    # The dense backward as the forward: the graph holds each Triton kernel (and torch's sort
    # past the tile sort's 2^14 tokens) -- what Inductor can schedule and fuse -- not an
    # opaque pyembed op, and each kernel is found to write only its outputs (the output
    # gradient and the ids are never copied; a kernel helper that took the ids' pointer and
    # fed a store would make Inductor copy them, kernels/embedding.py _sorted_key). The
    # sort (the tile sort's words and bounds, then keys and tokens; or the sort's inputs and
    # bounds), the chunks (segment bounds and first tokens, long segments' pieces), the
    # table's rows and the positions' (one kernel): no input (dout, ids, the sorted keys) is
    # written. Every position is in the table, so the chunks also mark the tokens used once,
    # whose rows the positions' programs write: the finish kernel only reads those marks.
    # (~4 s of tracing each since the binary searches are loops, not unrolled steps: ~45 s
    # before; the forms with the dropout key, which only load more, are traced in the short
    # batch's single kernel below.)
    sorts = ([["words_ptr", "bounds_ptr"], ["sorted_ptr", "order_ptr"]] if sort == "tile sort" else
             [["out_ptr", "bounds_ptr"]])
    assert _traced_backward(batch, seq_len, seq_len + 88) == (f"traced {sort != 'tile sort'}", [
        *sorts, ["bounds_ptr", "partials_ptr"], ["out_ptr", "pos_out_ptr"]])


@pytest.mark.parametrize("dropout", [False, True])
def test_compiled_short_batch_backward_is_one_kernel_writing_only_the_gradients(dropout):
    # At most 32 tokens: no sort in the graph, one kernel -- the few-token one, writing the
    # table's rows and the positions' -- found to write only its outputs; with the forward's
    # dropout key the same (the kernel reads the key and dout through its mask).
    assert _traced_backward(1, 8, 64, dropout) == ("traced False", [["out_ptr", "pos_out_ptr"]])


def test_compiled_kernel_with_the_range_check_writes_no_input_tensor():
    # The in-kernel range check (validate=True on a GPU) stores into the error record
    # through an integer address. Inductor's mutation analysis of the kernel (it needs a
    # target: sm_90, as the AOT tests use) must still find that only the output is written,
    # or functionalisation would copy the ids and the whole table on every call.
    out = _run(SM90_TRACE +
        "f = lambda ids, w, p, pos: torch.ops.pyembed.triton_forward(ids, w, p, pos, 'learned', 2.0, 0, None, 0.0,\n"
        "                                                              0, 0, 140000000000000)\n"
        "with FakeTensorMode():\n"
        "    ids = torch.empty(2, 8, dtype=torch.long, device='cuda')\n"
        "    pos = torch.empty(2, 8, dtype=torch.long, device='cuda')\n"
        "    w, p = torch.empty(100, 64, device='cuda'), torch.empty(8, 64, device='cuda')\n"
        "    aot_function(f, fw_compiler=keep)(ids, w, p, pos)\n"
        "print(re.search(r'tensors_to_clone = \\[[^\\]]*\\]', graphs[0]).group(0))\n"
        "print('CHECK_RANGES' in graphs[0] and \"'CHECK_RANGES': True\" in graphs[0])\n")
    assert out.split("\n")[:2] == ["tensors_to_clone = ['out_ptr']", "True"], out
