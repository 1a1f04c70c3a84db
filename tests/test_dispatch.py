"""Backend choice (DESIGN §2), op registration (opcheck, torch.compile) and a
property-based sweep of shapes against eager PyTorch."""

import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings, strategies as st

import pyembed
from pyembed import _ops, dispatch, reference
from helpers import CPU_BACKENDS, NODE_OPTIONS, eager_embedding, lookup_results, make_inputs, run_with_grads
import test_errors


def test_available_backends_lists_reference_first():
    names = pyembed.available_backends()
    assert names[0] == "reference"
    assert set(names) <= {"reference", "cpu", "cuda", "triton"}


def test_import_and_print_backends_in_a_fresh_process():
    out = subprocess.run([sys.executable, "-c", "import pyembed; print(pyembed.available_backends())"],
                         capture_output=True, text=True, check=True)
    assert "'reference'" in out.stdout


def test_auto_picks_the_fastest_available_backend_for_cpu():
    expected = "cpu" if "cpu" in CPU_BACKENDS else "reference"
    assert dispatch.resolve("auto", torch.device("cpu")).name == expected


def test_explicit_unavailable_backend_raises_runtime_error_saying_why():
    missing = [n for n in dispatch.BACKEND_NAMES if n not in CPU_BACKENDS]
    if not missing:
        pytest.skip("every backend runs on CPU in this build")
    ids, weight = torch.tensor([[1, 2]]), torch.randn(4, 8)
    for name in missing:
        with pytest.raises(RuntimeError, match=f"backend '{name}' cannot run on cpu: .+"):
            pyembed.fused_embedding(ids, weight, backend=name)


def test_unknown_backend_is_a_value_error():
    with pytest.raises(ValueError, match="'fastest'"):
        pyembed.fused_embedding(torch.tensor([1]), torch.randn(4, 8), backend="fastest")


