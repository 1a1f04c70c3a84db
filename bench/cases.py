"""What the benchmark measures: shapes, token counts, modes, and the suites that
combine them (DESIGN §8)."""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass

import torch

# (vocab, dim) of real models' input layers.
SHAPES = {
    "gpt2": (50257, 768),
    "bert": (30522, 768),
    "llama2": (32000, 4096),
    "llama3": (128256, 4096),
    "tiny": (1000, 64),  # --quick and the harness test
}
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# step: forward, backward, optimizer step (AdamW; SparseAdam on a sparse token table) and
# zero_grad(set_to_none=True) -- what a user pays; a backward that defers work (e.g. to
# first-touch page faults on a lazily zeroed gradient) shows it here.
MODES = ("fwd", "bwd", "fwd+bwd", "step")


@dataclass(frozen=True)
class Case:
    shape: str
    batch: int
    seq_len: int
    mode: str = "fwd+bwd"  # fwd | bwd | fwd+bwd | step
    dtype: str = "fp32"
    pos: str = "learned"  # learned | sinusoidal | none
    dist: str = "uniform"  # uniform | zipf | onehot
    grad: str = "dense"  # dense | sparse
    dropout: float = 0.0  # after the sum, in training mode (EmbeddingLayer(dropout=...))

    @property
    def vocab(self) -> int:
        return SHAPES[self.shape][0]

    @property
    def dim(self) -> int:
        return SHAPES[self.shape][1]

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    @property
    def scale(self) -> float:
        return math.sqrt(self.dim)

    def label(self) -> str:
        extras = [x for x in (self.dtype, self.pos, self.dist, self.grad) if x not in ("fp32", "learned", "uniform", "dense")]
        extras += [f"dropout={self.dropout:g}"] if self.dropout else []
        return f"{self.shape} {self.batch}x{self.seq_len} {self.mode}" + (f" [{', '.join(extras)}]" if extras else "")

    def as_dict(self) -> dict:
        return asdict(self)


def make_ids(case: Case, device, generator: torch.Generator) -> torch.Tensor:
    """uniform ids; Zipf(1.1) (word frequencies); one-hot-row: 90% one id (padding/BOS)."""
    n = case.tokens
    if case.dist == "uniform":
        ids = torch.randint(0, case.vocab, (n,), generator=generator)
    elif case.dist == "zipf":
        ranks = torch.arange(1, case.vocab + 1, dtype=torch.float64)
        ids = torch.multinomial(ranks.pow(-1.1), n, replacement=True, generator=generator)
    elif case.dist == "onehot":
        ids = torch.randint(0, case.vocab, (n,), generator=generator)
        ids[torch.rand(n, generator=generator) < 0.9] = 0
    else:
        raise ValueError(f"unknown id distribution {case.dist!r}")
    return ids.reshape(case.batch, case.seq_len).to(device)


TOKENS_DEFAULT = [(1, 1), (1, 128), (8, 128), (8, 512)]
TOKENS_GPU = TOKENS_DEFAULT + [(8, 2048)]


def gpu_priority(case: Case) -> int:
    """The gpu suite's order, so that a run cut short by a time limit (one GPU call: bench
    --time-limit) has measured what matters most: 0, what issues #29 and #30 set targets on
    -- 8x2048 forward and forward + backward at GPT-2 and Llama-3, fp32 and bf16, learned
    positions; 1, the same one token at a time (decoding); 2, their training steps and
    GPT-2's embedding dropout and sparse step; 3, the rest (Llama-2, whose table lies between
    the two, the sinusoid, other id distributions, one-token steps)."""
    if case.pos != "learned" or case.shape not in ("gpt2", "llama3") or case.dist != "uniform":
        return 3
    plain = case.mode != "step" and case.grad == "dense" and not case.dropout
    if plain:
        return 0 if case.tokens > 1 else 1
    return 2 if case.tokens > 1 else 3


def suite(name: str) -> list[Case]:
    """main (``make bench`` on a CPU, a few minutes): what a user asks first -- GPT-2 at
    8x512 tokens: forward, forward + backward, a training step with AdamW and one with a
    sparse table and SparseAdam -- and a one-token forward (decoding).
    cpu (``--full`` on a CPU; the README's CPU figures): the main grid (GPT-2 and BERT, 1x1 .. 8x512 tokens, every
    mode, fp32, learned positions, uniform ids, dense grads) plus one-axis sweeps around
    GPT-2 8x512. gpu: what a GPU user compares -- GPT-2, Llama-2 and Llama-3 tables, 1x1
    (decoding) and 8x2048 (training) tokens, fp32 and bf16, learned and sinusoidal
    positions, fwd / fwd+bwd / step, plus a sparse step, GPT-2's embedding dropout (0.1) and
    the Zipf and one-hot id distributions at GPT-2 8x2048, in the order of gpu_priority
    (~9 minutes on an H100 at d81f5b2, every case compiling afresh: more than one GPU call
    holds beside the build and the tests, hence that order and --time-limit).
    all: the whole cross product (hours). quick: one tiny shape, every mode (seconds; used
    by the tests)."""
    if name == "quick":
        return [Case("tiny", 2, 16, mode) for mode in MODES] + [Case("tiny", 2, 16, "fwd+bwd", grad="sparse"),
                                                                 Case("tiny", 2, 16, "fwd+bwd", dropout=0.1)]
    if name == "main":
        return [Case("gpt2", 8, 512, mode) for mode in ("fwd", "fwd+bwd", "step")] + [
            Case("gpt2", 8, 512, "step", grad="sparse"), Case("gpt2", 1, 1, "fwd")]
    shapes, tokens = (["gpt2", "bert"], TOKENS_DEFAULT) if name == "cpu" else (
        ["gpt2", "bert", "llama2", "llama3"], TOKENS_GPU)
    if name == "all":
        return [Case(s, b, t, m, dt, p, di, g) for s, (b, t), m, dt, p, di, g in itertools.product(
            shapes, tokens, MODES, DTYPES, ("learned", "sinusoidal", "none"), ("uniform", "zipf", "onehot"),
            ("dense", "sparse"))]
    if name == "gpu":
        cases = [Case(s, b, t, m, dt, p) for (b, t), s, m, dt, p in itertools.product(
            ((8, 2048), (1, 1)), ("gpt2", "llama2", "llama3"), ("fwd", "fwd+bwd", "step"), ("fp32", "bf16"),
            ("learned", "sinusoidal"))]
        cases += [Case("gpt2", 8, 2048, "step", grad="sparse"), Case("gpt2", 8, 2048, "fwd+bwd", dropout=0.1)]
        cases += [Case("gpt2", 8, 2048, "fwd+bwd", dist=d) for d in ("zipf", "onehot")]
        return sorted(cases, key=gpu_priority)  # stable: within a tier, the order above
    if name != "cpu":
        raise ValueError(f"unknown suite {name!r}")
    cases = [Case(s, b, t, m) for s, (b, t), m in itertools.product(shapes, tokens, MODES)]
    b, t = tokens[-1]
    for mode in ("fwd", "fwd+bwd"):
        cases += [Case("gpt2", b, t, mode, pos=p) for p in ("sinusoidal", "none")]
        cases += [Case("gpt2", b, t, mode, dtype=d) for d in ("bf16", "fp16")]
    cases += [Case("gpt2", b, t, mode, grad="sparse") for mode in ("fwd+bwd", "step")]
    cases += [Case("gpt2", b, t, "fwd+bwd", dist=d) for d in ("zipf", "onehot")]
    cases += [Case("gpt2", b, t, mode, dropout=0.1) for mode in ("fwd+bwd", "step")]
    return cases
