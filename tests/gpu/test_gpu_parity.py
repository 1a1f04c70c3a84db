"""Every backend that runs on CUDA against eager PyTorch on real GPU tensors."""

import contextlib
import dataclasses
import math

import pytest
import torch

import pyembed
from helpers import NODE_OPTIONS, RowQuantized, lookup_results, token_order_ids_and_grad
from pyembed import dispatch


def _cuda_backends():
    return dispatch.backends_for("cuda") if torch.cuda.is_available() else []


def _kernel_backends():
    """pyembed's own GPU kernels, whose sums have a fixed order; the reference backend's
    index_add_ adds with atomics on a GPU, so its bits vary with the layout of the ids."""
    return [b for b in _cuda_backends() if b != "reference"]


@contextlib.contextmanager
def _host_syncs_raise():
    """torch's sync debug mode set to raise at any device->host sync, for the block."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def _kernel_ops(backend):
    """A parametrised test's backend, one test per backend (a failing one does not hide
    the others, as a loop over the backends did on the H100 at 664ac49)."""
    reason = dispatch._why_unavailable(backend, torch.device("cuda"))
    if reason is not None:
        pytest.skip(f"the {backend} backend cannot run on CUDA tensors here: {reason}")
    return dispatch.get(backend)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("pos_encoding", ["none", "learned", "sinusoidal"])
def test_cuda_backends_match_eager(dtype, pos_encoding):
    dim, vocab = 256, 1000
    ids = torch.randint(0, vocab, (4, 128), device="cuda")
    weight = torch.randn(vocab, dim, device="cuda", dtype=dtype)
    pos_weight = torch.randn(128, dim, device="cuda", dtype=dtype) if pos_encoding == "learned" else None
    expected = pyembed.fused_embedding(ids.cpu(), weight.cpu().double(),
                                       None if pos_weight is None else pos_weight.cpu().double(),
                                       pos_encoding=pos_encoding, scale=math.sqrt(dim), backend="reference")
    tol = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1.5e-1}[dtype]
    for backend in _cuda_backends():
        out = pyembed.fused_embedding(ids, weight, pos_weight, pos_encoding=pos_encoding,
                                      scale=math.sqrt(dim), backend=backend)
        torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol, msg=backend)


def test_cuda_backward_is_bitwise_deterministic():
    torch.use_deterministic_algorithms(True)
    try:
        ids = torch.randint(0, 50, (8, 512), device="cuda")
        weight = torch.randn(50, 64, device="cuda", requires_grad=True)
        dout = torch.randn(8, 512, 64, device="cuda")
        for backend in _cuda_backends():
            grads = []
            for _ in range(2):
                weight.grad = None
                pyembed.fused_embedding(ids, weight, backend=backend).backward(dout)
                grads.append(weight.grad.clone())
            assert torch.equal(grads[0], grads[1]), backend
    finally:
        torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("sparse", [False, True])
def test_cuda_gradients_match_the_float64_reference(sparse):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (8, 300), generator=g)
    ids[:, :100] = 5  # a hot row: summed in pieces by the chunks of 128 sorted tokens
    weight = torch.randn(64, 96, generator=g)
    pos_weight = torch.randn(400, 96, generator=g)
    dout = torch.randn(8, 300, 96, generator=g)
    w64, p64 = weight.double().requires_grad_(), pos_weight.double().requires_grad_()
    pyembed.fused_embedding(ids, w64, p64, scale=2.0, offset=7, padding_idx=3, backend="reference").backward(dout.double())
    for backend in _cuda_backends():
        w, p = weight.cuda().requires_grad_(), pos_weight.cuda().requires_grad_()
        out = pyembed.fused_embedding(ids.cuda(), w, p, scale=2.0, offset=7, padding_idx=3, sparse=sparse, backend=backend)
        out.backward(dout.cuda())
        torch.testing.assert_close(w.grad.to_dense().cpu().double(), w64.grad, rtol=1e-5, atol=1e-4, msg=backend)
        torch.testing.assert_close(p.grad.cpu().double(), p64.grad, rtol=1e-5, atol=1e-4, msg=backend)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("dim", [64, 97, 768])
def test_short_batch_gradient_is_the_sorted_paths_bit_for_bit(dtype, dim, backend):
    """A dense gradient of at most 32 tokens is one kernel without the sort (csrc/cuda's
    kFewTokens, kernels.embedding.FEW_TOKENS): the same sums as the sorted path, shown on
    the same tokens behind 40 unused ids (-1), and within fp32 accumulation of float64."""
    g = torch.Generator().manual_seed(dim)
    vocab, num_positions = 50257, 64
    for num_tokens in (1, 7, 32):
        ids = torch.randint(0, vocab, (num_tokens,), generator=g)
        ids[: num_tokens // 3] = 6  # a repeated row
        ids[1:4] = torch.tensor([3, -1, vocab])[: max(num_tokens - 1, 0)]  # the padding row, out-of-range ids
        positions = torch.randint(0, num_positions, (num_tokens,), generator=g)
        dout = torch.randn(num_tokens, dim, generator=g).to(dtype)
        keep = (ids >= 0) & (ids < vocab) & (ids != 3)
        exact = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, ids[keep], dout[keep].double()) * 1.5
        unused = torch.full((40,), -1)
        longer = (torch.cat([torch.randn(40, dim, generator=g).to(dtype), dout]).cuda(), torch.cat([unused, ids]).cuda(),
                  torch.cat([unused, positions]).cuda())
        op = _kernel_ops(backend).backward_op(longer[0])
        dw, dp = op(dout.cuda(), ids.cuda(), positions.cuda(), 0, vocab, num_positions, 1.5, 3, False, True, True)
        dw_sorted, dp_sorted = op(*longer, 0, vocab, num_positions, 1.5, 3, False, True, True)
        assert torch.equal(dw, dw_sorted) and torch.equal(dp, dp_sorted), num_tokens
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(dw.cpu().double(), exact, rtol=tol, atol=tol, msg=str(num_tokens))


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_short_batch_touched_rows_are_the_sorted_paths_bit_for_bit(dtype, backend):
    """The rows the optimizer in the backward and the sparse backward take, for at most 32
    tokens: one kernel without the sort, slot s the s-th smallest used id, the same sums as
    the sorted path (behind 40 unused ids)."""
    g = torch.Generator().manual_seed(11)
    vocab, dim = 50257, 768
    for num_tokens in (1, 7, 32):
        ids = torch.randint(0, vocab, (num_tokens,), generator=g)
        ids[: num_tokens // 3] = 6
        ids[1:4] = torch.tensor([3, -1, vocab])[: max(num_tokens - 1, 0)]
        dout = torch.randn(num_tokens, dim, generator=g).to(dtype)
        used = torch.unique(ids[(ids >= 0) & (ids < vocab) & (ids != 3)])
        longer = (torch.cat([torch.randn(40, dim, generator=g).to(dtype), dout]).cuda(),
                  torch.cat([torch.full((40,), -1), ids]).cuda())
        ops = _kernel_ops(backend)
        for by_freq in (False, True):
            rows, values = ops.touched_rows(dout.cuda(), ids.cuda(), vocab, 1.5, 3, by_freq)
            rows_sorted, values_sorted = ops.touched_rows(*longer, vocab, 1.5, 3, by_freq)
            sparse_rows, sparse_values = ops.sparse_backward(dout.cuda(), ids.cuda(), vocab, 1.5, 3, by_freq)
            u = used.numel()
            assert rows.cpu().tolist() == used.tolist() + [-1] * (num_tokens - u)
            assert torch.equal(rows_sorted[:u], rows[:u]) and torch.equal(values_sorted[:u], values[:u])
            assert torch.equal(sparse_rows, rows[:u]) and torch.equal(sparse_values, values[:u])


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("num_tokens", [1, 8 * 512], ids=["1x1", "8x512"])
def test_learned_positions_gradient_in_the_tables_kernel_is_the_standalone_ones(num_tokens, backend):
    """Learned positions by offset + t are summed by extra blocks of the token table's last
    kernel: bit for bit what the standalone kernel (a frozen token table) writes."""
    g = torch.Generator().manual_seed(12)
    batch = 1 if num_tokens == 1 else 8
    ids = torch.randint(0, 50257, (batch, num_tokens // batch), generator=g).cuda()
    dout = torch.randn(batch, num_tokens // batch, 768, generator=g).cuda()
    op = _kernel_ops(backend).backward_op(dout)
    _, dp = op(dout, ids, None, 3, 50257, 1024, 1.5, None, False, True, True)
    _, dp_alone = op(dout, ids, None, 3, 50257, 1024, 1.5, None, False, False, True)
    assert torch.equal(dp, dp_alone)
    t = num_tokens // batch
    exact = torch.zeros(1024, 768, dtype=torch.float64)
    exact[3:3 + min(t, 1021)] = dout.double().sum(0)[:1021].cpu()
    torch.testing.assert_close(dp.cpu().double(), exact, rtol=1e-5, atol=1e-4)


# (tokens, rows) of the GPU backends' tile sorts (up to 16384 tokens over keys of at most
# 18 bits) and of the library sorts past them (CUB's, torch's; on cuda, PYEMBED_CUDA_SORT=cub
# takes CUB's sort for every size).
TOKEN_ORDER_CASES = [(4096, 50257), (4097, 50257), (12345, 2**17), (16384, 50257), (16384, 200000), (16385, 50257),
                     (16384, 300000)]


@pytest.mark.parametrize("backend", ["cuda", "cuda CUB sort", "triton"])
@pytest.mark.parametrize("num_tokens, vocab", TOKEN_ORDER_CASES, ids=str)
def test_sorted_paths_sum_each_row_in_token_order(num_tokens, vocab, backend, monkeypatch):
    """The sort is stable, so each row's float32 sum adds its tokens in token order, bit
    for bit, in the dense, sparse and touched-rows backwards, int64 and int32 ids, a
    padding row and two out-of-range ids among them (tokens of mixed magnitudes: another
    order gives other bits, tests/helpers.py). The dense gradient gets memory that held NaNs
    (the caching allocator's last block of its size): a row no kernel wrote would show."""
    if backend == "cuda CUB sort":
        backend = "cuda"
        monkeypatch.setenv("PYEMBED_CUDA_SORT", "cub")
    ids_cpu, dout, expected, pad = token_order_ids_and_grad(num_tokens, vocab)
    ops = _kernel_ops(backend)
    dout, used = dout.cuda(), torch.unique(ids_cpu[(ids_cpu >= 0) & (ids_cpu < vocab) & (ids_cpu != pad)])
    for ids in (ids_cpu.cuda(), ids_cpu.int().cuda()):
        torch.full(expected.shape, float("nan"), device="cuda")  # freed at once, its block cached
        dw, _ = ops.backward_op(dout)(dout, ids, None, 0, vocab, 0, 1.0, pad, False, True, False)
        assert torch.equal(dw.cpu(), expected), ids.dtype
        rows, values = ops.sparse_backward(dout, ids, vocab, 1.0, pad, False)
        assert torch.equal(rows.cpu(), used) and torch.equal(values.cpu(), expected[used]), ids.dtype
        rows, values = ops.touched_rows(dout, ids, vocab, 1.0, pad, False)
        u = used.numel()
        assert torch.equal(rows[:u].cpu(), used) and torch.equal(values[:u].cpu(), expected[used]), ids.dtype


# A dense backward's GPU operations at 6000-16384 tokens over GPT-2's table, by backend.
BACKWARD_KERNELS = {"cuda": ("tile_rank_kernel", "merge_tiles_kernel", "chunk_kernel", "finish_segments_kernel"),
                    "triton": ("_tile_rank_kernel", "_merge_tiles_kernel", "_chunk_kernel", "_finish_segments_kernel")}


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("batch, seq_len", [(8, 2048), (3, 2000)], ids=str)
def test_dense_backward_is_four_gpu_operations(backend, batch, seq_len):
    """Issue #30: at most four launches per dense backward at 8x2048 (no memsets, no host
    sync): the tile sort's two (the first setting the sort's inputs), the chunk pass, the
    table's kernel (the learned positions inside it). The library sorts they replace (CUB's,
    torch's) were seven GPU operations each."""
    ops = _kernel_ops(backend)
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, 50257, (batch, seq_len), device="cuda", generator=g)
    dout = torch.randn(batch, seq_len, 768, device="cuda", generator=g)
    call = lambda: ops.backward(dout, ids, None, 0, 50257, seq_len, 1.0, None, False, True, True)  # noqa: E731
    call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dw, dp = call()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(names) == len(BACKWARD_KERNELS[backend]), names
    for kernel in BACKWARD_KERNELS[backend]:
        assert sum(kernel in name for name in names) == 1, names
    exact = torch.zeros(50257, 768, dtype=torch.float64, device="cuda").index_add_(
        0, ids.reshape(-1), dout.reshape(-1, 768).double())
    torch.testing.assert_close(dw.double(), exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dp.double(), dout.double().sum(0), rtol=1e-5, atol=1e-4)


