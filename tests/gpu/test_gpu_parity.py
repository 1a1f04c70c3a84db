"""Every backend that runs on CUDA against eager PyTorch on real GPU tensors."""

import math

import pytest
import torch

import pyembed
from pyembed import dispatch


def _cuda_backends():
    return dispatch.backends_for("cuda") if torch.cuda.is_available() else []


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


def test_output_of_more_than_2_to_the_31_elements():
    if torch.cuda.get_device_properties(0).total_memory < 12 * 2**30:
        pytest.skip("needs a GPU with at least 12 GiB for a 4 GiB output")
    dim = 1024
    tokens = 2**31 // dim + 7  # the last rows sit past element 2^31
    weight = torch.randn(100, dim, device="cuda", dtype=torch.float16)
    ids = torch.arange(tokens, device="cuda") % 100
    # The kernels' 64-bit offsets are what is tested; the reference backend (plain torch,
    # fp32 intermediates of 8 GiB each) would need ~20 GiB for this shape.
    for backend in [b for b in _cuda_backends() if b != "reference"]:
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


def test_learned_position_gradient_past_2_to_the_31_elements():
    # dP[t] = sum over b of dout[b, t]: the last batch row starts past element 2^31.
    if torch.cuda.get_device_properties(0).total_memory < 24 * 2**30:
        pytest.skip("needs a GPU with at least 24 GiB for two 4.4 GB tensors")
    batch, seq_len, dim = 2100, 1024, 1024  # 2.2e9 elements
    ids = torch.zeros(batch, seq_len, dtype=torch.int32, device="cuda")
    weight = torch.zeros(4, dim, device="cuda", dtype=torch.float16)
    dout = torch.zeros(batch, seq_len, dim, device="cuda", dtype=torch.float16)
    dout[-1] = torch.arange(seq_len, device="cuda", dtype=torch.float16)[:, None] % 7
    for backend in [b for b in _cuda_backends() if b != "reference"]:
        pos_weight = torch.zeros(seq_len, dim, device="cuda", dtype=torch.float16, requires_grad=True)
        pyembed.fused_embedding(ids, weight, pos_weight, validate=False, backend=backend).backward(dout)
        torch.testing.assert_close(pos_weight.grad, dout[-1], rtol=0, atol=0, msg=backend)
        del pos_weight
