"""DistributedDataParallel over FusedEmbedding (ddp_worker.py), and
pyembed.parallel.VocabParallelEmbeddingLayer across 2 and 3 processes on this machine
(gloo over loopback, CPU tensors), against the single-process EmbeddingLayer: outputs,
each rank's slice of the weight gradient, the learned-positions gradient, padding, a bad
id raising on every rank without a hang, and sharded / gathered checkpoints. The checks
themselves are in vocab_parallel_worker.py; each world size is one launch of processes
(bounded in time, always cleaned up)."""

import pytest
import torch
import torch.distributed as dist

import ddp_worker
import pyembed
import vocab_parallel_worker
from helpers import CPU_BACKENDS, launch_ranks
from pyembed.parallel import VocabParallelEmbeddingLayer, shard_range

@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_matches_single_process(world_size, tmp_path):
    launch_ranks(vocab_parallel_worker.run, world_size, str(tmp_path), CPU_BACKENDS)


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="torch built without gloo")
def test_distributed_data_parallel_trains_as_nn_embedding(tmp_path):
    launch_ranks(ddp_worker.run, 2, str(tmp_path), CPU_BACKENDS)


def test_shard_ranges_cover_the_vocabulary_contiguously():
    for vocab, world in [(50257, 3), (50, 3), (50, 2), (7, 7), (128256, 8)]:
        ranges = [shard_range(vocab, r, world) for r in range(world)]
        assert ranges[0][0] == 0 and ranges[-1][1] == vocab
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        sizes = [end - start for start, end in ranges]
        assert max(sizes) - min(sizes) <= 1
    assert [end - start for start, end in (shard_range(50257, r, 3) for r in range(3))] == [16753, 16752, 16752]


def test_needs_an_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        VocabParallelEmbeddingLayer(10, 4)


@pytest.mark.parametrize("token", [
    lambda: torch.nn.Embedding(10, 4, max_norm=1.0),  # what EmbeddingLayer.from_modules now honours
    lambda: torch.nn.Embedding(10, 4, scale_grad_by_freq=True),
], ids=["max_norm", "scale_grad_by_freq"])
def test_from_full_refuses_the_token_options_a_shard_cannot_follow(token):
    """A layer's token table with an option the vocab-parallel layer has no counterpart for
    is refused by name (before any collective), not dropped."""
    full = pyembed.EmbeddingLayer.from_modules(token(), torch.nn.Embedding(6, 4))
    with pytest.raises(ValueError, match="is not supported by VocabParallelEmbeddingLayer"):
        VocabParallelEmbeddingLayer.from_full(full)