def test_output_of_more_than_2_to_the_31_elements():
    if torch.cuda.get_device_properties(0).total_memory < 12 * 2**30:
        pytest.skip("needs a GPU with at least 12 GiB for a 4 GiB output")
    dim = 1024
    tokens = 2**31 // dim + 7  # the last rows sit past element 2^31
    weight = torch.randn(100, dim, device="cuda", dtype=torch.float16)
    ids = torch.arange(tokens, device="cuda") % 100
    # The kernels' 64-bit offsets are what is tested; the reference backend (plain torch,
    # fp32 intermediates of 8 GiB each) would need ~20 GiB for this shape.
    for backend in _kernel_backends():
        out = pyembed.fused_embedding(ids, weight, validate=False, backend=backend)
        for row in (0, tokens // 2, tokens - 1):
            torch.testing.assert_close(out[row], weight[row % 100], rtol=0, atol=0, msg=backend)
        del out


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_compiled_layer_has_no_graph_breaks_on_gpu(pos_encoding):
    for backend in _cuda_backends():
        torch.manual_seed(0)
        layer = pyembed.EmbeddingLayer(1000, 128, 256, pos_encoding=pos_encoding, scale_embeddings=True,
                                       backend=backend).cuda()
        compiled = torch.compile(layer, fullgraph=True)
        ids = torch.randint(0, 1000, (4, 64), device="cuda")
        out = compiled(ids)
        out.sum().backward()
        grad = layer.token_embedding.weight.grad.clone()
        layer.zero_grad()
        expected = layer(ids)
        expected.sum().backward()
        torch.testing.assert_close(out, expected, msg=backend)
        torch.testing.assert_close(grad, layer.token_embedding.weight.grad, msg=backend)


@pytest.mark.parametrize("backend", _kernel_backends())
def test_compiled_decoding_loop_takes_every_offset_in_two_compiles_on_gpu(backend):
    # tests/test_dispatch.py's decoding loop under Inductor on CUDA tensors: a prefill, then
    # one token a step at a new offset; two compiles in all, eager's outputs.
    from torch._dynamo.testing import CompileCounterWithBackend

    _kernel_ops(backend)
    torch._dynamo.reset()
    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(1000, 128, 256, scale_embeddings=True, backend=backend).cuda()
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, fullgraph=True, backend=counter)
    with torch.no_grad():
        ids = torch.randint(0, 1000, (2, 16), device="cuda")
        torch.testing.assert_close(compiled(ids), layer(ids))
        for offset in range(16, 28):
            ids = torch.randint(0, 1000, (2, 1), device="cuda")
            torch.testing.assert_close(compiled(ids, offset=offset), layer(ids, offset=offset))
    assert counter.frame_count == 2