def test_environment_variable_overrides_auto(monkeypatch):
    ids, weight = torch.tensor([[1, 2]]), torch.randn(4, 8)
    monkeypatch.setenv("PYEMBED_BACKEND", "reference")
    assert dispatch.resolve("auto", torch.device("cpu")).name == "reference"
    assert dispatch.resolve("reference", torch.device("cpu")).name == "reference"
    monkeypatch.setenv("PYEMBED_BACKEND", "nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        pyembed.fused_embedding(ids, weight)
    monkeypatch.delenv("PYEMBED_BACKEND")  # read on every call: unset, auto picks by rank again
    expected = "cpu" if "cpu" in dispatch.backends_for("cpu") else "reference"
    assert dispatch.resolve("auto", torch.device("cpu")).name == expected
    os.environ["PYEMBED_BACKEND"] = "reference"  # as a script sets it, not through monkeypatch
    try:
        assert dispatch.resolve("auto", torch.device("cpu")).name == "reference"
    finally:
        del os.environ["PYEMBED_BACKEND"]
    assert dispatch.resolve("auto", torch.device("cpu")).name == expected


@pytest.mark.parametrize("backend", ["auto"] + [b for b in CPU_BACKENDS if b == "cpu"])
def test_compiled_graphs_choose_their_backend_when_traced_and_survive_the_environment_changing(backend,
                                                                                               monkeypatch):
    # A compiled model keeps its graphs while a program sets environment variables (loggers,
    # launchers, tokenizers do): resolve()'s environment read, traced, had Dynamo guard on
    # os.environ's length, and every variable set recompiled each graph holding a pyembed
    # call -- past the recompile limit, eagerly. PYEMBED_BACKEND counts where a graph is
    # traced, as Dynamo reads os.environ (no guard on it): the next traced graph takes it; a
    # backend asked for by name stays.
    import torch._dynamo.testing

    layer = pyembed.FusedEmbedding(10, 8, backend=backend)
    ids = torch.tensor([[1, 2, 3]])
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    expected = torch.nn.functional.embedding(ids, layer.weight)
    for name in ("PYEMBED_TEST_UNRELATED_A", "PYEMBED_TEST_UNRELATED_B"):
        torch.testing.assert_close(compiled(ids), expected, rtol=0, atol=0)
        monkeypatch.setenv(name, "1")
    torch.testing.assert_close(compiled(ids), expected, rtol=0, atol=0)
    assert counter.frame_count == 1

    def graph_ops():
        return [str(node.target) for gm in graphs for node in gm.graph.nodes if node.op == "call_function"]

    graphs = []
    monkeypatch.setenv("PYEMBED_BACKEND", "reference")
    torch._dynamo.reset()
    keep = torch.compile(layer, fullgraph=True, backend=lambda gm, _: graphs.append(gm) or gm.forward)
    torch.testing.assert_close(keep(ids), expected, rtol=0, atol=0)
    expected_op = str(dispatch.get("reference" if backend == "auto" else backend).compiled_op).removesuffix(".default")
    assert any(op.startswith(expected_op) for op in graph_ops()), graph_ops()
    torch._dynamo.reset()


@pytest.mark.parametrize("backend, error", [("cuda", RuntimeError), ("fastest", ValueError)])
def test_a_compiled_call_of_a_backend_that_cannot_run_raises_what_the_eager_call_raises(backend, error):
    # (the choice a graph keeps is made outside Dynamo's trace; a refusal is raised in traced
    # code, so the call raises pyembed's own error eagerly, not Dynamo's internal-error wrapper)
    layer = pyembed.FusedEmbedding(10, 4, backend=backend)  # (on CPU tensors: cuda cannot run)
    torch._dynamo.reset()
    with pytest.raises(error, match=f"'{backend}'") as raised:
        torch.compile(layer, backend="aot_eager")(torch.tensor([[1, 2]]))
    assert not isinstance(raised.value, torch._dynamo.exc.TorchDynamoException), type(raised.value)


# (forward, dense backward, sparse backward) ops of each backend that runs on CPU tensors here.
_OPS = {"reference": ("reference_forward", "reference_backward", "reference_sparse_backward"),
        "cpu": ("embedding_forward", "embedding_backward", "embedding_sparse_backward"),
        "triton": ("triton_forward", "triton_backward", "triton_sparse_backward")}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_ops_pass_opcheck(backend):
    ids, weight, pos_weight, dout = make_inputs(2, 5, 7, 8, torch.float32, pos_rows=6)
    position_ids = torch.randint(0, 6, ids.shape)
    fwd, bwd, sparse_bwd = (getattr(torch.ops.pyembed, name) for name in _OPS[backend])
    key = torch.tensor([12345, 678])
    torch.library.opcheck(fwd, (ids, weight, pos_weight, position_ids, "learned", 2.0, 0, None, 0.0))
    torch.library.opcheck(fwd, (ids, weight, None, None, "sinusoidal", 1.0, 3, None, 0.0))
    torch.library.opcheck(fwd, (ids, weight, pos_weight, None, "learned", 2.0, 0, key, 0.25))
    torch.library.opcheck(bwd, (dout, ids, None, 1, 7, 6, 2.0, 3, False, True, True))
    torch.library.opcheck(bwd, (dout, ids, position_ids, 0, 7, 6, 1.0, None, True, True, True))
    torch.library.opcheck(bwd, (dout, ids, position_ids, 0, 7, 6, 1.0, None, False, False, True))
    # With the forward's dropout key (the cuda and triton kernels apply its mask as they read)
    torch.library.opcheck(bwd, (dout, ids, None, 1, 7, 6, 2.0, 3, False, True, True),
                          dict(dropout_key=key, dropout_p=0.25))
    torch.library.opcheck(sparse_bwd, (dout, ids, 7, 2.0, 3, False))
    torch.library.opcheck(sparse_bwd, (dout, ids, 7, 1.0, None, True))
    torch.library.opcheck(sparse_bwd, (dout, ids, 7, 1.0, None, True), dict(dropout_key=key, dropout_p=0.25))


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_cpp_autograd_lookup_passes_opcheck():
    # pyembed::embedding: the C++ backends' lookup with a C++ autograd node (eager calls).
    ids = torch.randint(0, 7, (2, 5))
    weight, pos_weight = torch.randn(7, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.pyembed.embedding, (ids, weight, pos_weight, None, "learned", 2.0, 1, 3, True))
    torch.library.opcheck(torch.ops.pyembed.embedding,
                          (ids, weight, None, torch.randint(0, 9, (2, 5)), "sinusoidal", 1.0, 0, None, False))


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_the_typed_op_calls_take_what_the_ops_take_and_give_what_they_give():
    """pyembed._C's typed calls (what eager Python callers of the C++ backends' ops use) with
    a call written for each op -- positional, by keyword, defaults left out -- return the
    op's result bit for bit, and change a table in place as the op does."""
    from pyembed._extension import _C
    ops = torch.ops.pyembed
    g = torch.Generator().manual_seed(0)
    ids, weight = torch.randint(0, 7, (2, 5), generator=g), torch.randn(7, 8, generator=g)
    pos_weight, dout = torch.randn(6, 8, generator=g), torch.randn(2, 5, 8, generator=g)
    key = torch.tensor([3, 11])
    calls = [
        ("embedding_forward", (ids, weight, pos_weight, None, "learned", 2.0, 0, None, 0.0), {}),
        ("embedding_forward", (ids, weight, None, None, "sinusoidal", 1.0, 1, key, 0.25), dict(sinusoid_dim=16)),
        ("embedding_backward", (dout, ids, None, 1, 7, 6, 2.0, 3, True, True, True), {}),
        ("embedding_backward", (dout, ids, None, 0, 7, 6, 1.0, None, False, True, True),
         dict(dropout_key=key, dropout_p=0.25)),
        ("embedding_touched_rows", (dout, ids, 7, 1.5, 3, True), {}),
        ("embedding_touched_rows", (dout, ids, 7, 1.5, None, False, key, 0.25), {}),
    ]
    for name, args, kwargs in calls:
        expected, got = getattr(ops, name)(*args, **kwargs), getattr(_C, name)(*args, **kwargs)
        for e, t in zip(*((x,) if isinstance(x, torch.Tensor) else x for x in (expected, got))):
            assert torch.equal(e, t), name
    table, state = torch.randn(7, 8, generator=g), [torch.rand(7, 8, generator=g) for _ in range(2)]
    tables, states, before = [table, table.clone()], [state, [s.clone() for s in state]], table.clone()
    rows, values = torch.tensor([1, 4]), torch.randn(2, 8, generator=g)
    hyper = [1e-2, 0.9, 0.999, 1e-8, 0.01, 1.0, 0.0, 0.1, 0.05]  # AdamW at its first step
    ops.optimizer_update(tables[0], *states[0], rows, values, 1, hyper, True)
    _C.optimizer_update(tables[1], *states[1], rows, values, 1, hyper, True)
    assert not torch.equal(tables[0], before)  # updated in place
    assert torch.equal(tables[0], tables[1]) and all(map(torch.equal, states[0], states[1]))


@pytest.mark.parametrize("backend", [b for b in ("triton", "reference") if b in CPU_BACKENDS])
def test_python_compiled_lookups_pass_opcheck(backend):
    # pyembed::triton_lookup / reference_lookup: what a compiled or exported plain call
    # records (a custom op with a registered autograd; triton's functionalised into
    # triton_forward), validate False as its caller passes it (the ranges were checked
    # before, or inside the kernel).
    ids = torch.randint(0, 7, (2, 5))
    weight, pos_weight = torch.randn(7, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    lookup = getattr(torch.ops.pyembed, f"{backend}_lookup")
    torch.library.opcheck(lookup, (ids, weight, pos_weight, None, "learned", 2.0, 1, 3, True, False, 0))
    torch.library.opcheck(lookup, (ids, weight, None, torch.randint(0, 9, (2, 5)), "sinusoidal", 1.0, 0, None, False,
                                   False, 0))


_FLOAT_TABLE_CASES = [c for c in test_errors.CASES
                      if c[0] != "integer weight with positions" and c[0] not in test_errors.PYTHON_TYPE_CASES]


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("case", _FLOAT_TABLE_CASES, ids=[c[0] for c in _FLOAT_TABLE_CASES])
def test_cpp_lookup_refuses_every_bad_input_itself(case):
    # Plain eager calls reach pyembed::embedding with no Python check before it
    # (functional.py's fast path raises the op's errors as pyembed's types), so the op
    # must refuse each bad input of DESIGN §3 by itself, as the same Python class.
    _, build, exc, _ = case
    weight, pos_weight = test_errors._tables()
    kw = build(weight, pos_weight)
    pos_encoding = kw.get("pos_encoding") or ("learned" if kw.get("pos_weight") is not None else "none")
    before = weight.clone()
    with pytest.raises(exc):
        torch.ops.pyembed.embedding(kw["ids"], kw["weight"], kw.get("pos_weight"), kw.get("position_ids"),
                                    pos_encoding, 1.0, kw.get("offset", 0), kw.get("padding_idx"), False, True)
    assert torch.equal(weight, before)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_plain_eager_calls_take_the_cpp_node_and_the_rest_the_python_function():
    ids = torch.tensor([[1, 2, 2], [3, 0, 6]])
    weight, pos_weight = torch.randn(7, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    plain = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu")
    assert plain.grad_fn.name() == "pyembed::EmbeddingBackward"  # built by hand (csrc/autograd.cpp)
    # A sparse gradient: the node torch::autograd::Function builds (EmbeddingFunction).
    for options, node in (({"dropout_p": 0.5}, "pyembed::EmbeddingBackward"), ({"sparse": True}, "EmbeddingFunction"),
                          ({"sparse": True, "dropout_p": 0.5}, "EmbeddingFunction")):
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu", **options)
        assert node in out.grad_fn.name() and "Fused" not in out.grad_fn.name(), options
    with torch.autograd.forward_ad.dual_level():  # forward-mode AD: the Function, which has a jvp
        dual = torch.autograd.forward_ad.make_dual(weight, torch.ones_like(weight))
        out = pyembed.fused_embedding(ids, dual, pos_weight, scale=2.0, backend="cpu", sparse=True)
        assert "FusedEmbeddingFunction" in out.grad_fn.name()
    assert "FusedEmbeddingFunction" in pyembed.fused_embedding(ids, weight, backend="reference").grad_fn.name()
    with torch.inference_mode():  # below autograd: the op's forward alone
        torch.testing.assert_close(pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu"),
                                   plain.detach(), rtol=0, atol=0)
    with torch.no_grad():  # no node is built
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu")
        assert out.grad_fn is None and not out.requires_grad
        torch.testing.assert_close(out, plain.detach(), rtol=0, atol=0)


@pytest.mark.skipif("triton" not in CPU_BACKENDS or "cpu" not in CPU_BACKENDS,
                    reason="needs Triton (interpreted) and the C++ extension")
def test_plain_eager_triton_calls_take_the_cpp_node_with_the_same_results_as_the_python_function(monkeypatch):
    # triton's lookup op is pyembed::embedding's checks and C++ node with triton's forward
    # and backward as its kernels (csrc/pyembed.cpp): the cpu backend's node type, and the
    # same bits as the general route's Python Function running those kernels -- output,
    # dense / sparse gradients, dropout, positions, double backward.
    ids = torch.tensor([[1, 2, 2], [3, 1, 6]])  # row 1 twice, 2 (padding) twice
    weight, pos_weight = torch.randn(7, 8), torch.randn(4, 8)

    def triton(ids, weight, pos_weight, **options):
        return pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton", **options)

    for options in NODE_OPTIONS:
        out = triton(ids, weight.requires_grad_(), pos_weight, **options)
        assert "EmbeddingFunction" in out.grad_fn.name() and "Fused" not in out.grad_fn.name(), options
    fast = [lookup_results(triton, ids, weight, pos_weight, **options) for options in NODE_OPTIONS]
    monkeypatch.setitem(dispatch._registry, "triton", dataclasses.replace(dispatch.get("triton"), autograd_op=None))
    assert "FusedEmbeddingFunction" in triton(ids, weight, pos_weight).grad_fn.name()
    for options, got in zip(NODE_OPTIONS, fast):
        for g, want in zip(got, lookup_results(triton, ids, weight, pos_weight, **options), strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=0, msg=str(options))


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_plain_eager_cpu_calls_give_the_python_functions_bits_through_either_cpp_node(monkeypatch):
    # The cpu backend's C++ nodes -- built by hand for a dense gradient (LookupBackward),
    # torch::autograd::Function's for a sparse one -- against the general route's Python
    # Function running the same ops: output, dense / sparse gradients, dropout, positions,
    # padding, counts, double backward, bit for bit.
    ids = torch.tensor([[1, 2, 2], [3, 1, 6]])  # row 1 twice, 2 (padding) twice
    weight, pos_weight = torch.randn(7, 8), torch.randn(4, 8)

    def cpu(ids, weight, pos_weight, **options):
        return pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu", **options)

    fast = [lookup_results(cpu, ids, weight, pos_weight, **options) for options in NODE_OPTIONS]
    monkeypatch.setitem(dispatch._registry, "cpu", dataclasses.replace(dispatch.get("cpu"), autograd_op=None))
    assert "FusedEmbeddingFunction" in cpu(ids, weight.requires_grad_(), pos_weight).grad_fn.name()
    for options, got in zip(NODE_OPTIONS, fast):
        for g, want in zip(got, lookup_results(cpu, ids, weight, pos_weight, **options), strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=0, msg=str(options))


def test_the_node_passes_its_python_kernels_every_argument_of_the_reference_schemas():
    # The reference backend's own ops as the node's kernels give the reference backend's
    # results through its Python Function: each argument reaches its kernel in the order of
    # reference.embedding_forward (after the output the node allocated: pyembed._triton.node_forward)
    # / _backward / _sparse_backward.
    from pyembed import _extension, reference

    ids = torch.tensor([[1, 2, 2], [3, 1, 6]])  # row 1 twice, 2 (padding) twice
    weight, pos_weight = torch.randn(7, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    _extension._C.set_python_kernels(_node_forward(reference.embedding_forward), reference.embedding_backward,
                                     reference.embedding_sparse_backward)
    try:
        def node(ids, weight, pos_weight, padding_idx=None, scale_grad_by_freq=False, position_ids=None,
                 validate=True, dropout_p=0.0, sparse=False):
            return _extension._C.embedding_python_kernels(
                ids, weight, pos_weight, position_ids, "learned", 2.0, 0 if position_ids is not None else 1,
                padding_idx, scale_grad_by_freq, validate, 0, dropout_p, None, sparse)

        def reference_route(ids, weight, pos_weight, **options):
            offset = 0 if "position_ids" in options else 1
            return pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, offset=offset, backend="reference",
                                           **options)

        for options in NODE_OPTIONS:
            got = lookup_results(node, ids, weight, pos_weight, **options)
            for g, want in zip(got, lookup_results(reference_route, ids, weight, pos_weight, **options), strict=True):
                torch.testing.assert_close(g, want, rtol=0, atol=0, msg=str(options))
    finally:
        _restore_python_kernels()


def _node_forward(forward):
    """A forward of reference.embedding_forward's schema as the node calls its Python forward
    (pyembed._triton.node_forward): the output the node allocated, which must be the
    forward's own shape, dtype and device, then the schema's arguments."""
    def node_forward(out, *arguments):
        result = forward(*arguments)
        assert (out.shape, out.dtype, out.device) == (result.shape, result.dtype, result.device)
        return out.copy_(result)
    return node_forward


def _restore_python_kernels():
    """triton's own kernels back in the node wherever the backend registered them -- on a
    GPU machine too, where it runs only on CUDA tensors (not in CPU_BACKENDS) and the later
    triton@cuda tests of the same process take this node."""
    if "triton" in dispatch._registry:
        from pyembed import _extension, _triton

        _extension._C.set_python_kernels(_triton.node_forward, _triton.backward, _triton.sparse_backward,
                                         _triton.triton_backward, _triton.triton_sparse_backward)


class _Raised(Exception):
    pass


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_an_exception_in_a_python_kernel_reaches_the_caller_as_raised():
    # From the forward (in the call) and from the backward (on autograd's thread, through
    # the engine): the kernel's own exception, not a RuntimeError wrapping it.
    from pyembed import _extension, reference

    def raising(*args):
        raise _Raised("from the kernel")

    ids, weight = torch.tensor([1, 2]), torch.randn(4, 3, requires_grad=True)
    try:
        _extension._C.set_python_kernels(raising, raising, raising)
        with pytest.raises(_Raised, match="from the kernel"):
            _extension._C.embedding_python_kernels(ids, weight, None, None, "none", 1.0, 0, None, False, True, 0)
        _extension._C.set_python_kernels(_node_forward(reference.embedding_forward), raising, raising)
        out = _extension._C.embedding_python_kernels(ids, weight, None, None, "none", 1.0, 0, None, False, True, 0)
        torch.testing.assert_close(out, weight.detach()[ids], rtol=0, atol=0)
        with pytest.raises(_Raised, match="from the kernel"):
            out.sum().backward()
    finally:
        _restore_python_kernels()


class _Doubling(torch.autograd.Function):
    seen_wrapped = []  # whether forward got a functorch wrapper, call by call

    @staticmethod
    def forward(ctx, x, factor):
        _Doubling.seen_wrapped.append(torch._C._functorch.is_functorch_wrapped_tensor(x))
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * 3, None


def test_eager_apply_is_torchs_function_apply():
    # pyembed's plain eager routes call a Function through _autograd.eager_apply (before
    # torch 2.14 the C apply beneath Function.apply's Python): the same output, node and
    # gradient as torch's own apply, and a dead functorch wrapper (a tensor leaked out of a
    # torch.func transform) unwrapped before forward sees it, as torch's apply does.
    from pyembed._autograd import eager_apply

    x = torch.randn(5, requires_grad=True)
    results = []
    for apply in (_Doubling.apply, lambda *args: eager_apply(_Doubling, *args)):
        out = apply(x, 2.0)
        (grad,) = torch.autograd.grad(out.sum(), x)
        results.append((out.detach(), type(out.grad_fn), grad))
    assert results[0][1] is results[1][1] and "Doubling" in results[0][1].__name__
    for got, want in zip(results[1][::2], results[0][::2]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    leaked = []
    torch.func.grad(lambda t: leaked.append(t * 1) or t.sum())(torch.randn(5))
    assert torch._C._functorch.is_functorch_wrapped_tensor(leaked[0])
    _Doubling.seen_wrapped.clear()
    outs = [_Doubling.apply(leaked[0], 2.0), eager_apply(_Doubling, leaked[0], 2.0)]
    assert _Doubling.seen_wrapped == [False, False]
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpp_node_gradient_with_create_graph_keeps_fp32_sums(dtype):
    # create_graph=True records the backward with ATen ops (so it can be differentiated
    # again): the same gradient as the kernel's, still summed in fp32. 4096 copies of one
    # id in bf16 stay within 1% of the exact sum (a bf16 running sum would stall far below).
    ids = torch.cat([torch.full((4096,), 3), torch.arange(8)]).reshape(2, -1)
    weight = torch.randn(8, 16).to(dtype).requires_grad_()
    pos_weight = torch.randn(ids.shape[1], 16).to(dtype).requires_grad_()
    dout = torch.rand(*ids.shape, 16).to(dtype)
    out = pyembed.fused_embedding(ids, weight, pos_weight, scale=1.5, padding_idx=5, backend="cpu")
    plain = torch.autograd.grad(out, (weight, pos_weight), dout, retain_graph=True)
    recorded = torch.autograd.grad(out, (weight, pos_weight), dout.requires_grad_(), create_graph=True)
    assert recorded[0].requires_grad
    exact_w = weight.detach().double().requires_grad_()
    exact_p = pos_weight.detach().double().requires_grad_()
    exact = pyembed.fused_embedding(ids, exact_w, exact_p, scale=1.5, padding_idx=5, backend="reference")
    want = torch.autograd.grad(exact, (exact_w, exact_p), dout.detach().double())
    for got_plain, got_recorded, exact_grad in zip(plain, recorded, want):
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got_recorded.detach().double(), exact_grad, rtol=tol, atol=tol)
        torch.testing.assert_close(got_plain.double(), exact_grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_sparse_op_passes_opcheck(backend):
    # The op torch.compile uses for sparse=True (its backward builds the sparse gradient).
    ids = torch.randint(0, 7, (2, 5))
    weight, pos_weight = torch.randn(7, 8, requires_grad=True), torch.randn(6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.pyembed.sparse_grad_embedding,
                          (ids, weight, pos_weight, None, "learned", 2.0, 0, 3, True, backend, None, 0.0))
    torch.library.opcheck(torch.ops.pyembed.sparse_grad_embedding,
                          (ids, weight, pos_weight, None, "learned", 2.0, 0, 3, False, backend,
                           torch.tensor([12345, 678]), 0.25))


def test_range_check_op_passes_opcheck_and_is_tagged_cudagraph_unsafe():
    ids = torch.randint(0, 7, (2, 5))
    torch.library.opcheck(torch.ops.pyembed.check_ranges, (ids, 7, torch.randint(0, 6, (2, 5)), 6))
    extremes = torch.tensor([0, 6, 0, 5])  # -min id, max id, -min position, max position (pyembed.parallel)
    torch.library.opcheck(torch.ops.pyembed.checked_by_extremes, (ids, extremes, 7, 6))
    with pytest.raises(IndexError, match="max id 7, but the embedding table has V=7"):
        torch.ops.pyembed.checked_by_extremes(ids, torch.tensor([0, 7, 0, 5]), 7, 6)
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip(f"torch {torch.__version__} has no cudagraph_unsafe tag (torch >= 2.8)")
    # The ops that read data back to the host are tagged; the forward and dense backward are not.
    unsafe = torch.Tag.cudagraph_unsafe
    assert unsafe in torch.ops.pyembed.check_ranges.default.tags
    assert unsafe in torch.ops.pyembed.checked_by_extremes.default.tags
    for backend in CPU_BACKENDS:
        fwd, bwd, sparse_bwd = (getattr(torch.ops.pyembed, name).default for name in _OPS[backend])
        assert unsafe in sparse_bwd.tags, backend
        assert unsafe not in fwd.tags and unsafe not in bwd.tags, backend


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_torch_compile_fullgraph_traces_the_layer(backend):
    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(100, 16, 64, scale_embeddings=True, backend=backend)
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    ids = torch.randint(0, 100, (2, 9))
    out = compiled(ids)
    out.pow(2).sum().backward()
    grad = layer.token_embedding.weight.grad.clone()
    layer.zero_grad()
    expected = layer(ids)
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(grad, layer.token_embedding.weight.grad, rtol=0, atol=0)


@pytest.mark.parametrize("options", [{"freezing": True}, {"freezing": True, "cpp_wrapper": True}],
                         ids=["freezing", "freezing+cpp_wrapper"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inductor_inference_options_keep_the_lookup_and_its_check(backend, options):
    # How a CPU model is served compiled: under no_grad with Inductor's freezing (parameters
    # folded in as constants) and often its C++ wrapper (the graph's Python replaced by C++,
    # custom ops called through the dispatcher's C shim). The eager outputs bit for bit, and a
    # bad id still raises -- a RuntimeError through the shim, whose error carries no class (as
    # compiled nn ops' own bounds assert is one); IndexError where Python calls the op.
    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(100, 16, 64, scale_embeddings=True, backend=backend).eval()
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(layer, fullgraph=True, options=options)
        for seed in (1, 2):
            ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(seed))
            torch.testing.assert_close(compiled(ids), layer(ids), rtol=0, atol=0)
        with pytest.raises(RuntimeError if options.get("cpp_wrapper") else IndexError):
            compiled(torch.full((2, 9), 100))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_autograd_runs_the_eager_forwards_backward(backend):
    # An eager forward (the C++ backends' autograd node, triton's Function) whose backward
    # compiled autograd traces (torch._dynamo.compiled_autograd, as torchtitan enables it):
    # the same gradients as the plain backward, bit for bit. (Not fullgraph: compiled
    # autograd runs any C++ custom Function's node eagerly, in a graph break of its own.)
    from torch._dynamo import compiled_autograd

    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(100, 16, 64, scale_embeddings=True, backend=backend)
    ids = torch.randint(0, 100, (2, 9))
    layer(ids).pow(2).sum().backward()
    expected = [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    out = layer(ids)
    with compiled_autograd._enable(torch.compile(backend="aot_eager")):
        out.pow(2).sum().backward()
    for param, grad in zip(layer.parameters(), expected):
        torch.testing.assert_close(param.grad, grad, rtol=0, atol=0)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_compiled_autograd_traces_the_hand_built_nodes_backward_op_into_its_graph():
    # The common call's node (pyembed::EmbeddingBackward, csrc/autograd.cpp) runs its backward
    # on compiled autograd's traced tensors: the backward op is in the graph, not an opaque call.
    from torch._dynamo import compiled_autograd

    graphs = []

    def keep(gm):
        graphs.append(gm.code)
        return torch.compile(gm, backend="aot_eager")

    torch.manual_seed(0)
    weight, pos_weight = torch.randn(100, 16, requires_grad=True), torch.randn(64, 16, requires_grad=True)
    ids = torch.randint(0, 100, (2, 9))
    torch._dynamo.reset()
    out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="cpu")
    assert out.grad_fn.name() == "pyembed::EmbeddingBackward"
    with compiled_autograd._enable(keep):
        out.pow(2).sum().backward()
    assert len(graphs) == 1 and "pyembed.embedding_backward" in graphs[0], graphs
    expected = torch.zeros(100, 16).index_add_(0, ids.reshape(-1), 2 * out.detach().reshape(-1, 16) * 2.0)
    torch.testing.assert_close(weight.grad, expected)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_the_hand_built_node_saves_through_saved_tensor_hooks_and_frees_after_a_backward():
    # What torch::autograd::Function's node did for the op and the hand-built one must too:
    # saved tensors go through torch.autograd.graph's saved-tensor hooks (activation
    # offloading), are freed by a backward unless retain_graph, and a second backward says so.
    ids = torch.tensor([[1, 2, 2], [3, 0, 6]])
    weight = torch.randn(7, 8, requires_grad=True)
    position_ids = torch.tensor([[0, 1, 2], [2, 1, 0]])
    packed = []

    def pack(t):
        packed.append(t)
        return t.clone()

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pyembed.fused_embedding(ids, weight, torch.randn(4, 8, requires_grad=True), position_ids=position_ids,
                                      backend="cpu")
    assert out.grad_fn.name() == "pyembed::EmbeddingBackward"
    assert len(packed) == 2 and torch.equal(packed[0], ids) and torch.equal(packed[1], position_ids)
    out.sum().backward(retain_graph=True)
    once = weight.grad.clone()
    out.sum().backward()
    torch.testing.assert_close(weight.grad, 2 * once, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_a_direct_call_of_the_op_under_forward_ad_or_vmap_is_refused_as_before():
    # pyembed's own calls take the Python Function under forward-mode AD and torch.func; a
    # direct call of pyembed::embedding there is refused as torch::autograd::Function refuses it.
    ids = torch.tensor([[1, 2, 2]])
    weight = torch.randn(7, 8, requires_grad=True)

    def op(w):
        return torch.ops.pyembed.embedding(ids, w, None, None, "none", 1.0, 0, None, False, True)

    with torch.autograd.forward_ad.dual_level():
        with pytest.raises(RuntimeError, match="jvp is not implemented"):
            op(torch.autograd.forward_ad.make_dual(weight, torch.ones_like(weight)))
    with pytest.raises(RuntimeError):  # functorch stops it before the node (with either node)
        torch.func.grad(lambda w: op(w).sum())(weight)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_call_is_one_op_per_direction(backend):
    # What a compiled graph runs, as #29 asks: one op per direction (after the range check).
    # Inference (no_grad) and frozen tables: the forward op alone, no backward graph; a table
    # that wants a gradient: the forward op, and the backward op in the backward graph --
    # with eager's output and gradients, bit for bit. On a C++ backend Dynamo's own graph is
    # the lookup op (pyembed::embedding), which AOTAutograd splits: Dynamo traced none of the
    # general route, whose functions and constants it would guard on every call.
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def traced(layer, ids, grad_mode):
        dynamo_graphs, aot_graphs = [], []

        def keep(gm, _):
            aot_graphs.append(gm)
            return make_boxed_func(gm.forward)

        split = aot_autograd(fw_compiler=keep, bw_compiler=keep)
        torch._dynamo.reset()  # a fresh cache each time: these compiles would pass the recompile limit
        compiled = torch.compile(layer, fullgraph=True,
                                 backend=lambda gm, inputs: dynamo_graphs.append(gm) or split(gm, inputs))
        with torch.set_grad_enabled(grad_mode):
            out = compiled(ids)
            expected = layer(ids)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        if out.requires_grad:
            dout = torch.randn_like(out)
            got = torch.autograd.grad(out, list(layer.parameters()), dout)
            torch.testing.assert_close(got, torch.autograd.grad(expected, list(layer.parameters()), dout), rtol=0,
                                       atol=0)

        def ops(gm):  # a Python custom op is traced as its .default; the checks left out
            kinds = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, torch._ops.HigherOrderOperator)
            return [str(node.target).removesuffix(".default") for node in gm.graph.nodes
                    if isinstance(node.target, kinds) and "check_ranges" not in str(node.target)]
        return ops(dynamo_graphs[0]), [ops(gm) for gm in aot_graphs]

    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(100, 16, 64, scale_embeddings=True, backend=backend)
    ids = torch.randint(0, 100, (2, 9))
    forward_op = _ops._qualname(dispatch.get(backend).forward).replace("::", ".")
    backward_op = _ops._qualname(dispatch.get(backend).backward).replace("::", ".")
    lookup_op = dispatch.get(backend).compiled_op
    for grad_mode, frozen in ((False, False), (True, True), (True, False)):
        layer.requires_grad_(not frozen)
        dynamo_ops, aot_ops = traced(layer, ids, grad_mode)
        assert aot_ops == ([[forward_op], [backward_op]] if grad_mode and not frozen else [[forward_op]]), aot_ops
        if lookup_op is not None:
            assert dynamo_ops == [str(lookup_op).removesuffix(".default")], dynamo_ops


@st.composite
def _calls(draw):
    """A call of fused_embedding drawn over its options: (ids, vocab, dim, pos_weight rows,
    options). Tiny vocabularies force duplicates; sequences and tables may be empty."""
    pos = draw(st.sampled_from([None, "learned", "sinusoidal"]))
    vocab, dim = draw(st.integers(1, 40)), draw(st.integers(0, 40))
    if pos == "sinusoidal":
        dim += dim % 2
    seq_len = draw(st.integers(0, 40))
    shape = draw(st.sampled_from([(seq_len,), (draw(st.integers(1, 4)), seq_len)] if pos else
                                 [(), (seq_len,), (draw(st.integers(1, 4)), seq_len), (2, 3, seq_len)]))
    ids = torch.tensor(draw(st.lists(st.integers(0, vocab - 1), min_size=math.prod(shape),
                                     max_size=math.prod(shape))), dtype=torch.int64).reshape(shape)
    ids = ids.to(draw(st.sampled_from([torch.int32, torch.int64])))
    if ids.dim() == 2 and draw(st.booleans()):
        ids = ids.t().contiguous().t()  # column-major: strided ids
    options = dict(pos_encoding=pos, scale=draw(st.floats(0.1, 10.0)), scale_grad_by_freq=draw(st.booleans()),
                   sparse=draw(st.booleans()), padding_idx=draw(st.none() | st.integers(-vocab, vocab - 1)))
    pos_rows = None
    if pos and draw(st.booleans()):  # given positions, the full shape or broadcast over the batch as HF passes
        position_shape = draw(st.sampled_from([shape, shape[-1:], (1, *shape[-1:])][:3 if len(shape) == 2 else 1]))
        g = torch.Generator().manual_seed(draw(st.integers(0, 99)))  # drawn: a failing example replays
        options["position_ids"] = torch.randint(0, 50, position_shape, generator=g)
        pos_rows = 50
    elif pos:
        options["offset"] = draw(st.integers(0, 5))
        pos_rows = seq_len + options["offset"] + draw(st.integers(0, 2))
    options["dropout_p"] = draw(st.sampled_from([0.0, 0.5]))
    return ids, vocab, dim, pos_rows if pos == "learned" else None, options


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@settings(max_examples=int(os.environ.get("PYEMBED_HYPOTHESIS_EXAMPLES", 60)), deadline=None)
@given(call=_calls(), seed=st.integers(0, 99))
def test_random_calls_match_eager(backend, call, seed):
    """Any drawn call -- shapes (empty, 0-wide tables), id dtypes and strides, positions given
    or offset, padding, scale_grad_by_freq, sparse, dropout -- against nn ops in float64 (every
    backend takes float64 tables: an exact comparison), times the reference's dropout mask
    for the call's key. A sparse gradient is compared dense (nn.Embedding refuses sparse with
    scale_grad_by_freq)."""
    ids, vocab, dim, pos_rows, options = call
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64)
    pos_weight = None if pos_rows is None else torch.randn(pos_rows, dim, generator=g, dtype=torch.float64)
    dout = torch.randn(*ids.shape, dim, generator=g, dtype=torch.float64)
    run = lambda i, w, p, **kw: pyembed.fused_embedding(i, w, p, backend=backend,  # noqa: E731
                                                        generator=torch.Generator().manual_seed(seed), **kw)
    got = run_with_grads(run, ids, weight, pos_weight, dout, **options)
    p = options["dropout_p"]
    key = reference.draw_dropout_key(torch.device("cpu"), torch.Generator().manual_seed(seed))
    kept = reference.dropout_keep(key, ids.numel(), dim, p).reshape(dout.shape) / (1 - p)
    eager_options = dict(options, sparse=False)
    del eager_options["dropout_p"]
    eager = lambda *args, **kw: eager_embedding(*args, **kw) * kept  # noqa: E731
    want = run_with_grads(eager, ids.long(), weight, pos_weight, dout, **eager_options)
    assert got[1].is_sparse == options["sparse"]
    for g, w in zip(got, want):
        if w is not None:
            torch.testing.assert_close(g.to_dense(), w, rtol=1e-12, atol=1e-12)


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
@pytest.mark.parametrize("isa", ["base", "avx2"])
def test_narrower_cpu_kernels_pass_the_parity_suite(isa):
    """The widest build this CPU runs (AVX-512 here) serves this run; the portable build
    (any CPU) and the AVX2 one are checked here, each capped by PYEMBED_CPU_ISA."""
    env = dict(os.environ, PYEMBED_CPU_ISA=isa)
    got = subprocess.run([sys.executable, "-c", "import pyembed; print(pyembed.build_info()['cpu_isa'])"],
                         capture_output=True, text=True, env=env, check=True).stdout.strip()
    if got != isa:
        pytest.skip(f"this CPU cannot run the {isa} kernels (it got {got})")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "cpu",
                           os.path.join(os.path.dirname(__file__), "test_parity.py")],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and "failed" not in proc.stdout


def test_import_without_the_extension_warns_once_and_serves_reference():
    code = (
        "import sys, warnings\n"
        "sys.modules['pyembed._C'] = None  # as if the extension were missing\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pyembed, torch\n"
        "print(len([w for w in caught if 'pyembed._C' in str(w.message)]))\n"
        "print(pyembed.available_backends(), pyembed.build_info()['cpu_built'])\n"
        "out = pyembed.fused_embedding(torch.tensor([[1, 2]]), torch.eye(3))\n"
        "print(out.tolist())\n"
        "try:\n"
        "    pyembed.fused_embedding(torch.tensor([[1]]), torch.eye(3), backend='cpu')\n"
        "except RuntimeError as e:\n"
        "    print('RuntimeError', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "1"
    backends, cpu_built = out[1].rsplit(" ", 1)
    assert cpu_built == "False" and "'reference'" in backends and "'cpu'" not in backends
    assert out[2] == "[[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]]"
    assert out[3].startswith("RuntimeError pyembed: backend 'cpu' cannot run on cpu: pyembed._C could not be loaded")


def test_info_says_why_each_backend_is_unavailable():
    # `python -m pyembed.info` (as xformers.info): every backend either listed as available
    # or with its reason, asked on the device it is for ("no CUDA device is visible", not
    # "the cuda backend takes CUDA tensors, not cpu").
    out = subprocess.run([sys.executable, "-m", "pyembed.info"], capture_output=True, text=True,
                         check=True).stdout
    available = pyembed.available_backends()
    assert f"available backends: {available}" in out
    for name in dispatch.BACKEND_NAMES:
        assert (name in available) != (f"  {name}: unavailable: " in out), out
    if not torch.cuda.is_available():
        (line,) = (line for line in out.splitlines() if line.startswith("  cuda: unavailable: "))
        assert "takes CUDA tensors" not in line, line
        if pyembed.build_info()["cuda_built"]:
            assert line.endswith("no CUDA device is visible"), line


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the C++ extension is not built")
def test_an_extension_built_from_other_sources_warns_once_and_is_not_used(tmp_path):
    # An extension built in place (pip install -e .) goes stale when a git pull or checkout
    # changes csrc/ and nothing rebuilds it: its functions may then take other arguments than
    # the Python passes (an import crashed on set_python_kernels' new ones). A checkout's copy
    # -- this repository's sources, the extension of the pyembed under test (an editable
    # install's, or a staged one's without sources beside it: make gpu-check's) --: as built,
    # it serves; with a C++ file edited, import warns once and the reference backend serves.
    root, package = pathlib.Path(__file__).resolve().parents[1], pathlib.Path(pyembed.__file__).resolve().parent
    (extension,) = package.glob("_C*.so")
    checkout = tmp_path / "checkout"
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(root / "pyembed", checkout / "pyembed", ignore=ignore)
    shutil.copytree(root / "kernels", checkout / "pyembed" / "kernels", ignore=ignore)
    shutil.copytree(root / "csrc", checkout / "csrc")
    shutil.copy(root / "setup.py", checkout)
    (checkout / "pyembed" / extension.name).symlink_to(extension)
    code = (
        "import json, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    import pyembed, torch\n"
        "try:\n"
        "    pyembed.fused_embedding(torch.tensor([[1]]), torch.eye(3), backend='cpu')\n"
        "    error = None\n"
        "except RuntimeError as e:\n"
        "    error = str(e)\n"
        "print(json.dumps(dict(file=pyembed.__file__, backends=pyembed.available_backends(), error=error,\n"
        "                      warnings=[str(w.message) for w in caught if 'pyembed' in str(w.message)],\n"
        "                      out=pyembed.fused_embedding(torch.tensor([[1, 2]]), torch.eye(3)).tolist())))\n"
    )

    def imported() -> dict:
        proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=True)
        return json.loads(proc.stdout.splitlines()[-1])

    as_built = imported()
    assert as_built["file"].startswith(str(checkout)), as_built["file"]
    assert as_built["warnings"] == [] and "cpu" in as_built["backends"] and as_built["error"] is None, as_built
    header = checkout / "csrc" / "common.h"
    header.write_text(header.read_text() + "// an edit since the build\n")
    stale = imported()
    assert len(stale["warnings"]) == 1 and "out of date" in stale["warnings"][0], stale["warnings"]
    assert "pip install --no-build-isolation --no-deps -e ." in stale["warnings"][0]
    assert "cpu" not in stale["backends"] and "reference" in stale["backends"], stale["backends"]
    assert "other C++ sources" in stale["error"], stale["error"]
    assert stale["out"] == as_built["out"] == torch.eye(3)[torch.tensor([[1, 2]])].tolist()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_layer_takes_new_lengths_without_recompiling(backend):
    torch._dynamo.reset()
    torch.manual_seed(1)
    layer = pyembed.EmbeddingLayer(100, 16, 64, pos_encoding="sinusoidal", backend=backend)
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    first = torch.randint(0, 100, (2, 9))
    compiled(first).sum().backward()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for seq_len in (13, 40):
            ids = torch.randint(0, 100, (2, seq_len))
            out = compiled(ids)
            out.sum().backward()
            torch.testing.assert_close(out, layer(ids), rtol=0, atol=0)


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_compiled_decoding_loop_takes_every_offset_in_two_compiles(backend, pos_encoding):
    # Incremental decoding under torch.compile: a new offset every step. Dynamo compiles the
    # first value as a constant and makes the second a symbolic int; an op's int argument
    # specialised it again -- a compile per step, and after the recompile limit (8) every
    # call eager. Eager's outputs and gradients, bit for bit, at every step.
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch.manual_seed(2)
    layer = pyembed.EmbeddingLayer(100, 16, 64, pos_encoding=pos_encoding, backend=backend)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    for step in range(12):
        ids = torch.randint(0, 100, (2, 1))
        out, expected = compiled(ids, offset=step), layer(ids, offset=step)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        dout = torch.randn_like(out)
        got = torch.autograd.grad(out, list(layer.parameters()), dout)
        torch.testing.assert_close(got, torch.autograd.grad(expected, list(layer.parameters()), dout), rtol=0, atol=0)
    assert counter.frame_count == 2


def test_a_new_backend_is_one_register_backend_call(monkeypatch):
    # No name list to edit: a backend registered under a new name can be asked for by name,
    # is listed, and "auto" picks it where its rank is the best (here: before cpu on CPU).
    reference = dispatch.get("reference")
    mine = dataclasses.replace(reference, name="mine", auto_rank={"cpu": -1})
    monkeypatch.setattr(dispatch, "_registry", dict(dispatch._registry))
    monkeypatch.setattr(dispatch, "_resolved", {})
    dispatch.register_backend(mine)
    assert "mine" in dispatch.backends_for("cpu") and "mine" in dispatch.BACKEND_NAMES
    assert dispatch.resolve("auto", torch.device("cpu")) is mine
    ids, weight = torch.tensor([[1, 2]]), torch.randn(4, 8)
    torch.testing.assert_close(pyembed.fused_embedding(ids, weight, backend="mine"), weight[ids])


def test_positional_encoding_codes_agree_with_the_cuda_and_cpu_header():
    header = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "common.h").read_text()
    checks = pyembed.checks
    enum = re.search(r"enum class PosEncoding : int \{([^}]*)\}", header).group(1)
    codes = {name.split("=")[0].strip(): int(name.split("=")[1]) for name in enum.split(",")}
    assert codes == {"kNone": checks.POS_CODES["none"], "kLearned": checks.POS_CODES["learned"],
                     "kSinusoidal": checks.POS_CODES["sinusoidal"]}
