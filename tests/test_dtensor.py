"""pyembed inside torch.distributed's tensor parallelism (DESIGN §10), across 2 and 3
processes on this machine (gloo over loopback, CPU tensors): torchtitan's RowwiseParallel
plans (replicated and sequence-sharded outputs) and ColwiseParallel on a FusedEmbedding give
nn.Embedding's outputs and gradients; pyembed's styles on an EmbeddingLayer (learned and
sinusoidal positions, dropout) give the single-process layer's; a bad id raises on every rank
without a hang; FSDP2 fully_shard over an EmbeddingLayer, alone and composed with the TP plan
on a 2 x 2 mesh (4 processes), gives the single-process loss and gradients; a
torch.distributed.checkpoint of a row-sharded table loads back into shards and into a whole
table; an unsupported layout raises one clear error on every rank; torchtitan's memory
estimate (a fake process group, fake tensors) counts a FusedEmbedding as an nn.Embedding. The
checks are in dtensor_worker.py; tests/gpu/test_parallel_gpu.py runs them over NCCL."""

import pytest
import torch.distributed as dist

import dtensor_worker
from helpers import CPU_BACKENDS, launch_ranks


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("world_size", [2, 3])
def test_parallel_styles_fsdp2_and_checkpoints_match_single_process(world_size, tmp_path):
    launch_ranks(dtensor_worker.run, world_size, str(tmp_path), CPU_BACKENDS)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_fsdp2_composed_with_tensor_parallel_on_a_2d_mesh(tmp_path):
    launch_ranks(dtensor_worker.run_fsdp_with_tp, 4, str(tmp_path), CPU_BACKENDS)


@pytest.mark.skipif(not dist.is_available(), reason="torch built without torch.distributed")
def test_memory_estimates_under_fake_tensor_mode_equal_nn_embeddings(tmp_path):
    launch_ranks(dtensor_worker.run_memory_estimates, 1, str(tmp_path), CPU_BACKENDS)