def test_learned_position_gradient_past_2_to_the_31_elements():
    # dP[t] = sum over b of dout[b, t]: the last batch row starts past element 2^31.
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs a GPU with at least 24 GiB for two 4.4 GB tensors")
    batch, seq_len, dim = 2100, 1024, 1024  # 2.2e9 elements
    ids = torch.zeros(batch, seq_len, dtype=torch.int32, device="cuda")
    weight = torch.zeros(4, dim, device="cuda", dtype=torch.float16)
    dout = torch.zeros(batch, seq_len, dim, device="cuda", dtype=torch.float16)
    dout[-1] = torch.arange(seq_len, device="cuda", dtype=torch.float16)[:, None] % 7
    for backend in _kernel_backends():
        pos_weight = torch.zeros(seq_len, dim, device="cuda", dtype=torch.float16, requires_grad=True)
        pyembed.fused_embedding(ids, weight, pos_weight, validate=False, backend=backend).backward(dout)
        torch.testing.assert_close(pos_weight.grad, dout[-1], rtol=0, atol=0, msg=backend)
        del pos_weight


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_under_cuda_autocast_the_lookup_keeps_its_dtype_and_gradients_as_nn_embedding(dtype, backend):
    """Mixed-precision training (torch.autocast on CUDA): nn.Embedding is on none of
    autocast's cast lists, so its output keeps the table's dtype and the next Linear runs
    in the autocast dtype; pyembed's ops (C++ and Python custom ops) take the same place
    (tests/test_dropin.py shows it on the CPU)."""
    _kernel_ops(backend)
    torch.manual_seed(0)
    ours = pyembed.FusedEmbedding(1000, 64, backend=backend, device="cuda")
    theirs = torch.nn.Embedding(1000, 64, device="cuda")
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    head = torch.nn.Linear(64, 8, device="cuda")
    ids = torch.randint(0, 1000, (4, 128), device="cuda")
    results = []
    for embedding in (ours, theirs):
        with torch.autocast("cuda", dtype=dtype):
            rows = embedding(ids)
            logits = head(rows)
        logits.float().square().sum().backward()
        results.append((rows.dtype, logits.dtype, rows.detach(), embedding.weight.grad))
    (rows_dtype, logits_dtype, rows, grad), expected = results
    assert (rows_dtype, logits_dtype) == (torch.float32, dtype) == expected[:2]
    assert torch.equal(rows, expected[2])
    torch.testing.assert_close(grad, expected[3], rtol=1e-5, atol=1e-5)  # fp32 sums of the same rows, other order


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch", [(8, 512), (2, 8)], ids=["8x512 hot row", "short batch"])
def test_sparse_and_touched_rows_mask_in_their_loads_as_masking_first_does(backend, dtype, batch):
    """The sparse backward and the optimizer's touched rows with the forward's dropout key:
    on the GPU, the same bits as on the gradient masked first (tests/test_dropout.py shows
    it under host emulation and the interpreter). Touched rows past the used ones are -1,
    their values unwritten."""
    ops = _kernel_ops(backend)
    vocab, dim = 50257, 768
    ids = torch.randint(0, vocab, batch, device="cuda")
    if batch[1] > 300:
        ids[:, :300] = 7  # a row of 2400 uses: summed in chunk pieces
    dout = torch.randn(*batch, dim, device="cuda").to(dtype)
    key = torch.tensor([2024, 11], device="cuda")
    n = ids.numel()
    masked = ops.forward(torch.arange(n, device="cuda"), dout.reshape(n, dim), None, None, "none", 1.0, 0, key,
                         0.1).view(dout.shape)
    for op in (ops.sparse_backward, ops.touched_rows):
        rows, values = op(dout, ids, vocab, 1.5, 3, False, key, 0.1)
        expected_rows, expected_values = op(masked, ids, vocab, 1.5, 3, False)
        used = rows >= 0
        assert torch.equal(rows, expected_rows) and torch.equal(values[used], expected_values[used]), op


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("layout", ["8x512 hot row, positions", "short batch", "position_ids", "positions only"])
def test_dropout_backward_masks_in_its_loads_as_masking_first_does(backend, dtype, layout):
    """The GPU backends' dense backward given the forward's dropout key applies the mask
    as it reads dout (csrc/cuda's Dout, kernels' _dout_rows): on the GPU, the same bits as
    the gradient masked by the forward kernel first (ids 0..N-1) and then summed -- as
    tests/test_dropout.py shows under host emulation and Triton's interpreter."""
    ops = _kernel_ops(backend)
    batch, seq_len = {"short batch": (2, 8)}.get(layout, (8, 512))
    vocab, dim = 50257, 768
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda")
    if layout != "short batch":
        ids[:, :300] = 7  # a row of 2400 uses: summed in chunk pieces
    dout = torch.randn(batch, seq_len, dim, device="cuda").to(dtype)
    position_ids = torch.randint(0, seq_len, ids.shape, device="cuda") if layout == "position_ids" else None
    key = torch.tensor([2024, 11], device="cuda")
    n = ids.numel()
    masked = ops.forward(torch.arange(n, device="cuda"), dout.reshape(n, dim), None, None, "none", 1.0, 0, key,
                         0.1).view(dout.shape)
    args = (ids, position_ids, 0, vocab, seq_len, 1.5, 3, False, layout != "positions only", True)
    expected = ops.backward(masked, *args)
    got = ops.backward(dout, *args, dropout_key=key, dropout_p=0.1)
    for a, b in zip(got, expected):
        assert a.shape == b.shape and torch.equal(a, b), layout


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (4, 300), (8, 2048)], ids=["one token", "two tiles", "8x2048"])
def test_dense_backward_from_its_plan_is_its_first_call_bit_for_bit(backend, batch, seq_len):
    """An eager dense backward called again and again with one metadata: from the third call
    the `triton` op replays its plan, the whole call where it is only allocations and launches
    (kernels.launch.LaunchPlan: checked here to be so on CUDA tensors, whose ops the development
    VM cannot see); every call's gradients are the first call's for its inputs, bit for bit,
    and the first is the float64 reference's within fp32 rounding."""
    ops = _kernel_ops(backend)
    g = torch.Generator().manual_seed(5)
    vocab, dim, num_positions = 50257, 768, 2048
    calls = []
    for _ in range(4):
        ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
        ids[:, : seq_len // 3] = 6  # a hot row
        calls.append((torch.randn(batch, seq_len, dim, generator=g).cuda(), ids.cuda()))
    op = ops.backward_op(calls[0][0])
    first = [op(dout, ids, None, 0, vocab, num_positions, 2.0, None, False, True, True) for dout, ids in calls]
    again = [op(dout, ids, None, 0, vocab, num_positions, 2.0, None, False, True, True) for dout, ids in calls]
    for (dw, dp), (dw2, dp2) in zip(first, again):
        assert torch.equal(dw, dw2) and torch.equal(dp, dp2)
    dout, ids = calls[0]
    flat, rows = ids.reshape(-1).cpu(), dout.reshape(-1, dim).cpu().double()
    exact_w = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, flat, rows) * 2.0
    exact_p = torch.zeros(num_positions, dim, dtype=torch.float64)
    exact_p[:seq_len] = dout.cpu().double().sum(0)
    torch.testing.assert_close(first[0][0].cpu().double(), exact_w, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(first[0][1].cpu().double(), exact_p, rtol=1e-5, atol=1e-4)
    if backend == "triton":
        from pyembed import _triton
        key = next(k for k in _triton._backward_plans if k[0] == calls[0][0].shape and k[3] == ids.shape)
        assert _triton._backward_plans[key].whole is not None


def test_triton_calls_through_the_cpp_node_equal_the_python_function_on_cuda(monkeypatch):
    # A plain eager `triton` call is pyembed::embedding's C++ node running triton's Python
    # forward and backward (tests/test_dispatch.py checks it under the interpreter). On a
    # GPU its backward runs on autograd's CUDA device thread, which takes the GIL for the
    # Python backward: outputs and gradients (plain and create_graph backward, double
    # backward) equal the general route's Python Function on the same kernels, bit for bit.
    _kernel_ops("triton")
    ids = torch.tensor([[1, 2, 2], [3, 1, 6]], device="cuda")
    weight, pos_weight = torch.randn(7, 8, device="cuda"), torch.randn(4, 8, device="cuda")
    calls = [{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in options.items()}
             for options in NODE_OPTIONS]

    def triton(ids, weight, pos_weight, **options):
        return pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton", **options)

    assert "Fused" not in triton(ids, weight.requires_grad_(), pos_weight).grad_fn.name()
    fast = [lookup_results(triton, ids, weight, pos_weight, **options) for options in calls]
    monkeypatch.setitem(dispatch._registry, "triton", dataclasses.replace(dispatch.get("triton"), autograd_op=None))
    for options, got in zip(calls, fast):
        for g, want in zip(got, lookup_results(triton, ids, weight, pos_weight, **options), strict=True):
            torch.testing.assert_close(g, want, rtol=0, atol=0, msg=str(options))


@pytest.mark.parametrize("positions", [True, False], ids=["learned positions", "no positions"])
def test_triton_dense_gradient_of_a_large_two_byte_table_is_the_same_in_any_row_tiles(positions, monkeypatch):
    """A bf16 table of 2^17 rows takes `triton`'s finish_segments in programs of four tiles
    (kernels' finish_row_tiles), most of them storing only zeros; one and two tiles a
    program (PYEMBED_TRITON_ROW_TILES) give the same bits, as the interpreter shows on CPU,
    and the gradients are the float64 reference's within bf16 rounding."""
    ops = _kernel_ops("triton")
    from pyembed import _triton
    from pyembed.kernels import embedding as k

    vocab, dim, num_positions = 2**17, 64, 512
    assert k.finish_row_tiles(torch.bfloat16, dim, vocab, True) == 4
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, vocab, (8, 512), generator=g)
    ids[:, :100] = 70000  # a hot row, summed from the chunks' pieces
    dout = torch.randn(8, 512, dim, generator=g).to(torch.bfloat16)
    args = (None, 0, vocab, num_positions if positions else 0, 2.0, None, False, True, positions)
    results = {}
    for tiles in (None, "1", "2"):
        if tiles is None:
            monkeypatch.delenv("PYEMBED_TRITON_ROW_TILES", raising=False)
        else:
            monkeypatch.setenv("PYEMBED_TRITON_ROW_TILES", tiles)
        monkeypatch.setattr(_triton, "_backward_plans", {})
        results[tiles] = ops.backward(dout.cuda(), ids.cuda(), *args)
    dw, dp = results[None]
    for tiles in ("1", "2"):
        assert torch.equal(results[tiles][0], dw), tiles
        assert (dp is None and results[tiles][1] is None) or torch.equal(results[tiles][1], dp), tiles
    exact_w = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, ids.reshape(-1),
                                                                        dout.reshape(-1, dim).double()) * 2.0
    torch.testing.assert_close(dw.cpu().double(), exact_w, rtol=2**-7, atol=2**-7 * exact_w.abs().max().item())
    untouched = exact_w.abs().sum(1) == 0
    assert not dw.cpu()[untouched].any() and not dw.cpu()[untouched].signbit().any()  # +0.0, as a zero fill


