"""The examples run as a user runs them (a subprocess, from the command line), shortened
where an argument allows, and print what they promise."""

import os
import pathlib
import re
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


def _numbers(line: str) -> list[float]:
    return [float(x) for x in re.findall(r"= ([+-]?\d+\.\d+)", line)]


def test_learn_embeddings(tmp_path):
    """Context pairs pull words of one group together: after training king and queen are
    close and both far from man (before, the random start says nothing), and the 2-D plot
    is written."""
    plot = tmp_path / "emb.png"
    out = run(sys.executable, str(EXAMPLES / "learn_embeddings.py"), "--plot", str(plot))
    after = next(line for line in out.splitlines() if line.startswith("after:"))
    king_queen, king_man, queen_man = _numbers(after)
    assert king_queen > 0.8 and king_man < king_queen - 0.5 and queen_man < king_queen - 0.5, out
    nearest = next(line for line in out.splitlines() if line.startswith("nearest to king:"))
    assert "man" not in nearest.replace("woman", "") and "queen" in nearest, out
    assert plot.stat().st_size > 10_000  # a PNG with the points and labels


def test_text_to_embeddings_equals_the_textbook_formula():
    out = run(sys.executable, str(EXAMPLES / "text_to_embeddings.py"))
    assert "output: (4, 10, 16)" in out, out
    assert out.count(": True") == 5 and ": False" not in out, out  # formula, padding row, padded positions, grads
    # The same pipeline checked here, independently of the script's own printout.
    sys.path.insert(0, str(EXAMPLES))
    try:
        import text_to_embeddings as example
    finally:
        sys.path.remove(str(EXAMPLES))
    import torch

    import pyembed

    vocab = example.build_vocab(["b a", "c"])
    assert vocab == {"[PAD]": 0, "[UNK]": 1, "b": 2, "a": 3, "c": 4}
    assert example.encode(["a z b", "c"], vocab, max_len=2).tolist() == [[3, 1], [4, 0]]  # [UNK], truncated, padded
    ids = example.encode(example.SENTENCES, example.build_vocab(example.SENTENCES), max_len=64)
    layer = pyembed.EmbeddingLayer(40, 8, max_seq_len=64, pos_encoding="sinusoidal", scale_embeddings=True,
                                   padding_idx=0)
    expected = example.textbook_formula(ids, layer.token_embedding.weight.detach())
    reference = pyembed.fused_embedding(ids, layer.token_embedding.weight.detach().double(),
                                        pos_encoding="sinusoidal", scale=8 ** 0.5, backend="reference")
    torch.testing.assert_close(expected, reference, rtol=1e-12, atol=1e-12)  # the textbook PE is pyembed's
    torch.testing.assert_close(layer(ids).double(), expected, rtol=0, atol=1e-5)
