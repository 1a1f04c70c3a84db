"""The fused op on DTensors (DESIGN §10): how each placement of the token table is
computed, so that torch.distributed's parallel styles apply to ``FusedEmbedding`` as
they do to ``nn.Embedding`` (torchtitan's ``RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))`` for ``tok_embeddings``).

The rules, for a table on a 1-D mesh (ids replicated, as the parallel styles give them):

- ``Shard(0)`` (vocab rows, ``RowwiseParallel``): each rank looks up its own rows with
  ids shifted into its shard; an id outside the shard is out of range for the local table,
  which every kernel turns into a zero row, positional term included, with no memory
  access and no gradient -- no redirect to row 0 (DTensor's own ``_MaskPartial`` for
  ``aten.embedding`` masks ids to 0, a hot row in the backward). The output is
  ``Partial()``: the style then sums it (``Replicate``) or reduce-scatters it (``Shard(1)``).
  The backward is local: each rank writes the gradient of its own rows only (a
  ``Shard(0)`` gradient, like the table), from the whole output gradient (``Replicate``); the learned positions get the
  full gradient on every rank (each token's position row counts once).
- ``Shard(1)`` (feature columns, ``ColwiseParallel``): each rank computes its columns; the
  output is ``Shard(-1)``.
- ``Replicate()``: the single-device op on every rank.

Why not a DTensor strategy on the custom ops: the ops take global ids and a global vocab
size (the backward allocates ``num_embeddings`` rows), and a strategy cannot rewrite those
arguments per rank; the shard's offset is known only here, from the mesh coordinate.
"""

from __future__ import annotations

import sys

import torch

from . import checks


def is_dtensor(t) -> bool:
    """True for a DTensor (cheap: a plain tensor or Parameter is answered without importing
    torch.distributed.tensor; no DTensor exists before that module is imported)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or t is None:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _replicated(t, name: str):
    """The full local value of a replicated DTensor (or a plain tensor)."""
    if not is_dtensor(t):
        return t
    from torch.distributed.tensor import Replicate

    if any(not isinstance(p, Replicate) for p in t.placements):
        raise checks.InputValueError(
            f"pyembed: {name} must be replicated over the mesh (Replicate()), got placements {tuple(t.placements)}")
    return t.to_local()


def fused_embedding(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                    scale_grad_by_freq, sparse, validate, backend, dropout_p):
    """pyembed.functional.apply_fused on the local shard of a DTensor table (arguments
    already checked and normalised); returns a DTensor on the table's mesh (placements as
    in the module docstring)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from .functional import _checked_ids, apply_fused  # functional imports this module

    mesh = weight.device_mesh
    if mesh.ndim != 1:
        raise checks.InputValueError(
            f"pyembed: a DTensor table must live on a 1-D mesh (the tensor-parallel one), got a {mesh.ndim}-D mesh "
            f"with placements {tuple(weight.placements)}; FSDP gathers its dimension before the forward")
    (placement,) = weight.placements
    if dropout_p > 0:
        raise checks.InputValueError(
            "pyembed: dropout on a DTensor table is not supported yet (each rank would draw its own mask); "
            "apply dropout after the layer")
    if sparse:
        raise checks.InputValueError(
            "pyembed: sparse gradients of a DTensor table are not supported (DTensor cannot hold a sparse "
            "gradient: nn.Embedding(sparse=True) fails under RowwiseParallel too); use sparse=False here, or "
            "pyembed.parallel.VocabParallelEmbeddingLayer for a vocab-parallel table with sparse gradients")
    if isinstance(placement, Shard) and placement.dim == 1 and pos_encoding != "none":
        raise checks.InputValueError("pyembed: a column-sharded (Shard(1)) table takes no positional encoding here yet")
    ids = _replicated(ids, "ids")
    position_ids = _replicated(position_ids, "position_ids")
    pos_weight = _replicated(pos_weight, "pos_weight")
    if validate:  # every rank checks the same global ids: a bad id raises on all of them
        _checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)

    def run(local_ids, local_weight, local_pos_weight, local_padding_idx):
        return apply_fused(local_ids, local_weight, local_pos_weight, position_ids, pos_encoding, scale, offset,
                           local_padding_idx, scale_grad_by_freq, sparse, False, backend)

    if isinstance(placement, Shard) and placement.dim == 0:
        rows, start = Shard.local_shard_size_and_offset(weight.shape[0], mesh.size(0), mesh.get_local_rank(0))
        local_padding_idx = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else None
        # Shifted, not masked: ids of other shards are out of [0, rows), so they give zero rows.
        out = run(ids - start, weight.to_local(), pos_weight, local_padding_idx)
        return DTensor.from_local(out, mesh, [Partial()], grad_placements=[Replicate()])
    if isinstance(placement, Shard) and placement.dim == 1:
        out = run(ids, weight.to_local(), None, padding_idx)
        dim = weight.shape[1]
        return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], shape=(*ids.shape, dim),
                                  stride=torch.empty(*ids.shape, dim, device="meta").stride())
    if isinstance(placement, Replicate):
        out = run(ids, weight.to_local(), pos_weight, padding_idx)
        return DTensor.from_local(out, mesh, [Replicate()])
    raise checks.InputValueError(
        f"pyembed: a token table with placement {placement!r} is not supported; use Shard(0) (RowwiseParallel), "
        f"Shard(1) (ColwiseParallel) or Replicate()")
