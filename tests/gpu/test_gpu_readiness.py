"""What only a real GPU shows (issue: GPU readiness), for every backend that runs on CUDA:
fp64 scalars, tensors on a non-current device, misaligned views, int32 ids, unchecked
out-of-range ids, CUDA-graph capture of forward + dense backward (by hand and under
torch.compile(mode="reduce-overhead")), and bitwise determinism with a hot row. Each
compares with the float64 reference computed on the CPU, or with eager runs."""

import copy
import math
import re

import pytest
import torch

import pyembed
from pyembed import dispatch
from test_host_sync import COMPILED_ROUTES

CUDA_BACKENDS = [b for b in dispatch.backends_for("cuda") if b != "reference"] if torch.cuda.is_available() else []
pytestmark = pytest.mark.parametrize("backend", CUDA_BACKENDS or ["none built"])


def _check_backend(backend):
    assert backend in CUDA_BACKENDS, "no CUDA backend (cuda, triton) can run on this GPU"


def _reference(ids, weight, pos_weight=None, dout=None, **kwargs):
    """(out, dW, dP) of the float64 reference on CPU copies."""
    w = weight.detach().cpu().double().requires_grad_()
    p = None if pos_weight is None else pos_weight.detach().cpu().double().requires_grad_()
    pos_ids = kwargs.pop("position_ids", None)
    out = pyembed.fused_embedding(ids.cpu(), w, p, backend="reference",
                                  position_ids=None if pos_ids is None else pos_ids.cpu(), **kwargs)
    if dout is None:
        return out.detach(), None, None
    out.backward(dout.cpu().double())
    return out.detach(), w.grad, None if p is None else p.grad


def _run(backend, ids, weight, pos_weight=None, dout=None, **kwargs):
    w = weight.detach().clone().requires_grad_()
    p = None if pos_weight is None else pos_weight.detach().clone().requires_grad_()
    out = pyembed.fused_embedding(ids, w, p, backend=backend, **kwargs)
    if dout is None:
        return out.detach(), None, None
    out.backward(dout)
    return out.detach(), w.grad, None if p is None else p.grad


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_float64_tables_are_exact_to_1e_12(backend, pos_encoding):
    # Compiled Triton types Python floats fp32: scale and -ln(10000)/d must arrive as fp64.
    _check_backend(backend)
    g = torch.Generator().manual_seed(0)
    dim = 768
    ids = torch.randint(0, 300, (4, 200), generator=g).cuda()
    weight = torch.randn(300, dim, generator=g, dtype=torch.float64).cuda()
    pos_weight = torch.randn(256, dim, generator=g, dtype=torch.float64).cuda() if pos_encoding == "learned" else None
    dout = torch.randn(4, 200, dim, generator=g, dtype=torch.float64).cuda()
    kwargs = dict(pos_encoding=pos_encoding, scale=math.sqrt(dim) / 3, offset=5)
    got = _run(backend, ids, weight, pos_weight, dout, **kwargs)
    want = _reference(ids, weight, pos_weight, dout, **kwargs)
    for a, b in zip(got, want):
        if b is not None:
            torch.testing.assert_close(a.cpu(), b, rtol=1e-12, atol=1e-12)


