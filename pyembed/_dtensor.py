"""The fused op on DTensors (DESIGN §10): how each placement of the token table is
computed, so that torch.distributed's parallel styles apply to ``FusedEmbedding`` as
they do to ``nn.Embedding`` (torchtitan's ``RowwiseParallel(input_layouts=Replicate(),
output_layouts=Shard(1))`` for ``tok_embeddings``), and ours (pyembed.parallel) to
``EmbeddingLayer``.

The rules, for a table on a 1-D mesh (ids replicated, as the parallel styles give them):

- ``Shard(0)`` (vocab rows, ``RowwiseParallel``): each rank looks up its own rows with
  ids shifted into its shard; an id outside the shard is out of range for the local table,
  which every kernel turns into a zero row, positional term included, with no memory
  access and no gradient -- no redirect to row 0 (DTensor's own ``_MaskPartial`` for
  ``aten.embedding`` masks ids to 0, a hot row in the backward). The output is
  ``Partial()``: the style then sums it (``Replicate``) or reduce-scatters it (``Shard(1)``),
  so each token's row and positional term are added by the one rank holding its id.
  The backward is local: each rank writes the gradient of its own rows only (a
  ``Shard(0)`` gradient, like the table), from the whole output gradient (``Replicate``);
  a replicated learned positional table gets the full gradient on every rank (the
  backward counts every token's position, in range or not).
- ``Shard(1)`` (feature columns, ``ColwiseParallel``): each rank computes its columns;
  the output is ``Shard(-1)``. A learned positional table is column-sharded alike; a
  sinusoid is taken at the global columns (the ops' ``sinusoid_column_offset``).
- ``Replicate()``: the single-device op on every rank.

Dropout: one key for the whole mesh (drawn on its first rank, broadcast), so the mask is
the single-device one: under ``Shard(0)`` each kept element lives on one rank, under
``Shard(1)`` the key's Philox offset moves by the shard's first column / 4 (a group of
four columns is one Philox call), which needs shards starting at multiples of 4.

Why not a DTensor strategy on the custom ops: the ops take global ids and a global vocab
size (the backward allocates ``num_embeddings`` rows), and a strategy cannot rewrite those
arguments per rank; the shard's offset is known only here, from the mesh coordinate.
Sparse gradients: a DTensor cannot hold a sparse tensor, and no optimizer steps one
(``nn.Embedding(sparse=True)`` fails under ``RowwiseParallel`` too), so a sharded table
with ``sparse=True`` is refused; ``VocabParallelEmbeddingLayer`` keeps its shard a plain
Parameter and runs ``rowwise_partial`` below, sparse gradients included.
"""

from __future__ import annotations

import functools
import inspect

import torch

from . import checks, reference
from ._autograd import FusedConfig, apply_fused, checked_ids
from .checks import is_dtensor


def _local(t, name: str, placement):
    """The local value of a DTensor with ``placement`` on every mesh dimension (or a
    plain tensor, taken as the whole value)."""
    if not is_dtensor(t):
        return t
    if any(p != placement for p in t.placements):
        raise checks.InputValueError(
            f"pyembed: {name} must have placement {placement!r} here, got placements {tuple(t.placements)}")
    return t.to_local()


def _unsupported(placement, why: str) -> checks.InputValueError:
    return checks.InputValueError(
        f"pyembed: a token table with placement {placement!r} is not supported{why}; use Shard(0) "
        f"(RowwiseParallel), Shard(1) (ColwiseParallel) or Replicate() on a 1-D mesh")


def shared_dropout_key(mesh, device, generator):
    """One dropout key for every rank of ``mesh``: drawn on each, the first rank's kept
    (a broadcast), so the sharded layer drops the single-device layer's elements."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    key = reference.draw_dropout_key(device, generator)
    return distribute_tensor(key, mesh, [Replicate()], src_data_rank=0).to_local()


def rowwise_partial(ids, local_weight, start: int, pos_weight, position_ids, config: FusedConfig, dropout_key):
    """This rank's part of the lookup of a row shard (rows ``start .. start + len``):
    ids shifted into the shard, so other shards' ids are out of range and give zero rows
    (positional term included) and no gradient. Ids already checked (config.validate is
    not looked at). Summing the parts over the ranks gives the single-device output."""
    rows, padding_idx = local_weight.shape[0], config.padding_idx
    local_padding_idx = padding_idx - start if padding_idx is not None and 0 <= padding_idx - start < rows else None
    return apply_fused(ids - start, local_weight, pos_weight, position_ids, dropout_key,
                       config._replace(padding_idx=local_padding_idx, validate=False, error_record=0))


def _constant_under_compile(fn):
    """torch.compiler.assume_constant_result's mark: Dynamo calls ``fn`` once while tracing
    and keeps its result as a constant of the graph. Set here, since importing that function
    imports Dynamo, Inductor and Triton with pyembed."""
    fn._dynamo_marked_constant = True
    return fn


@functools.cache
@_constant_under_compile  # Dynamo cannot trace inspect.signature (and traces into the cache)
def _from_local_takes_grad_placements() -> bool:
    """Asked once (inspect.signature costs ~10 us, and this is on every forward)."""
    from torch.distributed.tensor import DTensor

    return "grad_placements" in inspect.signature(DTensor.from_local).parameters


def _partial_from_local(out, mesh):
    """The partial sums of a row shard as a DTensor(Partial) whose local gradient is the
    whole (Replicate) gradient: each rank's part contributes with weight one."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    if _from_local_takes_grad_placements():
        return DTensor.from_local(out, mesh, [Partial()], grad_placements=[Replicate()])
    # Older torch (2.11) has no grad_placements; its backward of from_local turns a Replicate
    # gradient into a Partial one by keeping each rank's tensor (is_backward=True): the same.
    return DTensor.from_local(out, mesh, [Partial()])


