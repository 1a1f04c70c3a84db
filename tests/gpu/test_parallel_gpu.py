"""The vocab-parallel layer over NCCL, one process per GPU, unchanged: the example run
with torchrun, which checks each rank's output and gradient against the single-device
layer bitwise (on CPU the same checks run over gloo in tests/test_parallel.py)."""

import sys

import pytest
import torch

from test_examples import EXAMPLES, run


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_vocab_parallel_over_nccl():
    world_size = torch.cuda.device_count()
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
              str(EXAMPLES / "vocab_parallel.py"))
    assert out.count("output equals the single-device layer's: True; weight gradient equals its slice "
                     "of the full one: True") == world_size, out