def test_tensors_on_a_device_that_is_not_current(backend):
    _check_backend(backend)
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (tensors on cuda:1 while cuda:0 is current)")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 100, (4, 64), generator=g)
    weight, pos_weight = torch.randn(100, 128, generator=g), torch.randn(64, 128, generator=g)
    dout = torch.randn(4, 64, 128, generator=g)
    want = _reference(ids, weight, pos_weight, dout, scale=2.0)
    with torch.cuda.device(0):
        for sparse in (False, True):
            got = _run(backend, ids.to("cuda:1"), weight.to("cuda:1"), pos_weight.to("cuda:1"), dout.to("cuda:1"),
                       scale=2.0, sparse=sparse)
            assert got[0].device == torch.device("cuda:1") and got[1].device == torch.device("cuda:1")
            for a, b in zip(got, want):
                torch.testing.assert_close(a.to_dense().cpu().double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.25], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_forward_and_backward_on_a_busy_side_stream(backend, sparse, dropout):
    # PyTorch's own nn tests run on a non-default stream (NNTestCase): autograd runs a
    # node's backward on the stream its forward ran on. The dense gradient's node of the
    # C++ backends is built by hand (csrc/autograd.cpp); were its kernels, or the Python
    # kernels' of triton's Function, launched on the default stream instead, they would
    # read the gradient below before the side stream, held by a sleep, has written it.
    _check_backend(backend)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (4, 256), generator=g)
    weight, pos_weight = torch.randn(500, 64, generator=g), torch.randn(256, 64, generator=g)
    dout = torch.randn(4, 256, 64, generator=g)
    kwargs = dict(pos_encoding="learned", scale=2.0, sparse=sparse, dropout_p=dropout)
    side = torch.cuda.Stream()
    torch.use_deterministic_algorithms(True)  # the two runs below compared bit for bit
    try:
        with torch.cuda.stream(side):
            w, p = weight.cuda().requires_grad_(), pos_weight.cuda().requires_grad_()
            ids_gpu, dout_gpu = ids.cuda(), dout.cuda()
            cuda_gen = torch.Generator("cuda").manual_seed(11)
            out = pyembed.fused_embedding(ids_gpu, w, p, generator=cuda_gen, backend=backend, **kwargs)
            torch.cuda._sleep(50_000_000)  # ~25 ms of this stream's time before the gradient exists
            out.backward(dout_gpu * 1.0)
        torch.cuda.synchronize()
        # The same call on the default stream, its dropout mask from the same generator state.
        cuda_gen.manual_seed(11)
        want = _run(backend, ids_gpu, weight.cuda(), pos_weight.cuda(), dout_gpu, generator=cuda_gen, **kwargs)
    finally:
        torch.use_deterministic_algorithms(False)
    for a, b in zip((out.detach(), w.grad, p.grad), want):
        assert torch.equal(a.to_dense(), b.to_dense())
    if dropout == 0.0:  # and both against the float64 reference
        for a, b in zip(want, _reference(ids, weight, pos_weight, dout, **kwargs)):
            torch.testing.assert_close(a.to_dense().cpu().double(), b.to_dense(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_misaligned_views_int32_ids_and_position_ids(backend, dtype):
    # Tables and gradients starting 1 element past a 16-byte boundary: the kernels must
    # fall back from 16-byte vector accesses, not fault or read the wrong bytes.
    _check_backend(backend)
    g = torch.Generator().manual_seed(2)
    vocab, dim, pos_rows = 200, 256, 96
    ids = torch.randint(0, vocab, (3, 80), generator=g, dtype=torch.int32)
    position_ids = torch.randint(0, pos_rows, (3, 80), generator=g)

    def misaligned(*shape):
        flat = torch.randn(math.prod(shape) + 1, generator=g).to(dtype).cuda()
        view = flat[1:].view(*shape)
        assert view.data_ptr() % 16 != 0
        return view

    weight, pos_weight, dout = misaligned(vocab, dim), misaligned(pos_rows, dim), misaligned(3, 80, dim)
    got = _run(backend, ids.cuda(), weight, pos_weight, dout, scale=1.5, position_ids=position_ids.cuda())
    want = _reference(ids, weight.float(), pos_weight.float(), dout.float(), scale=1.5, position_ids=position_ids)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(got, want):
        torch.testing.assert_close(a.cpu().double(), b.to(dtype).double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pos_encoding", ["none", "learned", "sinusoidal"])
def test_unchecked_out_of_range_ids_give_zero_rows_without_a_fault(backend, pos_encoding):
    _check_backend(backend)
    weight = torch.randn(50, 64, device="cuda")
    pos_weight = torch.randn(16, 64, device="cuda") if pos_encoding == "learned" else None
    ids = torch.tensor([[0, 50, -1, 49, 2**40, -2**40]], device="cuda")
    out = pyembed.fused_embedding(ids, weight, pos_weight, pos_encoding=pos_encoding, validate=False, backend=backend)
    torch.cuda.synchronize()  # a fault would surface here
    assert not out[0, [1, 2, 4, 5]].any()
    good = pyembed.fused_embedding(ids[:, [0, 3]], weight, pos_weight, pos_encoding=pos_encoding,
                                   position_ids=None if pos_encoding == "none" else torch.tensor([[0, 3]], device="cuda"),
                                   backend="reference")
    torch.testing.assert_close(out[0, [0, 3]], good[0], rtol=1e-5, atol=1e-5)
    # validate="sync" raises the CPU's IndexError in the call and leaves the context usable.
    with pytest.raises(IndexError, match="max id 1099511627776"):
        pyembed.fused_embedding(ids, weight, pos_weight, pos_encoding=pos_encoding, validate="sync", backend=backend)
    assert pyembed.fused_embedding(ids[:, :1], weight, backend=backend).isfinite().all()


@pytest.mark.parametrize("pos_encoding", ["none", "learned", "sinusoidal"])
def test_default_check_runs_in_the_kernel_and_reports_at_the_next_call(backend, pos_encoding):
    """validate=True on a GPU: no host sync; the bad ids get zero rows, the kernel writes
    the host-mapped error record, and the next forward on the device raises IndexError
    (one of the ids and V in the message); the context stays usable."""
    _check_backend(backend)
    pyembed.check_errors("cuda")  # nothing left over from another test
    weight = torch.randn(50, 64, device="cuda")
    pos_weight = torch.randn(16, 64, device="cuda") if pos_encoding == "learned" else None
    ids = torch.tensor([[0, 50, 49, 2**40]], device="cuda")
    out = pyembed.fused_embedding(ids, weight, pos_weight, pos_encoding=pos_encoding, backend=backend)
    torch.cuda.synchronize()
    assert not out[0, [1, 3]].any()
    unchecked = pyembed.fused_embedding(ids, weight, pos_weight, pos_encoding=pos_encoding, validate=False,
                                        backend=backend)
    assert torch.equal(out, unchecked)
    with pytest.raises(IndexError, match=r"earlier call on cuda:\d: id (50|1099511627776), .*V=50"):
        pyembed.fused_embedding(ids[:, :1], weight, backend=backend)
    assert pyembed.fused_embedding(ids[:, :1], weight, backend=backend).isfinite().all()  # raised once
    if pos_encoding != "none":
        positions = torch.tensor([[0, 1, -4, 2]], device="cuda")
        pyembed.fused_embedding(ids[:, [0, 2, 0, 2]], weight, pos_weight, pos_encoding=pos_encoding,
                                position_ids=positions, backend=backend)
        with pytest.raises(ValueError, match="position -4"):
            pyembed.check_errors("cuda")
    pyembed.check_errors("cuda")  # cleared: nothing more to raise


@pytest.mark.parametrize("route", COMPILED_ROUTES)
def test_compiled_default_check_reports_at_the_next_call_on_every_route(backend, route):
    """tests/test_host_sync.py's test of the compiled routes (there with the check forced
    into interpreted kernels on CPU tensors), on the GPU: each route's graph checks in its
    kernel; the next compiled call raises what it recorded where pyembed's op reads the
    record before its launch (every `cuda` route), else pyembed.check_errors() does (a
    `triton` kernel Inductor launches itself runs no host code of ours: README, Bad input)."""
    _check_backend(backend)
    pyembed.check_errors("cuda")
    torch._dynamo.reset()
    kwargs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in COMPILED_ROUTES[route].items()}
    weight = torch.randn(10, 8, device="cuda", requires_grad=True)
    pos_weight = torch.randn(6, 8, device="cuda") if kwargs.pop("learned", False) else None
    layer = torch.compile(lambda ids: pyembed.fused_embedding(ids, weight, pos_weight, backend=backend, **kwargs),
                          fullgraph=True)
    layer(torch.tensor([[1, 12, 3]], device="cuda")).sum().backward()
    torch.cuda.synchronize()  # the record written (the next call reads it without waiting)
    try:
        layer(torch.tensor([[1, 4, 3]], device="cuda"))
    except IndexError as error:
        raised = error
    else:
        assert backend == "triton", "the cuda op reads the record before its launch"
        torch.cuda.synchronize()
        with pytest.raises(IndexError) as info:
            pyembed.check_errors("cuda")
        raised = info.value
    assert re.search(r"id 12, .*V=10", str(raised)), str(raised)
    torch.cuda.synchronize()
    pyembed.check_errors("cuda")  # raised once, then cleared
    torch._dynamo.reset()


@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_program_checks_in_the_call_and_decomposes_to_eagers_output(backend, strict):
    """tests/test_dropin.py's export tests on the GPU, where the default check runs in the
    kernel: the exported program holds no error-record address (another process's kernel
    would get a stray pointer) and refuses a bad id in the call; decomposed
    (pyembed.decompositions) it is ATen ops giving eager's output; its module trains as the
    model does; torch.jit.trace records the `cuda` op with its check and refuses `triton`."""
    _check_backend(backend)
    from pyembed import checks

    pyembed.check_errors("cuda")
    torch.manual_seed(13)
    model = pyembed.EmbeddingLayer(50, 64, 32, scale_embeddings=True, backend=backend).cuda().eval()
    ids = torch.randint(0, 50, (2, 8), device="cuda")
    bad = ids.clone()
    bad[1, 3] = 70
    address = checks.error_record_address(torch.device("cuda", torch.cuda.current_device()))
    program = torch.export.export(model, (ids,), strict=strict)
    assert str(address) not in program.graph_module.code
    with pytest.raises(IndexError, match="max id 70"):
        program.module()(bad)
    decomposed = program.run_decompositions(pyembed.decompositions())
    assert "pyembed" not in decomposed.graph_module.code
    torch.testing.assert_close(decomposed.module()(ids), model(ids), rtol=0, atol=0)
    # The exported module trains as the model does (PT2E quantization-aware training).
    trained = torch.export.export(copy.deepcopy(model), (ids,), strict=strict).module()
    dout = torch.randn(2, 8, 64, device="cuda")
    trained(ids).backward(dout)
    model(ids).backward(dout)
    exported_params = dict(trained.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(exported_params[name].grad, param.grad, rtol=0, atol=0)
    if backend == "triton":
        with pytest.raises(NotImplementedError, match="torch.jit.trace cannot record the triton backend"):
            torch.jit.trace(model, ids)
    else:
        traced = torch.jit.trace(model, ids)
        assert str(address) not in str(traced.graph)
        torch.testing.assert_close(traced(ids), model(ids), rtol=0, atol=0)
        with pytest.raises(RuntimeError, match="max id 70"):
            traced(bad)
    pyembed.check_errors("cuda")  # no kernel recorded anything


@pytest.mark.parametrize("seq_len", [256, 2048])  # 4 x 2048 tokens: the tile sorts' 16 tiles
def test_forward_and_dense_backward_capture_in_a_cuda_graph(backend, seq_len):
    _check_backend(backend)
    torch.manual_seed(3)
    ids = torch.randint(0, 64, (4, seq_len), device="cuda")
    ids[:, :100] = 5  # a hot row: its per-chunk pieces are captured too
    weight = torch.randn(64, 128, device="cuda", requires_grad=True)
    pos_weight = torch.randn(seq_len, 128, device="cuda", requires_grad=True)
    dout = torch.randn(4, seq_len, 128, device="cuda")

    def step():  # the default validate=True: the range check is in the kernel, so it is captured too
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend=backend)
        out.backward(dout)
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles, allocator pools) off the capture
        for _ in range(2):
            weight.grad = pos_weight.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    weight.grad = pos_weight.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    ids.copy_(torch.randint(0, 64, ids.shape, device="cuda"))  # new data, same buffers
    dout.copy_(torch.randn_like(dout))
    weight.grad.zero_(), pos_weight.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = _reference(ids, weight, pos_weight, dout, scale=2.0)
    for a, b in zip((static_out, weight.grad, pos_weight.grad), want):
        torch.testing.assert_close(a.cpu().double(), b, rtol=1e-5, atol=1e-5)
    pyembed.check_errors("cuda")  # good ids: nothing recorded
    ids[1, 7] = 64  # a bad id in a replay: recorded by the captured kernel
    graph.replay()
    with pytest.raises(IndexError, match="id 64, .*V=64"):
        pyembed.check_errors("cuda")


def test_a_fused_optimizer_refuses_a_cuda_graph_capture(backend):
    # Its update takes lr and the bias correction from the host each backward: a replay would
    # repeat the captured ones. The capture raises pyembed's error, the table unchanged.
    _check_backend(backend)
    weight = torch.nn.Parameter(torch.randn(64, 128, device="cuda"))
    pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [weight], {"lr": 0.1, "fused": True})
    ids = torch.randint(0, 64, (4, 32), device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the capture (Triton compiles, the state is made)
        pyembed.fused_embedding(ids, weight, backend=backend).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    before = weight.detach().clone()
    with pytest.raises(ValueError, match="CUDA graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            pyembed.fused_embedding(ids, weight, backend=backend).sum().backward()
    torch.cuda.synchronize()
    assert torch.equal(weight.detach(), before)


def test_compiled_reduce_overhead_captures_forward_and_dense_backward(backend):
    _check_backend(backend)
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(4)
    weight = torch.randn(1000, 128, device="cuda", requires_grad=True)
    pos_weight = torch.randn(64, 128, device="cuda", requires_grad=True)

    def layer(ids):  # the default validate=True: checked inside the kernel, no sync, graphs captured
        return pyembed.fused_embedding(ids, weight, pos_weight, scale=math.sqrt(128), backend=backend)

    compiled = torch.compile(layer, mode="reduce-overhead", fullgraph=True)
    for step in range(4):  # recorded, then replayed
        ids = torch.randint(0, 1000, (8, 64), device="cuda")
        dout = torch.randn(8, 64, 128, device="cuda")
        weight.grad = pos_weight.grad = None
        out = compiled(ids)
        out.backward(dout)
        got = (out.detach().clone(), weight.grad.clone(), pos_weight.grad.clone())
        weight.grad = pos_weight.grad = None
        expected = layer(ids)
        expected.backward(dout)
        for a, b in zip(got, (expected.detach(), weight.grad, pos_weight.grad)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=f"step {step}")
    assert not counters["inductor"].get("cudagraph_skips"), dict(counters["inductor"])


@pytest.mark.parametrize("sparse", [False, True])
def test_backward_is_bitwise_identical_over_three_runs_with_a_hot_row(backend, sparse):
    _check_backend(backend)
    torch.manual_seed(5)
    ids = torch.randint(0, 1000, (8, 2048), device="cuda")
    ids[:, :1500] = 17  # 12000 uses of one row: 94 chunks' pieces
    dout = torch.randn(8, 2048, 256, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16)
    pos_weight = torch.randn(2048, 256, device="cuda", dtype=torch.bfloat16)
    torch.use_deterministic_algorithms(True)
    try:
        # On `triton` the dense third run replays the launch plan its second bound
        # (pyembed/_triton.py): its bits against the first run's unplanned launches.
        runs = [_run(backend, ids, weight, pos_weight, dout, sparse=sparse) for _ in range(3)]
    finally:
        torch.use_deterministic_algorithms(False)
    for run in runs[1:]:
        for a, b in zip(run, runs[0]):
            assert torch.equal(a.to_dense(), b.to_dense())
    # fp32 accumulation: the hot row's gradient within bf16 rounding of the exact sum.
    exact = dout.double()[ids == 17].sum(0)
    torch.testing.assert_close(runs[0][1].to_dense()[17].double(), exact, rtol=2**-8, atol=1e-2)


def test_direct_op_calls_refuse_tensors_on_another_device(backend):
    _check_backend(backend)
    ids, weight = torch.tensor([[1, 2]]), torch.randn(4, 8, device="cuda")
    dout = torch.randn(1, 2, 8, device="cuda")
    if backend == "triton":
        # The triton ops check nothing themselves (fused_embedding does), and their launches
        # pass addresses, not tensors (kernels/launch.py): a CPU tensor among CUDA ones is
        # declined there, so that Triton's launcher, which checks each tensor's pointer,
        # refuses it -- a ValueError, never a kernel reading host memory. Also once the
        # calls' plans exist (bound at the second call, replayed from the third).
        for _ in range(3):
            torch.ops.pyembed.triton_forward(ids.cuda(), weight, None, None, "none", 1.0, 0, None, 0.0)
            torch.ops.pyembed.triton_backward(dout, ids.cuda(), None, 0, 4, 0, 1.0, None, False, True, False)
        with pytest.raises(ValueError, match="Triton"):
            torch.ops.pyembed.triton_forward(ids, weight, None, None, "none", 1.0, 0, None, 0.0)
        with pytest.raises(ValueError, match="Triton"):
            torch.ops.pyembed.triton_backward(dout, ids, None, 0, 4, 0, 1.0, None, False, True, False)
        torch.cuda.synchronize()  # nothing faulted: the context is usable
        return
    with pytest.raises(ValueError, match="different devices"):
        torch.ops.pyembed.embedding_forward(ids, weight, None, None, "none", 1.0, 0, None, 0.0)
    with pytest.raises(ValueError, match="different devices"):
        torch.ops.pyembed.embedding_backward(torch.randn(1, 2, 8, device="cuda"), ids, None, 0, 4, 0, 1.0, None,
                                             False, True, False)


def test_gradgradcheck_forward_ad_and_per_sample_gradients_on_gpu(backend):
    # tests/test_dropin.py on CUDA tensors: the derivative paths are torch ops around the
    # backend's kernels, and the vmap rules fold samples into one kernel launch.
    _check_backend(backend)
    torch.manual_seed(7)
    ids = torch.randint(0, 9, (3, 5), device="cuda")
    w = torch.randn(9, 4, dtype=torch.float64, device="cuda", requires_grad=True)
    p = torch.randn(8, 4, dtype=torch.float64, device="cuda", requires_grad=True)

    def f(w, p):
        return pyembed.fused_embedding(ids, w, p, scale=1.7, offset=2, padding_idx=5, scale_grad_by_freq=True,
                                       backend=backend)
    assert torch.autograd.gradgradcheck(f, (w, p))
    tangent = torch.randn_like(w)
    _, jvp = torch.func.jvp(lambda w: pyembed.fused_embedding(ids, w, backend=backend), (w.detach(),), (tangent,))
    torch.testing.assert_close(jvp, tangent[ids], rtol=0, atol=0)

    def loss(w, x):
        return pyembed.fused_embedding(x, w, backend=backend).pow(2).sum()
    per_sample = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w.detach(), ids)
    expected = torch.stack([torch.func.grad(loss)(w.detach(), ids[i]) for i in range(3)])
    torch.testing.assert_close(per_sample, expected, rtol=0, atol=0)
