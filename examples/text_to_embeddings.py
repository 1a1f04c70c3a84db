"""Text in, (B, T, d) out: tokenise, pad, and embed a batch of sentences with pyembed.

A whitespace tokeniser with [PAD] and [UNK], sentences padded (or truncated) to the
longest one, and one ``pyembed.EmbeddingLayer`` doing token lookup, sqrt(d) scaling and
sinusoidal positions in one fused op. The script checks what it prints: the output equals
the textbook formula ``emb(ids) * sqrt(d) + PE[:T]`` written in plain torch, the padding
row is zero and gets no gradient.

    python examples/text_to_embeddings.py
    python examples/text_to_embeddings.py --dim 32 --max-len 6
"""

import argparse
import math

import torch
import torch.nn.functional as F

import pyembed

PAD, UNK = "[PAD]", "[UNK]"
SENTENCES = [
    "the cat sat on the mat",
    "a dog barked",
    "embeddings turn words into vectors the model can learn from",
    "the zebra sat",  # "zebra" is not in the vocabulary below: [UNK]
]


def build_vocab(texts: list[str]) -> dict[str, int]:
    """[PAD] = 0, [UNK] = 1, then every word of ``texts`` in order of first use."""
    vocab = {PAD: 0, UNK: 1}
    for text in texts:
        for word in text.split():
            vocab.setdefault(word, len(vocab))
    return vocab


def encode(texts: list[str], vocab: dict[str, int], max_len: int) -> torch.Tensor:
    """(B, T) ids: each text split on whitespace, unknown words as [UNK], truncated to
    max_len and padded with [PAD] to the longest (T <= max_len)."""
    rows = [[vocab.get(word, vocab[UNK]) for word in text.split()][:max_len] for text in texts]
    longest = max(len(row) for row in rows)
    return torch.tensor([row + [vocab[PAD]] * (longest - len(row)) for row in rows])


def textbook_formula(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """emb(ids) * sqrt(d) + PE[:T], PE(p, 2i) = sin(p / 10000^(2i/d)), PE(p, 2i+1) = cos(...),
    in plain torch (float64)."""
    seq_len, dim = ids.shape[1], weight.shape[1]
    position = torch.arange(seq_len, dtype=torch.float64)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, dtype=torch.float64) * (-math.log(10000.0) / dim))
    pe = torch.zeros(seq_len, dim, dtype=torch.float64)
    pe[:, 0::2], pe[:, 1::2] = torch.sin(position * frequency), torch.cos(position * frequency)
    return F.embedding(ids, weight.double()) * math.sqrt(dim) + pe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--max-len", type=int, default=64, help="truncate longer sentences to this many tokens")
    args = ap.parse_args()

    torch.manual_seed(0)
    vocab = build_vocab(SENTENCES[:3])  # the last sentence has a word the vocabulary never saw
    ids = encode(SENTENCES, vocab, args.max_len)
    print(f"vocabulary: {len(vocab)} words; ids {tuple(ids.shape)} (batch, longest sentence)")
    for text, row in zip(SENTENCES, ids.tolist()):
        print(f"  {text[:40]!r:44} -> {row}")

    layer = pyembed.EmbeddingLayer(len(vocab), args.dim, max_seq_len=args.max_len, pos_encoding="sinusoidal",
                                   scale_embeddings=True, padding_idx=vocab[PAD])
    out = layer(ids)
    print(f"output: {tuple(out.shape)} (batch, tokens, d)")

    weight = layer.token_embedding.weight
    expected = textbook_formula(ids, weight.detach())
    # Tolerance by DESIGN §7: fp32 rounding of sqrt(d) * W plus the float32 angle p * w_i.
    tolerance = 1e-6 * math.sqrt(args.dim) + 8 * 2**-24 * ids.shape[1]
    error = (out.double() - expected).abs().max().item()
    print(f"equals emb(ids) * sqrt(d) + PE[:T] computed in plain torch: {error <= tolerance} "
          f"(max |difference| {error:.1e})")

    padded = ids == vocab[PAD]
    print(f"padding row of the table is zero: {bool((weight[vocab[PAD]] == 0).all())}; "
          f"{int(padded.sum())} padded positions hold only their positional encoding: "
          f"{bool(torch.allclose(out[padded].double(), expected[padded], atol=tolerance))}")
    out.pow(2).sum().backward()
    print(f"padding row gets no gradient: {bool((weight.grad[vocab[PAD]] == 0).all())}; "
          f"used rows do: {bool(weight.grad[ids[~padded]].abs().sum(-1).gt(0).all())}")


if __name__ == "__main__":
    main()
