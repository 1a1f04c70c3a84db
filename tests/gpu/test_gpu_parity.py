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
