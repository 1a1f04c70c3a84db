"""Look inside embedding tables: neighbours, analogies, memory footprint, plots.

Works on any (V, d) table -- ``layer.token_embedding.weight``, ``emb.weight`` or a
tensor from a checkpoint. Similarities are cosines computed on the table's device in
one matrix product (no Python loop over the vocabulary). Words are accepted wherever ids
are when a ``vocab`` mapping (str -> id) is given, and results then carry words too.

    python -m pyembed.analysis memory --vocab 50257 --dim 768 --dtype bf16
    python -m pyembed.analysis pe-heatmap --len 100 --dim 64 --out pe.png
    python -m pyembed.analysis neighbors --checkpoint model.pt --key token_embedding.weight --id 42
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Mapping, Optional, Sequence, Union

import torch
import torch.nn.functional as F

from .checks import POS_CODES
from .reference import sinusoidal_table

Token = Union[int, str]
MIB = 2.0**20
_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "fp64": torch.float64}


# --------------------------------------------------------------------------- similarity
def _check_table(weight: torch.Tensor) -> None:
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise ValueError(f"pyembed.analysis: expected a (V, d) table, got {got}")


def _to_id(token: Token, weight: torch.Tensor, vocab: Optional[Mapping[str, int]]) -> int:
    if isinstance(token, str):
        if vocab is None:
            raise ValueError(f"pyembed.analysis: got the word {token!r} but no vocab mapping")
        if token not in vocab:
            raise ValueError(f"pyembed.analysis: unknown word {token!r} (not in the vocab)")
        token = vocab[token]
    token = int(token)
    if not 0 <= token < weight.shape[0]:
        raise IndexError(f"pyembed.analysis: id {token} is out of range for a table of V={weight.shape[0]} rows")
    return token


def _unit_rows(weight: torch.Tensor) -> torch.Tensor:
    return F.normalize(weight.detach().float(), dim=1)


def cosine_similarity_matrix(weight: torch.Tensor, ids: Optional[Sequence[int]] = None) -> torch.Tensor:
    """(n, n) cosine similarities between the rows ``ids`` (default: all rows), in fp32."""
    _check_table(weight)
    rows = weight if ids is None else weight[torch.as_tensor([_to_id(i, weight, None) for i in ids], dtype=torch.long,
                                                             device=weight.device)]
    unit = _unit_rows(rows)
    return unit @ unit.T


def _top_k(weight, target: torch.Tensor, k: int, exclude: set[int], vocab):
    if k < 1 or k > weight.shape[0] - len(exclude):
        raise ValueError(f"pyembed.analysis: k={k} but only {weight.shape[0] - len(exclude)} rows can be returned "
                         f"(V={weight.shape[0]}, {len(exclude)} excluded)")
    sims = _unit_rows(weight) @ F.normalize(target.float(), dim=0)
    if exclude:
        sims[torch.tensor(sorted(exclude), device=sims.device)] = float("-inf")
    values, ids = sims.topk(k)
    names = {i: w for w, i in vocab.items()} if vocab is not None else {}
    return [(names.get(i, i), v) for i, v in zip(ids.tolist(), values.tolist())]


def most_similar(weight: torch.Tensor, query: Union[Token, torch.Tensor], k: int = 5, exclude: Sequence[Token] = (),
                 vocab: Optional[Mapping[str, int]] = None) -> list[tuple[Token, float]]:
    """The k rows closest in cosine to ``query`` -- a row id, a word (with ``vocab``) or a
    (d,) vector -- best first, as ``(id or word, cosine)``. A query row is excluded."""
    _check_table(weight)
    excluded = {_to_id(t, weight, vocab) for t in exclude}
    if isinstance(query, torch.Tensor):
        if query.shape != (weight.shape[1],):
            raise ValueError(f"pyembed.analysis: query vector has shape {tuple(query.shape)}, expected "
                             f"({weight.shape[1]},)")
        target = query.to(weight.device)
    else:
        qid = _to_id(query, weight, vocab)
        excluded.add(qid)
        target = weight[qid].detach()
    return _top_k(weight, target, k, excluded, vocab)


def analogy(weight: torch.Tensor, a: Token, b: Token, c: Token, k: int = 5,
            vocab: Optional[Mapping[str, int]] = None) -> list[tuple[Token, float]]:
    """a is to b as c is to ?: the rows closest to unit(b) - unit(a) + unit(c) (3CosAdd),
    excluding a, b and c, as ``(id or word, cosine)``, best first."""
    _check_table(weight)
    ia, ib, ic = (_to_id(t, weight, vocab) for t in (a, b, c))
    unit = _unit_rows(weight[[ia, ib, ic]])
    return _top_k(weight, unit[1] - unit[0] + unit[2], k, {ia, ib, ic}, vocab)


# --------------------------------------------------------------------------- memory
@dataclass(frozen=True)
class MemoryFootprint:
    vocab_size: int
    embed_dim: int
    dtype: torch.dtype
    optimizer: Optional[str]
    table_bytes: int
    position_bytes: int
    gradient_bytes: int
    optimizer_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.table_bytes + self.position_bytes + self.gradient_bytes + self.optimizer_bytes

    def __str__(self) -> str:
        name = {v: k for k, v in _DTYPES.items()}.get(self.dtype, str(self.dtype))
        parts = [f"table {self.table_bytes / MIB:.2f} MiB", f"positions {self.position_bytes / MIB:.2f} MiB",
                 f"gradient {self.gradient_bytes / MIB:.2f} MiB",
                 f"optimizer ({self.optimizer or 'none'}) {self.optimizer_bytes / MIB:.2f} MiB",
                 f"total {self.total_bytes / MIB:.2f} MiB"]
        return f"{self.vocab_size} x {self.embed_dim} {name}: " + ", ".join(parts)


def memory_footprint(vocab_size: int, embed_dim: int, *, dtype: torch.dtype = torch.float32,
                     max_seq_len: Optional[int] = None, pos_encoding: Optional[str] = "learned",
                     optimizer: Optional[str] = "adamw", sparse: bool = False,
                     touched_rows: Optional[int] = None) -> MemoryFootprint:
    """Bytes of an input layer in training. Positions count only for a learned table with a
    ``max_seq_len`` (a sinusoid is computed, never stored). The token gradient is V x d
    dense, or with ``sparse=True`` ``touched_rows`` rows (default: all V, the worst case)
    plus their int64 indices; the positional gradient is always dense. Optimizer state:
    AdamW and SparseAdam keep two tensors per parameter (SparseAdam's are dense), SGD none."""
    if pos_encoding is not None and pos_encoding not in POS_CODES:
        raise ValueError(f"pyembed.analysis: unknown pos_encoding {pos_encoding!r}")
    if optimizer not in (None, "adamw", "sgd", "sparse_adam"):
        raise ValueError(f"pyembed.analysis: optimizer must be 'adamw', 'sgd', 'sparse_adam' or None, got {optimizer!r}")
    es = torch.empty((), dtype=dtype).element_size()
    row = embed_dim * es
    table = vocab_size * row
    positions = (max_seq_len or 0) * row if pos_encoding == "learned" else 0
    if sparse:
        rows = vocab_size if touched_rows is None else min(touched_rows, vocab_size)
        gradient = rows * (row + 8) + positions
    else:
        gradient = table + positions
    states = {None: 0, "sgd": 0, "adamw": 2, "sparse_adam": 2}[optimizer]
    return MemoryFootprint(vocab_size, embed_dim, dtype, optimizer, table, positions, gradient,
                           states * (table + positions))


# --------------------------------------------------------------------------- plots
def _figure(figsize):
    """(fig, ax) on a figure with its own Agg canvas: no pyplot, so the user's matplotlib
    backend and pyplot's figure list are left alone. matplotlib is imported here, when a
    plot is drawn (the [analysis] extra)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("pyembed.analysis: plots need matplotlib: pip install matplotlib") from exc
    fig = Figure(figsize=figsize)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot()


def _finish(fig, path):
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=100)
    return fig


def plot_positional_encoding(max_seq_len: int, embed_dim: int, path=None):
    """Heatmap of the sinusoidal encoding: positions x dimensions."""
    table = sinusoidal_table(max_seq_len, embed_dim)
    fig, ax = _figure((8, 4.5))
    im = ax.imshow(table.numpy(), aspect="auto", cmap="RdBu_r", vmin=-1, vmax=1, interpolation="nearest")
    ax.set(xlabel="dimension (even: sin, odd: cos)", ylabel="position",
           title=f"sinusoidal positional encoding, {max_seq_len} x {embed_dim}")
    fig.colorbar(im, ax=ax)
    return _finish(fig, path)


def plot_position_similarity(max_seq_len: int, embed_dim: int, ref_pos: int = 0, path=None):
    """Cosine similarity of every position's sinusoidal encoding to position ``ref_pos``."""
    if not 0 <= ref_pos < max_seq_len:
        raise IndexError(f"pyembed.analysis: ref_pos {ref_pos} is outside 0..{max_seq_len - 1}")
    sims = cosine_similarity_matrix(sinusoidal_table(max_seq_len, embed_dim))[ref_pos]
    fig, ax = _figure((7, 3.5))
    ax.plot(sims.numpy())
    ax.axvline(ref_pos, color="gray", linestyle=":")
    ax.set(xlabel="position", ylabel=f"cosine to position {ref_pos}", title=f"sinusoidal encoding, d={embed_dim}")
    return _finish(fig, path)


def plot_embeddings_2d(weight: torch.Tensor, labels: Sequence[str], groups: Optional[Sequence[str]] = None,
                       path=None):
    """The rows of ``weight`` projected on their first two principal components
    (``torch.pca_lowrank``), labelled, coloured by ``groups``."""
    _check_table(weight)
    if len(labels) != weight.shape[0] or (groups is not None and len(groups) != weight.shape[0]):
        raise ValueError(f"pyembed.analysis: {weight.shape[0]} rows but {len(labels)} labels"
                         + ("" if groups is None else f" and {len(groups)} groups"))
    x = weight.detach().float().cpu()
    _, _, v = torch.pca_lowrank(x, q=min(2, *x.shape), center=True)
    xy = ((x - x.mean(0)) @ v[:, :2]).numpy()
    fig, ax = _figure((6, 5))
    names = list(dict.fromkeys(groups)) if groups is not None else [None]
    for name in names:
        idx = [i for i in range(len(labels)) if groups is None or groups[i] == name]
        ax.scatter(xy[idx, 0], xy[idx, 1] if xy.shape[1] > 1 else [0] * len(idx), label=name)
    for i, label in enumerate(labels):
        ax.annotate(label, (xy[i, 0], xy[i, 1] if xy.shape[1] > 1 else 0), fontsize=8)
    ax.set(xlabel="PC 1", ylabel="PC 2", title="embeddings, first two principal components")
    if groups is not None:
        ax.legend()
    return _finish(fig, path)


# --------------------------------------------------------------------------- CLI
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m pyembed.analysis", description="Inspect embedding tables.")
    sub = ap.add_subparsers(dest="command", required=True)
    mem = sub.add_parser("memory", help="bytes of an input layer in training")
    mem.add_argument("--vocab", type=int, required=True)
    mem.add_argument("--dim", type=int, required=True)
    mem.add_argument("--dtype", choices=sorted(_DTYPES), default="fp32")
    mem.add_argument("--max-seq-len", type=int)
    mem.add_argument("--pos", choices=["learned", "sinusoidal", "none"], default="learned")
    mem.add_argument("--optimizer", choices=["adamw", "sgd", "sparse_adam", "none"], default="adamw")
    mem.add_argument("--sparse", action="store_true")
    mem.add_argument("--touched-rows", type=int)
    pe = sub.add_parser("pe-heatmap", help="PNG heatmap of the sinusoidal encoding")
    pe.add_argument("--len", type=int, required=True)
    pe.add_argument("--dim", type=int, required=True)
    pe.add_argument("--out", required=True)
    nb = sub.add_parser("neighbors", help="nearest rows of a table in a checkpoint")
    nb.add_argument("--checkpoint", required=True, help="a file torch.save wrote (a state_dict or a tensor)")
    nb.add_argument("--key", default="weight", help="the table's key in the state_dict")
    nb.add_argument("--id", type=int, required=True)
    nb.add_argument("-k", type=int, default=5)
    args = ap.parse_args(argv)

    if args.command == "memory":
        print(memory_footprint(args.vocab, args.dim, dtype=_DTYPES[args.dtype], max_seq_len=args.max_seq_len,
                               pos_encoding=args.pos, optimizer=None if args.optimizer == "none" else args.optimizer,
                               sparse=args.sparse, touched_rows=args.touched_rows))
    elif args.command == "pe-heatmap":
        plot_positional_encoding(args.len, args.dim, path=args.out)
        print(f"wrote {args.out}")
    else:
        try:
            state = torch.load(args.checkpoint, map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise SystemExit(f"pyembed.analysis: no file {args.checkpoint!r}; make one with "
                             "torch.save(model.state_dict(), 'model.pt')") from None
        if isinstance(state, dict):
            if args.key not in state:
                raise SystemExit(f"no key {args.key!r} in {args.checkpoint}; keys: {sorted(state)[:20]}")
            state = state[args.key]
        try:
            neighbours = most_similar(state, args.id, k=args.k)
        except (ValueError, IndexError) as exc:
            raise SystemExit(str(exc)) from None
        print("id\tcosine")
        for token, cos in neighbours:
            print(f"{token}\t{cos:.4f}")


if __name__ == "__main__":
    main()
