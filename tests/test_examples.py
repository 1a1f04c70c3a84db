"""The examples run as a user runs them (a subprocess, from the command line), shortened
where an argument allows, and print what they promise."""

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def run(*args: str, timeout: int = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user runs them
    done = subprocess.run(list(args), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_train_tiny_lm():
    out = run(sys.executable, str(EXAMPLES / "train_tiny_lm.py"), "--steps", "50")
    losses = [float(line.split()[-1]) for line in out.splitlines() if line.startswith("step ")]
    assert losses[-1] < losses[0] - 0.5, out  # learning: 50 steps take the loss well down


def test_swap_into_hf():
    out = run(sys.executable, str(EXAMPLES / "swap_into_hf.py"), "--steps", "2", "--batch", "2", "--seq-len", "64")
    assert "FusedEmbedding (50257, 768), still tied to the LM head: True" in out, out
    steps = [line.split() for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2 and all(s[4] == s[6] for s in steps), out  # the same loss with and without pyembed
    assert "the speed of nn.Embedding" in out, out


def test_tensor_parallel_plan_with_torchrun():
    """torchtitan's plan (pyembed's RowwiseParallel on the EmbeddingLayer, torch's
    SequenceParallel and ColwiseParallel after it) trains with the one-device losses."""
    world_size = 2
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
              str(EXAMPLES / "tensor_parallel.py"), "--steps", "2")
    assert out.count("agree: True") == 2 * world_size, out


def test_vocab_parallel_with_torchrun():
    world_size = 2
    out = run(sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world_size}",
              str(EXAMPLES / "vocab_parallel.py"), "--vocab", "1000", "--dim", "64", "--seq-len", "32")
    assert out.count("output equals the single-device layer's: True; weight gradient equals its slice "
                     "of the full one: True") == world_size, out
    assert "rank 0 gathered the full state_dict" in out, out
