"""Tensor parallelism over NCCL, one process per GPU: the vocab-parallel example run with
torchrun (each rank checks its output and gradient against the single-device layer
bitwise), and the DTensor checks of tests/dtensor_worker.py on CUDA tensors with the
cuda and triton backends -- torch's styles on FusedEmbedding, pyembed's on EmbeddingLayer,
dropout, FSDP2, a distributed checkpoint, FSDP2 + TP on a 2-D mesh. On CPU the same
checks run over gloo (tests/test_parallel.py, tests/test_dtensor.py)."""

import sys

import pytest
import torch

import dtensor_worker
from helpers import launch_ranks
from pyembed import dispatch
from test_examples import EXAMPLES, run


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_vocab_parallel_over_nccl():
    world_size = torch.cuda.device_count()
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
              str(EXAMPLES / "vocab_parallel.py"))
    assert out.count("output equals the single-device layer's: True; weight gradient equals its slice "
                     "of the full one: True") == world_size, out


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (one NCCL rank per GPU)")
def test_dtensor_styles_fsdp2_and_checkpoints_over_nccl(tmp_path):
    launch_ranks(dtensor_worker.run_nccl, 2, str(tmp_path), dispatch.backends_for("cuda"))


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 CUDA GPUs (a 2 x 2 dp x tp mesh of NCCL ranks)")
def test_fsdp2_composed_with_tensor_parallel_over_nccl(tmp_path):
    launch_ranks(dtensor_worker.run_fsdp_with_tp_nccl, 4, str(tmp_path), dispatch.backends_for("cuda"))
