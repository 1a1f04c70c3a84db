"""``pyembed.parallel.RowwiseParallel`` / ``ColwiseParallel``: torch's parallel styles,
which also take an ``EmbeddingLayer`` (torch's apply to ``nn.Linear`` and ``nn.Embedding``
only). Imported on first use: torch.distributed.tensor.parallel costs ~2 s to import.

On an ``EmbeddingLayer`` (DESIGN §10; the computation is pyembed._dtensor's):
- ``RowwiseParallel``: token table ``Shard(0)``, learned positions ``Replicate()`` (each
  token's position row is added once, by the rank holding its id), output ``Partial``
  summed into ``output_layouts`` (default ``Replicate()``; ``Shard(1)`` as torchtitan).
- ``ColwiseParallel``: token table and learned positions ``Shard(1)``, a sinusoid taken
  at the global columns, output ``Shard(-1)`` by default.
Inputs (``ids`` and ``position_ids``, positional or keyword) are annotated with
``input_layouts`` and made ``Replicate()``; dropout draws one key for the mesh.
"""

from __future__ import annotations

from functools import partial

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import style

from .modules import EmbeddingLayer


class _EmbeddingLayerStyle:
    """The EmbeddingLayer branch of a torch style's ``_apply`` (others go to torch's)."""

    token_placement: Shard
    positions_placement: Shard | Replicate

    def _apply(self, module, device_mesh):
        if not isinstance(module, EmbeddingLayer):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Replicate(),)
        _distribute_parameter(module.token_embedding, "weight", device_mesh, self.token_placement, self.src_data_rank)
        if module.pos_embedding is not None:
            _distribute_parameter(module, "pos_embedding", device_mesh, self.positions_placement, self.src_data_rank)
        module.register_forward_pre_hook(partial(_replicated_inputs, self.input_layouts, device_mesh),
                                         with_kwargs=True)
        module.register_forward_hook(
            lambda mod, inputs, out: self._prepare_output_fn(self.output_layouts, self.use_local_output, mod, out,
                                                             device_mesh))
        return module


def _distribute_parameter(module, name: str, mesh, placement, src_data_rank) -> None:
    param = getattr(module, name)
    module.register_parameter(name, torch.nn.Parameter(
        distribute_tensor(param.detach(), mesh, [placement], src_data_rank=src_data_rank),
        requires_grad=param.requires_grad))


def _replicated_inputs(input_layouts, mesh, module, args, kwargs):
    """ids and position_ids (tensors, where given) as Replicate() DTensors; offset as is."""
    def replicated(t):
        if not isinstance(t, torch.Tensor):
            return t
        if not isinstance(t, DTensor):
            t = DTensor.from_local(t, mesh, input_layouts, run_check=False)
        return t if t.placements == (Replicate(),) else t.redistribute(placements=[Replicate()])

    return tuple(map(replicated, args)), {k: replicated(v) for k, v in kwargs.items()}


class RowwiseParallel(_EmbeddingLayerStyle, style.RowwiseParallel):
    """``torch.distributed.tensor.parallel.RowwiseParallel``, also for ``EmbeddingLayer``:
    vocab-sharded token table, replicated learned positions. Same arguments."""

    token_placement, positions_placement = Shard(0), Replicate()


class ColwiseParallel(_EmbeddingLayerStyle, style.ColwiseParallel):
    """``torch.distributed.tensor.parallel.ColwiseParallel``, also for ``EmbeddingLayer``:
    token table and learned positions sharded by columns; a sinusoid at its global
    columns. Same arguments."""

    token_placement, positions_placement = Shard(1), Shard(1)