def _zipf_gradient_is_the_same_at_each(backend, variable, values, dtype, positions, monkeypatch, seed):
    """GPT-2's table, 8x2048 Zipf-distributed ids: ``backend``'s dense gradient (and the
    learned positions', with ``positions``) with ``variable`` at each of ``values`` is the
    same, bit for bit, and the float64 reference's, untouched rows +0 as a zero fill."""
    ops = _kernel_ops(backend)
    from pyembed import _triton

    vocab, dim, num_positions = 50257, 64, 2048
    g = torch.Generator().manual_seed(seed)
    ids = torch.multinomial(torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.1), 8 * 2048, replacement=True,
                            generator=g).view(8, 2048)
    dout = torch.randn(8, 2048, dim, generator=g).to(dtype)
    args = (None, 0, vocab, num_positions if positions else 0, 2.0, None, False, True, positions)
    results = {}
    for value in values:
        monkeypatch.setenv(variable, value)
        monkeypatch.setattr(_triton, "_backward_plans", {})  # a plan replays the launches it was bound with
        results[value] = ops.backward(dout.cuda(), ids.cuda(), *args)
    dw, dp = results[values[0]]
    for value in values[1:]:
        assert torch.equal(results[value][0], dw), value
        assert (dp is None and results[value][1] is None) or torch.equal(results[value][1], dp), value
    exact_w = torch.zeros(vocab, dim, dtype=torch.float64).index_add_(0, ids.reshape(-1),
                                                                        dout.reshape(-1, dim).double()) * 2.0
    tol = 2**-7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(dw.cpu().double(), exact_w, rtol=tol, atol=tol * exact_w.abs().max().item())
    untouched = exact_w.abs().sum(1) == 0
    assert not dw.cpu()[untouched].any() and not dw.cpu()[untouched].signbit().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("positions", [True, False], ids=["learned positions", "no positions"])
