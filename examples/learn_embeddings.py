"""Embeddings learn meaning from context: a tiny skip-gram model on pyembed.

Every word of a small vocabulary is trained to predict the words seen next to it
(king~throne, queen~crown, man~sword, ...). Words that share contexts end up with
similar rows: before training cos(king, queen) is whatever the random start gives; after
it, king and queen are clearly closer to each other than either is to man.

The table is a ``pyembed.FusedEmbedding`` with ``sparse=True`` (only the rows of a batch
get a gradient) trained by ``torch.optim.SparseAdam``; the head is a plain linear layer.

    python examples/learn_embeddings.py                 # prints similarities, neighbours
    python examples/learn_embeddings.py --plot emb.png  # and the 2-D picture (matplotlib)
"""

import argparse

import torch
import torch.nn.functional as F

import pyembed
from pyembed.analysis import cosine_similarity_matrix, most_similar, plot_embeddings_2d

ROYAL = ["king", "queen", "prince", "princess"]
COMMON = ["man", "woman", "boy", "girl"]
ROYAL_CONTEXT = ["throne", "crown", "castle", "palace"]
COMMON_CONTEXT = ["sword", "field", "farm", "village"]
WORDS = ROYAL + COMMON + ROYAL_CONTEXT + COMMON_CONTEXT
VOCAB = {word: i for i, word in enumerate(WORDS)}


def context_pairs() -> torch.Tensor:
    """(center, context) id pairs, both directions: people of a group next to their
    group's things."""
    pairs = []
    for people, things in ((ROYAL, ROYAL_CONTEXT), (COMMON, COMMON_CONTEXT)):
        for person in people:
            for thing in things:
                pairs += [(VOCAB[person], VOCAB[thing]), (VOCAB[thing], VOCAB[person])]
    return torch.tensor(pairs)


def similarities(weight: torch.Tensor) -> dict[str, float]:
    sims = cosine_similarity_matrix(weight, [VOCAB["king"], VOCAB["queen"], VOCAB["man"]])
    return {"king, queen": sims[0, 1].item(), "king, man": sims[0, 2].item(), "queen, man": sims[1, 2].item()}


def show(when: str, weight: torch.Tensor) -> None:
    print(f"{when}: " + ", ".join(f"cos({pair}) = {value:+.3f}" for pair, value in similarities(weight).items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", help="save the 2-D projection of the table here (PNG; needs matplotlib)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    emb = pyembed.FusedEmbedding(len(VOCAB), args.dim, sparse=True)
    head = torch.nn.Linear(args.dim, len(VOCAB))
    optimizers = [torch.optim.SparseAdam(emb.parameters(), lr=args.lr), torch.optim.Adam(head.parameters(), lr=args.lr)]
    pairs = context_pairs()
    show("before", emb.weight)

    for step in range(args.steps):
        batch = pairs[torch.randint(0, len(pairs), (32,))]
        loss = F.cross_entropy(head(emb(batch[:, 0])), batch[:, 1])  # predict the context word
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        for opt in optimizers:
            opt.step()
        if step % 100 == 0 or step == args.steps - 1:
            print(f"step {step:4d} loss {loss.item():.3f}")

    show("after", emb.weight)
    for word in ("king", "man"):
        neighbours = most_similar(emb.weight, word, k=3, vocab=VOCAB)
        print(f"nearest to {word}: " + ", ".join(f"{w} ({c:+.2f})" for w, c in neighbours))
    if args.plot:
        groups = ["royal"] * 4 + ["common"] * 4 + ["royal things"] * 4 + ["common things"] * 4
        plot_embeddings_2d(emb.weight, WORDS, groups, path=args.plot)
        print(f"plot saved to {args.plot}")


if __name__ == "__main__":
    main()