def fused_embedding(ids, weight, pos_weight, position_ids, config: FusedConfig, generator):
    """pyembed._autograd.apply_fused on the local shard of a DTensor table (arguments
    already checked and normalised; config.validate: check the global ids here, on every
    rank); returns a DTensor on the table's mesh (placements as in the module docstring)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    pos_encoding, dropout_p = config.pos_encoding, config.dropout_p

    mesh = weight.device_mesh
    placement = weight.placements[0]
    if mesh.ndim != 1:
        raise _unsupported(placement, f" on a {mesh.ndim}-D mesh (placements {tuple(weight.placements)}; FSDP "
                                      f"gathers its dimension before the forward)")
    if not isinstance(placement, (Shard, Replicate)) or isinstance(placement, Shard) and placement.dim not in (0, 1):
        raise _unsupported(placement, "")
    if config.sparse:
        raise checks.InputValueError(
            "pyembed: sparse gradients of a DTensor table are not supported (DTensor cannot hold a sparse "
            "gradient: nn.Embedding(sparse=True) fails under RowwiseParallel too); use sparse=False here, or "
            "pyembed.parallel.VocabParallelEmbeddingLayer for a vocab-parallel table with sparse gradients")
    columns = placement == Shard(1)
    dim = weight.shape[1]
    first_column = Shard.local_shard_size_and_offset(dim, mesh.size(0), mesh.get_local_rank(0))[1] if columns else 0
    if columns:  # judged on the split, not this rank's shard, so that every rank raises together
        chunk = -(-dim // mesh.size(0))  # torch.chunk's: every shard starts at a multiple of it
        for feature, multiple in (("dropout", 4 if dropout_p > 0 else 1),
                                  ("a sinusoid", 2 if pos_encoding == "sinusoidal" else 1)):
            if chunk % multiple and chunk < dim:
                raise checks.InputValueError(
                    f"pyembed: {feature} on a Shard(1) table needs shards starting at multiples of {multiple} "
                    f"columns; d={dim} over {mesh.size(0)} ranks gives shards of {chunk} columns")
    ids = _local(ids, "ids", Replicate())
    position_ids = _local(position_ids, "position_ids", Replicate())
    pos_weight = _local(pos_weight, "pos_weight", Shard(1) if columns else Replicate())
    if config.validate:  # every rank checks the same global ids: a bad id raises on all of them
        checked_ids(ids, weight, pos_weight, position_ids, pos_encoding)
    local_weight = weight.to_local()
    dropout_key = shared_dropout_key(mesh, local_weight.device, generator) if dropout_p > 0 else None

    if placement == Shard(0):
        _, start = Shard.local_shard_size_and_offset(weight.shape[0], mesh.size(0), mesh.get_local_rank(0))
        out = rowwise_partial(ids, local_weight, start, pos_weight, position_ids, config, dropout_key)
        return _partial_from_local(out, mesh)
    # Shard(1) or Replicate(): this rank's columns, from first_column on (all of them when replicated).
    if dropout_key is not None and first_column:  # global column j is word j % 4 of Philox call offset + j // 4
        dropout_key = dropout_key + torch.tensor([0, first_column // 4], device=dropout_key.device)
    out = apply_fused(ids, local_weight, pos_weight, position_ids, dropout_key,
                      config._replace(validate=False, sinusoid_column_offset=first_column, sinusoid_dim=dim))
    if not columns:
        return DTensor.from_local(out, mesh, [Replicate()])
    return DTensor.from_local(out, mesh, [Shard(out.dim() - 1)], shape=(*ids.shape, dim),
                              stride=torch.empty(*ids.shape, dim, device="meta").stride())
