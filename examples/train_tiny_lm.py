"""Train a tiny transformer language model whose input layer is pyembed's EmbeddingLayer.

The model is a causal ``nn.TransformerEncoder`` (~1M parameters); the data is a
synthetic language: a fixed random chain in which every token has 4 possible
successors, so next-token loss falls from ln(64) = 4.16 towards ln(4) = 1.39. The input
layer uses a sinusoidal encoding (computed in the kernel, nothing stored), sqrt(d)
scaling and sparse token gradients, so the token table is trained by SparseAdam and the
rest of the model by AdamW.

    python examples/train_tiny_lm.py                  # ~15 s on a 2-core CPU
    python examples/train_tiny_lm.py --backend reference --dense

This file is also the model of tests/test_convergence.py, which trains it with every
backend and checks the loss curves agree.
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn

import pyembed

VOCAB_SIZE = 64
SEQ_LEN = 32
BRANCHING = 4  # successors per token: the best possible loss is ln(4) = 1.39


class TinyLM(nn.Module):
    """EmbeddingLayer -> causal pre-norm TransformerEncoder -> LayerNorm -> vocabulary logits."""

    def __init__(self, vocab_size: int = VOCAB_SIZE, dim: int = 128, layers: int = 4, heads: int = 4,
                 max_seq_len: int = SEQ_LEN, pos_encoding: str = "sinusoidal", sparse: bool = True,
                 backend: str = "auto") -> None:
        super().__init__()
        self.embed = pyembed.EmbeddingLayer(vocab_size, dim, max_seq_len, pos_encoding, scale_embeddings=True,
                                            sparse=sparse, backend=backend)
        # Rows are multiplied by sqrt(d), so they start at std d**-0.5 (unit scale after scaling).
        nn.init.normal_(self.embed.token_embedding.weight, std=dim**-0.5)
        block = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: (B, T) -> logits (B, T, vocab_size)."""
        causal = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        x = self.encoder(self.embed(ids), mask=causal, is_causal=True)
        return self.head(self.norm(x))


def make_language(seed: int = 1234) -> torch.Tensor:
    """(VOCAB_SIZE, BRANCHING) table: the tokens allowed to follow each token."""
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(VOCAB_SIZE, generator=generator)[:BRANCHING] for _ in range(VOCAB_SIZE)])


def sample_batch(successors: torch.Tensor, batch_size: int, generator: torch.Generator) -> torch.Tensor:
    """(batch_size, SEQ_LEN + 1) token sequences walked along the chain from random starts."""
    seqs = torch.empty(batch_size, SEQ_LEN + 1, dtype=torch.long)
    seqs[:, 0] = torch.randint(0, VOCAB_SIZE, (batch_size,), generator=generator)
    for t in range(1, SEQ_LEN + 1):
        choice = torch.randint(0, BRANCHING, (batch_size,), generator=generator)
        seqs[:, t] = successors[seqs[:, t - 1], choice]
    return seqs


def next_token_loss(model: TinyLM, seqs: torch.Tensor) -> torch.Tensor:
    logits = model(seqs[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), seqs[:, 1:].reshape(-1))


def make_optimizers(model: TinyLM, lr: float = 1e-3) -> list[torch.optim.Optimizer]:
    """SparseAdam for a sparse token table (its gradient holds only the rows used), AdamW
    for everything else. With a dense table, AdamW for all."""
    token = model.embed.token_embedding.weight
    if not model.embed.token_embedding.sparse:
        return [torch.optim.AdamW(model.parameters(), lr=lr)]
    rest = [p for p in model.parameters() if p is not token]
    return [torch.optim.SparseAdam([token], lr=lr), torch.optim.AdamW(rest, lr=lr)]


def train(model: TinyLM, steps: int, batch_size: int = 16, seed: int = 0, lr: float = 1e-3,
          log_every: int = 0) -> list[float]:
    """Train on fresh batches drawn from ``seed`` (the same on every device); returns the
    loss of every step."""
    successors, generator = make_language(), torch.Generator().manual_seed(seed)
    device = next(model.parameters()).device
    optimizers = make_optimizers(model, lr)
    losses = []
    for step in range(steps):
        loss = next_token_loss(model, sample_batch(successors, batch_size, generator).to(device))
        for opt in optimizers:
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for opt in optimizers:
            opt.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {loss.item():.4f}")
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--backend", default="auto", help="pyembed backend (auto, reference, cpu, ...)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--dense", action="store_true", help="dense token gradients and AdamW for all")
    args = parser.parse_args()

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLM(sparse=not args.dense, backend=args.backend).to(device)
    params = sum(p.numel() for p in model.parameters())
    print(f"TinyLM on {device}: {params / 1e6:.2f}M parameters, input layer {model.embed}")
    print(f"loss starts near ln({VOCAB_SIZE}) = {math.log(VOCAB_SIZE):.2f}; the best possible is "
          f"ln({BRANCHING}) = {math.log(BRANCHING):.2f}")
    start = time.perf_counter()
    losses = train(model, args.steps, lr=args.lr, log_every=25)
    print(f"{args.steps} steps in {time.perf_counter() - start:.1f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")


if __name__ == "__main__":
    main()