def test_triton_dense_gradient_with_zipf_ids_is_the_same_at_any_sum_stages(positions, dtype, monkeypatch):
    """Rows used 2-128 times summed row by row, hotter ones from the chunks' pieces: `triton`'s
    dense gradient with the rows' loop as written and pipelined (PYEMBED_TRITON_SUM_STAGES 2,
    3: cp.async copies ahead) is the same -- the adds keep their order."""
    _zipf_gradient_is_the_same_at_each("triton", "PYEMBED_TRITON_SUM_STAGES", ("1", "2", "3"), dtype, positions,
                                       monkeypatch, seed=3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("positions", [True, False], ids=["learned positions", "no positions"])
def test_cuda_dense_gradient_with_zipf_ids_is_the_same_with_either_finish_rows(positions, dtype, monkeypatch):
    """Neighbouring hot rows, some summed in pieces, most rows untouched: `cuda`'s
    finish_segments with its first pass over consecutive segments (the default; a group of
    untouched rows stores its zeros alone) and spread `groups` apart
    (PYEMBED_CUDA_FINISH_ROWS=spread) gives the same gradient -- each segment is summed the
    same way in either."""
    _zipf_gradient_is_the_same_at_each("cuda", "PYEMBED_CUDA_FINISH_ROWS", ("consecutive", "spread"), dtype,
                                       positions, monkeypatch, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cuda_dense_gradient_with_zipf_ids_is_the_same_with_the_solo_finish_kernel(dtype, monkeypatch):
    """With learned positions reaching every token (their blocks write the one-token rows),
    `cuda`'s finish_segments_solo_kernel at 4, 8 or 16 rows a thread group, or 8 with the
    position blocks last (PYEMBED_CUDA_FINISH_GROUP) gives the gradients finish_segments_kernel gives (the
    variable unset), bit for bit: each segment is summed the same way."""
    _zipf_gradient_is_the_same_at_each("cuda", "PYEMBED_CUDA_FINISH_GROUP", ("", "4", "8", "16", "8-last"), dtype, True,
                                       monkeypatch, seed=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("positions", [True, False], ids=["learned positions", "no positions"])
def test_cuda_dense_gradient_with_zipf_ids_is_the_same_with_each_sort(positions, dtype, monkeypatch):
    """Neighbouring hot rows, some summed in pieces, most rows untouched: `cuda`'s dense
    gradient is the same whichever sort orders the tokens (PYEMBED_CUDA_SORT: its tile sort,
    CUB's) -- each a stable order, so each segment is summed in token order."""
    _zipf_gradient_is_the_same_at_each("cuda", "PYEMBED_CUDA_SORT", ("tile", "cub"), dtype, positions,
                                       monkeypatch, seed=4)


@pytest.mark.parametrize("backend", _kernel_backends())
def test_jagged_ids_count_positions_on_the_gpu_without_a_host_sync(backend):
    """Jagged ids (torch.nested) on CUDA tensors, learned positions, the default check: the
    packed lookup with each sequence's positions found on the device from the offsets --
    torch's sync debug mode, set to raise, sees no host sync -- equals the layer run on each
    sequence alone, and so does the table's gradient."""
    _kernel_ops(backend)
    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(1000, 64, 256, scale_embeddings=True, backend=backend).cuda()
    sequences = [torch.randint(0, 1000, (n,), device="cuda") for n in (7, 130, 1, 64)]
    ids = torch.nested.nested_tensor(sequences, layout=torch.jagged)  # (made from lengths on the host)
    layer(ids)  # the first call: kernels compiled, the error record allocated
    torch.cuda.synchronize()
    with _host_syncs_raise():
        out = layer(ids)
    dout = torch.randn_like(out.values())
    out.values().backward(dout)
    jagged_grad = layer.token_embedding.weight.grad.clone()
    layer.zero_grad()
    want = torch.cat([layer(s) for s in sequences])
    want.backward(dout)
    torch.testing.assert_close(out.values(), want, rtol=0, atol=0)
    torch.testing.assert_close(jagged_grad, layer.token_embedding.weight.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", _kernel_backends())
def test_a_quantized_table_on_the_gpu_is_looked_up_as_nn_embeddings_without_a_host_sync(backend):
    """A quantized CUDA table (torchao's kind: its own embedding dequantizes the rows it
    gathers) under the default check: the subclass's lookup checks the ranges as
    nn.Embedding's does, so torch's sync debug mode, set to raise, sees no host sync; the
    output is nn.Embedding's with the same table, bit for bit, and the layer's (learned
    positions, scaled, dropout) the same call's on the dequantized table."""
    _kernel_ops(backend)
    torch.manual_seed(0)
    table = RowQuantized.quantize(torch.randn(1000, 64, device="cuda"))
    embedding, theirs = pyembed.FusedEmbedding(1000, 64, backend=backend).cuda(), torch.nn.Embedding(1000, 64).cuda()
    for module in (embedding, theirs):
        module.weight = torch.nn.Parameter(table, requires_grad=False)
    layer = pyembed.EmbeddingLayer(1000, 64, 256, scale_embeddings=True, dropout=0.1, backend=backend).cuda()
    layer.token_embedding.weight = torch.nn.Parameter(table, requires_grad=False)
    ids = torch.randint(0, 1000, (4, 200), device="cuda")
    embedding(ids), layer(ids)  # first calls: the dropout generator's state made
    torch.cuda.synchronize()
    torch.manual_seed(1)
    with _host_syncs_raise():
        with torch.no_grad():
            out = embedding(ids)
        layer_out = layer(ids)
    with torch.no_grad():
        torch.testing.assert_close(out, theirs(ids), rtol=0, atol=0)
    torch.manual_seed(1)
    want = pyembed.fused_embedding(ids, table.dequantized(), layer.pos_embedding, scale=8.0, dropout_p=0.1,
                                   backend=backend)
    assert torch.equal(layer_out == 0, want == 0)
    torch.testing.assert_close(layer_out, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", _kernel_backends())
def test_max_norm_renormalises_without_a_host_sync_and_a_bad_id_is_reported_later(backend):
    """A FusedEmbedding(max_norm=...) on the GPU: torch's sync debug mode, set to raise, sees
    no host sync in a call (the renorm never reads the ids back, as torch's CUDA renorm); the
    rows as nn.Embedding(max_norm) leaves them for the ids in range (float32 norms, each
    its own order of sums: close, not equal), every other row bit for bit as it was; an id
    out of range touches no row and the next call raises, the CUDA context intact."""
    _kernel_ops(backend)
    pyembed.check_errors()  # nothing left over
    table = torch.randn(1000, 64, device="cuda", generator=torch.Generator("cuda").manual_seed(6)) * 0.5
    ours = pyembed.FusedEmbedding.from_pretrained(table.clone(), freeze=False, max_norm=3.0, backend=backend)
    theirs = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False, max_norm=3.0)
    ids = torch.randint(0, 1000, (8, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(7))
    ids[3, 100], ids[5, 7] = 1000, -1
    ours(ids.clamp(0, 999)[:1])  # the first call: kernels compiled, the error record allocated
    pyembed.check_errors()
    ours.weight.data.copy_(table)
    torch.cuda.synchronize()
    with _host_syncs_raise():
        out = ours(ids)
    in_range = (ids >= 0) & (ids < 1000)
    want = theirs(ids[in_range])
    assert not out[~in_range].any()
    torch.testing.assert_close(out[in_range], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-5, atol=1e-6)
    untouched = ~torch.isin(torch.arange(1000, device="cuda"), ids[in_range])
    assert torch.equal(ours.weight[untouched], table[untouched])
    assert not torch.equal(ours.weight, table)  # (rows past max_norm were renormalised)
    with pytest.raises(IndexError, match=r"id (1000|-1), but the embedding table has V=1000"):
        ours(ids.clamp(0, 999))
    torch.cuda.synchronize()  # the context is intact
