"""What each rank runs in tests/test_dtensor.py (a plain module, so the spawned processes
import it without pytest): FusedEmbedding under torch.distributed's own parallel styles,
FSDP2 over an EmbeddingLayer, and a distributed checkpoint of a sharded table, against
single-process modules built from the same seed on every rank."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

VOCAB, DIM, PADDING_IDX = 50, 12, 37  # 50 rows over 3 ranks: 17, 17, 16; padding on the last shard


def run(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world_size,))
        for backend in backends:
            for style in ("rowwise", "rowwise-sequence", "colwise"):
                check_style_matches_nn_embedding(mesh, style, backend)
            check_bad_id_raises_on_every_rank(mesh, backend)
            check_fsdp2_matches_single_process(mesh, backend)
        check_checkpoint_round_trip(mesh, store_dir, backends[-1])
        check_unsupported_layouts_raise(mesh)
    finally:
        dist.destroy_process_group()


def _style(name: str):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"rowwise": RowwiseParallel(input_layouts=Replicate()),
            "rowwise-sequence": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # torchtitan
            "colwise": ColwiseParallel(input_layouts=Replicate())}[name]


def _modules(mesh, style: str, backend: str):
    """(nn.Embedding, the same table as a FusedEmbedding under ``style``), fp64."""
    import pyembed
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    reference = nn.Embedding(VOCAB, DIM, padding_idx=PADDING_IDX, dtype=torch.float64)
    fused = pyembed.FusedEmbedding.from_pretrained(reference.weight.detach().clone(), freeze=False,
                                                   padding_idx=PADDING_IDX, backend=backend)
    return reference, parallelize_module(fused, mesh, _style(style))


def _local_slice(full: torch.Tensor, dim: int, mesh) -> torch.Tensor:
    """This rank's part of ``full`` along ``dim`` under Shard(dim) (torch.chunk's split)."""
    return torch.chunk(full, mesh.size(), dim=dim)[mesh.get_local_rank()]


def check_style_matches_nn_embedding(mesh, style: str, backend: str) -> None:
    reference, fused = _modules(mesh, style, backend)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 6), generator=g)
    ids[0, :3] = PADDING_IDX
    dout = torch.randn(4, 6, DIM, generator=g, dtype=torch.float64)
    expected = reference(ids)
    expected.backward(dout)
    out = fused(ids)  # a local tensor: the styles hand back use_local_output=True
    out_dim = {"rowwise": None, "rowwise-sequence": 1, "colwise": 2}[style]
    if out_dim is not None:  # each rank holds a slice of the output, and of its gradient
        expected, dout = _local_slice(expected, out_dim, mesh), _local_slice(dout, out_dim, mesh)
    assert torch.equal(out, expected), f"{backend} {style}: output differs by {(out - expected).abs().max()}"
    out.backward(dout)
    grad = fused.weight.grad
    table_dim = 1 if style == "colwise" else 0
    assert grad.placements == fused.weight.placements, (style, grad.placements)
    expected_grad = _local_slice(reference.weight.grad, table_dim, mesh)
    err = (grad.to_local() - expected_grad).abs().max().item()
    assert err <= 1e-12, f"{backend} {style}: weight gradient differs by {err}"


def check_bad_id_raises_on_every_rank(mesh, backend: str) -> None:
    _, fused = _modules(mesh, "rowwise", backend)
    bad = torch.tensor([[1, VOCAB]])  # the same ids on every rank, as Replicate() inputs are
    try:
        fused(bad)
    except IndexError as exc:
        assert "out of range" in str(exc), exc
    else:
        raise AssertionError("an out-of-range id did not raise")
    dist.barrier()  # every rank got here: none is left waiting in a collective


def check_unsupported_layouts_raise(mesh) -> None:
    import pyembed
    from torch.distributed.tensor import DTensor, Partial

    weight = DTensor.from_local(torch.randn(VOCAB, DIM), mesh, [Partial()])
    for kwargs, match in (({}, "placement Partial"), ({"sparse": True}, "sparse gradients"),
                          ({"dropout_p": 0.1}, "dropout on a DTensor table")):
        try:
            pyembed.fused_embedding(torch.tensor([[1, 2]]), weight, **kwargs)
        except ValueError as exc:
            assert match in str(exc), exc
        else:
            raise AssertionError(f"{kwargs}: no error")
    dist.barrier()


def check_fsdp2_matches_single_process(mesh, backend: str) -> None:
    """fully_shard over an EmbeddingLayer (learned positions, scaled, padding): FSDP2
    gathers the tables before the forward, so the fused op sees whole tables; the loss
    and each rank's shard of the gradients equal the single-process layer's."""
    import pyembed
    from torch.distributed.fsdp import fully_shard

    def layer():
        torch.manual_seed(0)
        return pyembed.EmbeddingLayer(VOCAB, DIM, 8, "learned", scale_embeddings=True, padding_idx=PADDING_IDX,
                                      backend=backend, dtype=torch.float64)

    single, sharded = layer(), fully_shard(layer(), mesh=mesh)
    ids = torch.randint(0, VOCAB, (4, 8), generator=torch.Generator().manual_seed(3))
    losses = [m(ids).pow(2).sum() for m in (single, sharded)]
    for loss in losses:
        loss.backward()
    assert torch.equal(losses[0].detach(), losses[1].detach()), losses
    for name, param in sharded.named_parameters():
        full = dict(single.named_parameters())[name].grad
        err = (param.grad.full_tensor() - full).abs().max().item()
        assert err <= 1e-12, f"{backend} FSDP2 {name} gradient differs by {err}"


def check_checkpoint_round_trip(mesh, store_dir: str, backend: str) -> None:
    """torch.distributed.checkpoint of a row-sharded table: saved by every rank, loaded
    into a fresh sharded module (same shards back) and resharded into a whole table."""
    import torch.distributed.checkpoint as dcp

    reference, fused = _modules(mesh, "rowwise", backend)
    path = os.path.join(store_dir, "checkpoint")
    dcp.save(fused.state_dict(), checkpoint_id=path)
    _, fresh = _modules(mesh, "rowwise", backend)
    with torch.no_grad():
        fresh.weight.to_local().zero_()
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=path)
    assert torch.equal(fresh.weight.to_local(), fused.weight.to_local())
    whole = {"weight": torch.zeros(VOCAB, DIM, dtype=torch.float64)}
    dcp.load(whole, checkpoint_id=path)  # a plain tensor on every rank: DCP gathers the shards
    assert torch.equal(whole["weight"], reference.weight.detach())
