"""Tensor parallelism on ``torch.distributed``.

- ``RowwiseParallel`` / ``ColwiseParallel``: torch's parallel styles, which also take an
  ``EmbeddingLayer`` (for ``parallelize_module``; pyembed/_styles.py). A ``FusedEmbedding``
  takes torch's own styles as they are.
- ``VocabParallelEmbeddingLayer``: an ``EmbeddingLayer`` whose token table is split by
  rows over a process group without DTensor parameters (as Megatron-LM's
  ``VocabParallelEmbedding``): its shard is a plain Parameter, so ``sparse=True`` and
  ``SparseAdam`` work, which a DTensor table cannot offer. Same computation as a
  ``Shard(0)`` DTensor table (pyembed._dtensor.rowwise_partial):

    partial_r = fused_embedding(ids - vocab_start_r, shard_r, PE)   # one fused pass per rank
    out       = all_reduce_sum(partial_r)                            # as DTensor's Partial -> Replicate

Ids outside a rank's shard are out of range for its local table, which every backend
skips inside the kernel: the whole row is zero, positional term included, with no memory
access and no gradient -- no redirection to row 0, so no hot row serialises the
backward. Exactly one rank holds each id and computes round(W[id] * scale + PE) for it,
the others add exact zeros, so the output is bitwise the single-device layer's and the
positional term is added once. Backward is the identity through the reduce (the layers
after this one are replicated, so every rank holds the whole output gradient): each rank
computes the gradient of its own rows only, and every rank the same learned-positions
gradient (from every token).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from . import _dtensor, checks, dispatch
from ._autograd import FusedConfig
from .modules import _INIT_POS_STD, EmbeddingLayer, FusedEmbedding, check_layer_pos_encoding


def __getattr__(name: str):
    # The styles subclass torch's, whose module costs ~2 s to import: loaded on first use.
    if name in ("RowwiseParallel", "ColwiseParallel"):
        from . import _styles

        return getattr(_styles, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def shard_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int]:
    """The rows ``[start, end)`` held by ``rank``: contiguous, the first
    ``vocab_size % world_size`` ranks hold one row more (50257 over 3: 16753, 16752, 16752)."""
    base, extra = divmod(vocab_size, world_size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


class _SumOverRanks(torch.autograd.Function):
    """The ranks' partial outputs summed (all-reduce), what a Shard(0) DTensor's Partial ->
    Replicate does. The backward is the identity: the layers after this one are
    replicated, so every rank already holds the whole output gradient. (Not through a
    DeviceMesh: one held by the layer kept the group alive past destroy_process_group, and
    gloo then aborted at interpreter exit in 4 runs of 16; 0 of 28 without it.)"""

    @staticmethod
    def forward(ctx, part, group):
        total = part.clone()  # a new output: reducing into part would hand autograd an input as the output
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class VocabParallelEmbeddingLayer(nn.Module):
    """``EmbeddingLayer`` with its token table split by rows over a process group.

    Same arguments and forward as ``EmbeddingLayer`` (no dropout: apply it after, with an
    RNG seeded alike on every rank), plus ``process_group`` (default: the whole world).
    ``token_embedding.weight`` is this rank's shard, rows ``vocab_start:vocab_end`` of the
    full table; ``pos_embedding`` is replicated (broadcast from the group's first rank at
    construction). ``padding_idx`` is a global row id. Every rank of the group must call
    the constructor and ``forward`` together, with the same ids.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        max_seq_len: int = 512,
        pos_encoding: Optional[str] = "learned",
        scale_embeddings: bool = False,
        *,
        padding_idx: Optional[int] = None,
        sparse: bool = False,
        process_group: Optional[dist.ProcessGroup] = None,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("pyembed: VocabParallelEmbeddingLayer needs torch.distributed.init_process_group() first")
        check_layer_pos_encoding(pos_encoding, embed_dim)
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        if vocab_size < self.world_size:
            raise checks.InputValueError(f"pyembed: cannot split V={vocab_size} rows over {self.world_size} ranks")
        self.vocab_size, self.embed_dim, self.max_seq_len = vocab_size, embed_dim, max_seq_len
        self.pos_encoding, self.scale_embeddings = pos_encoding, scale_embeddings
        self.scale = math.sqrt(embed_dim) if scale_embeddings else 1.0
        self.backend = backend
        self.vocab_start, self.vocab_end = shard_range(vocab_size, self.rank, self.world_size)

        self.padding_idx = padding_idx = checks.normalize_padding_idx(padding_idx, vocab_size)  # a global row
        holds_padding = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        local_padding = padding_idx - self.vocab_start if holds_padding else None
        self.token_embedding = FusedEmbedding(
            self.vocab_end - self.vocab_start, embed_dim, padding_idx=local_padding, sparse=sparse,
            device=device, dtype=dtype, backend=backend,
        )
        if pos_encoding == "learned":
            self.pos_embedding = nn.Parameter(torch.empty(max_seq_len, embed_dim, device=device, dtype=dtype))
            nn.init.normal_(self.pos_embedding, std=_INIT_POS_STD)
            with torch.no_grad():  # one table for all ranks, whatever each rank's RNG
                dist.broadcast(self.pos_embedding, dist.get_global_rank(self._group, 0), group=process_group)
        else:
            self.register_parameter("pos_embedding", None)

    @property
    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    @classmethod
    def from_full(cls, layer: EmbeddingLayer, process_group: Optional[dist.ProcessGroup] = None
                  ) -> "VocabParallelEmbeddingLayer":
        """This rank's shard of a single-device ``layer`` (which every rank holds, e.g.
        built from one seed or loaded from one checkpoint). Parameters are copied."""
        if layer.dropout != 0:
            raise checks.InputValueError(
                "pyembed: VocabParallelEmbeddingLayer has no dropout; apply it after the layer")
        token = layer.token_embedding
        # (max_norm: a token table EmbeddingLayer.from_modules took with it)
        for option, given in (("scale_grad_by_freq", token.scale_grad_by_freq),
                              ("max_norm", token.max_norm is not None)):
            if given:
                raise checks.InputValueError(f"pyembed: {option} is not supported by VocabParallelEmbeddingLayer")
        new = cls(layer.vocab_size, layer.embed_dim, layer.max_seq_len, layer.pos_encoding, layer.scale_embeddings,
                  padding_idx=token.padding_idx, sparse=token.sparse, process_group=process_group,
                  backend=layer.backend, device=token.weight.device, dtype=token.weight.dtype)
        new.scale = layer.scale  # from_modules layers carry any scale
        with torch.no_grad():
            new.token_embedding.weight.copy_(token.weight[new.vocab_start:new.vocab_end])
            if layer.pos_embedding is not None:
                new.pos_embedding.copy_(layer.pos_embedding)
        return new

    def forward(self, ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, offset: int = 0) -> torch.Tensor:
        """ids: (B, T) or (T,) global token ids, the same on every rank -> (B, T, d) / (T, d),
        the whole output on every rank."""
        token = self.token_embedding
        weight = token.weight
        pos_encoding, position_ids = checks.check_inputs(ids, weight, self.pos_embedding, self.pos_encoding,
                                                         position_ids, offset)
        ids = self._checked_together(ids, position_ids)
        config = FusedConfig(pos_encoding, float(self.scale), offset, self.padding_idx, False, token.sparse, False,
                             dispatch.resolve(self.backend, weight.device).name)
        part = _dtensor.rowwise_partial(ids, weight, self.vocab_start, self.pos_embedding, position_ids, config, None)
        return _SumOverRanks.apply(part, self._group)

    def _checked_together(self, ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        """ids, after the data checks of the single-device layer (the same IndexError /
        ValueError) on the extremes over every rank: all ranks raise together or none does,
        so no rank is left waiting in the all-reduce for one that raised. Under
        torch.compile by an op of the graph (pyembed::checked_by_extremes), whose copy of the
        ids the lookup reads."""
        extremes = checks.range_extremes(ids, position_ids)
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.process_group)
        max_seq_len = self.max_seq_len if self.pos_encoding == "learned" else None
        if torch.compiler.is_compiling():
            return torch.ops.pyembed.checked_by_extremes(ids, extremes, self.vocab_size,
                                                         -1 if max_seq_len is None else max_seq_len)
        checks.raise_for_extremes(extremes.tolist(), self.vocab_size, max_seq_len)
        return ids

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The single-device ``EmbeddingLayer``'s state_dict, gathered on the group's
        first rank (an empty dict on the others). Every rank must call it."""
        shard = self.token_embedding.weight.detach()
        ranges = [shard_range(self.vocab_size, r, self.world_size) for r in range(self.world_size)]
        rows = max(end - start for start, end in ranges)
        # gather needs equal sizes: pad every shard to the largest, trim after.
        padded = shard.new_zeros(rows, self.embed_dim)
        padded[: shard.shape[0]] = shard
        first = dist.get_global_rank(self._group, 0)
        pieces = [torch.empty_like(padded) for _ in ranges] if self.rank == 0 else None
        dist.gather(padded, pieces, dst=first, group=self.process_group)
        if self.rank != 0:
            return {}
        state = {"token_embedding.weight": torch.cat([p[: end - start] for p, (start, end) in zip(pieces, ranges)])}
        if self.pos_embedding is not None:
            state["pos_embedding"] = self.pos_embedding.detach().clone()
        return state

    # The shard's place in the table travels with a per-rank state_dict, so loading it
    # into a layer that holds other rows fails loudly instead of scrambling the table.
    def get_extra_state(self) -> dict[str, int]:
        return {"vocab_size": self.vocab_size, "vocab_start": self.vocab_start, "vocab_end": self.vocab_end}

    def set_extra_state(self, state: dict[str, int]) -> None:
        mine = self.get_extra_state()
        if state != mine:
            raise checks.InputValueError(
                f"pyembed: this checkpoint shard holds rows {state['vocab_start']}..{state['vocab_end']} "
                f"of V={state['vocab_size']}, but this rank holds rows "
                f"{self.vocab_start}..{self.vocab_end} of V={self.vocab_size}")

    def extra_repr(self) -> str:
        return (
            f"{self.vocab_size}, {self.embed_dim}, max_seq_len={self.max_seq_len}, "
            f"pos_encoding={self.pos_encoding!r}, scale_embeddings={self.scale_embeddings}, "
            f"rows={self.vocab_start}..{self.vocab_end} (rank {self.rank} of {self.world_size}), "
            f"backend={self.backend!r}"
        )

