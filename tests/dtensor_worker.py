"""What each rank runs in tests/test_dtensor.py (a plain module, so the spawned processes
import it without pytest): FusedEmbedding under torch.distributed's own parallel styles,
EmbeddingLayer under pyembed's, FSDP2 over an EmbeddingLayer, and a distributed checkpoint
of a sharded table, against single-process modules built from the same seed on every rank;
and memory estimates under a fake process group, against nn.Embedding's."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

from helpers import process_group

VOCAB, DIM, PADDING_IDX = 50, 12, 37  # 50 rows over 3 ranks: 17, 17, 16; padding on the last shard
# The layer's d: 24 columns over 2 or 3 ranks start at multiples of 4 (dropout's groups).
LAYER_DIM, SEQ_LEN = 24, 8
STYLES = ("rowwise", "rowwise-sequence", "colwise")


def run(rank: int, world_size: int, store_dir: str, backends: list[str], pg_backend: str = "gloo") -> None:
    """Every check on this rank: CPU tensors over gloo (tests/test_dtensor.py), or, from
    run_nccl, CUDA tensors over NCCL (tests/gpu/test_parallel_gpu.py)."""
    with process_group(rank, world_size, store_dir, pg_backend):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(torch.get_default_device().type, (world_size,))
        for backend in backends:
            for style in STYLES:
                check_style_matches_nn_embedding(mesh, style, backend)
                for pos_encoding in ("learned", "sinusoidal"):
                    check_layer_style_matches_single_process(mesh, style, pos_encoding, backend)
            check_bad_id_raises_on_every_rank(mesh, backend)
            check_fsdp2_matches_single_process(mesh, backend)
        for style in STYLES:
            check_layer_dropout_is_the_single_process_mask(mesh, style, backends[-1])
            check_style_matches_nn_embedding(mesh, style, "cpu" if "cpu" in backends else backends[-1], compiled=True)
        check_checkpoint_round_trip(mesh, store_dir, backends[-1])
        check_unsupported_layouts_raise(mesh)


def _on_gpu(rank: int) -> str:
    """One GPU per rank: every tensor the checks make lands on it; NCCL between them."""
    torch.cuda.set_device(rank)
    torch.set_default_device(f"cuda:{rank}")
    return "nccl"


def run_nccl(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    run(rank, world_size, store_dir, backends, _on_gpu(rank))


def run_fsdp_with_tp_nccl(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    run_fsdp_with_tp(rank, world_size, store_dir, backends, _on_gpu(rank))


def _generator(seed: int) -> torch.Generator:
    return torch.Generator(torch.get_default_device()).manual_seed(seed)


def _style(name: str, *, ours: bool = False):
    """torch's style ``name``, or pyembed's (which also takes an EmbeddingLayer)."""
    from torch.distributed.tensor import Replicate, Shard

    if ours:
        from pyembed.parallel import ColwiseParallel, RowwiseParallel
    else:
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


def check_style_matches_nn_embedding(mesh, style: str, backend: str, compiled: bool = False) -> None:
    """compiled: the sharded module under torch.compile(fullgraph=True), as a model trained
    with tensor parallelism compiles it (nn.Embedding's styles compile so)."""
    reference, fused = _modules(mesh, style, backend)
    if compiled:
        torch._dynamo.reset()
        fused = torch.compile(fused, fullgraph=True)
    g = _generator(1)
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


_OUTPUT_DIM = {"rowwise": None, "rowwise-sequence": 1, "colwise": 2}  # the dim each rank holds a slice of


def _layers(mesh, style: str, pos_encoding: str, backend: str, dropout: float = 0.0):
    """(single-process EmbeddingLayer, the same layer under pyembed's ``style``), fp64,
    scaled, with a padding row."""
    import pyembed
    from torch.distributed.tensor.parallel import parallelize_module

    def layer():
        torch.manual_seed(0)
        return pyembed.EmbeddingLayer(VOCAB, LAYER_DIM, SEQ_LEN + 2, pos_encoding, scale_embeddings=True,
                                      padding_idx=PADDING_IDX, dropout=dropout, backend=backend,
                                      dtype=torch.float64)

    return layer(), parallelize_module(layer(), mesh, _style(style, ours=True))


def _compare(name: str, actual, expected, atol: float) -> None:
    err = (actual - expected).abs().max().item()
    assert err <= atol, f"{name} differs by {err}"


def check_layer_style_matches_single_process(mesh, style: str, pos_encoding: str, backend: str) -> None:
    """EmbeddingLayer under pyembed's styles: outputs and the gradients of both tables
    equal the single-process layer's (the positional term added once per token; a sinusoid
    at its global columns), with position_ids given by keyword and with an offset."""
    single, sharded = _layers(mesh, style, pos_encoding, backend)
    g = _generator(1)
    ids = torch.randint(0, VOCAB, (3, SEQ_LEN), generator=g)
    ids[0, :2] = PADDING_IDX
    position_ids = torch.randint(0, SEQ_LEN + 2, (3, SEQ_LEN), generator=g)
    dout = torch.randn(3, SEQ_LEN, LAYER_DIM, generator=g, dtype=torch.float64)
    out_dim = _OUTPUT_DIM[style]
    for call in ({"position_ids": position_ids}, {"offset": 2}):
        name = f"{backend} {style} {pos_encoding} {sorted(call)}"
        for m in (single, sharded):
            m.zero_grad()
        expected = single(ids, **call)
        expected.backward(dout)
        out = sharded(ids, **call)
        local_dout = dout
        if out_dim is not None:
            expected, local_dout = _local_slice(expected, out_dim, mesh), _local_slice(dout, out_dim, mesh)
        _compare(f"{name}: output", out, expected, 1e-12)
        out.backward(local_dout)
        for param_name, param in sharded.named_parameters():
            full_grad = dict(single.named_parameters())[param_name].grad
            placement = param.placements[0]
            assert param.grad.placements == param.placements, (name, param_name, param.grad.placements)
            expected_grad = _local_slice(full_grad, placement.dim, mesh) if placement.is_shard() else full_grad
            _compare(f"{name}: {param_name} gradient", param.grad.to_local(), expected_grad, 1e-12)


def check_layer_dropout_is_the_single_process_mask(mesh, style: str, backend: str) -> None:
    """Dropout under the styles drops the single-process layer's elements: the key is
    the first rank's (the others seed their generators differently here), so output and
    gradients match the single-process layer run from the first rank's seed."""
    single, sharded = _layers(mesh, style, "learned", backend, dropout=0.25)
    g = _generator(2)
    ids = torch.randint(0, VOCAB, (3, SEQ_LEN), generator=g)
    dout = torch.randn(3, SEQ_LEN, LAYER_DIM, generator=g, dtype=torch.float64)
    torch.manual_seed(7)
    expected = single(ids)
    expected.backward(dout)
    torch.manual_seed(7 + mesh.get_local_rank())
    out = sharded(ids)
    out_dim = _OUTPUT_DIM[style]
    if out_dim is not None:
        expected, dout = _local_slice(expected, out_dim, mesh), _local_slice(dout, out_dim, mesh)
    assert 0.6 < (expected != 0).double().mean() < 0.9  # the mask is there at all
    _compare(f"{backend} {style} dropout: output", out, expected, 1e-12)
    out.backward(dout)
    token = sharded.token_embedding.weight
    expected_grad = _local_slice(single.token_embedding.weight.grad, token.placements[0].dim, mesh)
    _compare(f"{backend} {style} dropout: token gradient", token.grad.to_local(), expected_grad, 1e-12)


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

    from torch.distributed.tensor import Shard, distribute_tensor

    partial = DTensor.from_local(torch.randn(VOCAB, DIM), mesh, [Partial()])
    rows = distribute_tensor(torch.randn(VOCAB, DIM), mesh, [Shard(0)])
    # Shards of 6 columns split a dropout group of 4; 10 columns over 2 ranks (5 + 5) split a
    # sinusoid's (sin, cos) pair. Every rank raises, the first (whose shard starts at 0) too.
    odd = distribute_tensor(torch.randn(VOCAB, 10), mesh, [Shard(1)])
    split = distribute_tensor(torch.randn(VOCAB, 6 * mesh.size()), mesh, [Shard(1)])  # 6-column shards
    cases = [(partial, {}, "placement Partial"), (rows, {"sparse": True}, "sparse gradients"),
             (split, {"dropout_p": 0.5}, "multiples of 4 columns")]
    if mesh.size() == 2:
        cases.append((odd, {"pos_encoding": "sinusoidal"}, "multiples of 2 columns"))
    for weight, kwargs, match in cases:
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
    ids = torch.randint(0, VOCAB, (4, 8), generator=_generator(3))
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


def run_fsdp_with_tp(rank: int, world_size: int, store_dir: str, backends: list[str], pg_backend: str = "gloo"
                     ) -> None:
    """4 ranks as a 2 x 2 (dp, tp) mesh: torchtitan's composition -- the TP plan on the tp
    dimension, then FSDP2 fully_shard on the dp one, each dp rank feeding its half of the
    batch. FSDP2 averages gradients over dp, so the reference loss is the whole batch's / 2."""
    import pyembed
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    with process_group(rank, world_size, store_dir, pg_backend):
        mesh = init_device_mesh(torch.get_default_device().type, (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        for backend in backends:
            for style in STYLES:
                def layer():
                    torch.manual_seed(0)
                    return pyembed.EmbeddingLayer(VOCAB, LAYER_DIM, SEQ_LEN, "learned", scale_embeddings=True,
                                                  padding_idx=PADDING_IDX, backend=backend, dtype=torch.float64)

                single = layer()
                sharded = fully_shard(parallelize_module(layer(), mesh["tp"], _style(style, ours=True)),
                                      mesh=mesh["dp"])
                ids = torch.randint(0, VOCAB, (4, SEQ_LEN), generator=_generator(3))
                expected = single(ids)
                (expected.pow(2).sum() / 2).backward()
                out = sharded(ids.chunk(2)[mesh.get_local_rank("dp")])
                out_dim = _OUTPUT_DIM[style]
                expected = expected.chunk(2)[mesh.get_local_rank("dp")]
                if out_dim is not None:
                    expected = _local_slice(expected, out_dim, mesh["tp"])
                _compare(f"{backend} FSDP2 + {style}: output", out, expected, 1e-12)
                out.pow(2).sum().backward()
                for name, param in sharded.named_parameters():
                    full_grad = dict(single.named_parameters())[name].grad
                    _compare(f"{backend} FSDP2 + {style}: {name} gradient", param.grad.full_tensor(), full_grad,
                             1e-12 * full_grad.abs().max().item())


def run_memory_estimates(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    """torchtitan's memory estimation, in one process: a fake process group of 4 ranks and
    every tensor fake (FakeTensorMode: nothing is allocated or computed). The peak memory
    torch's trackers count for a training step -- FSDPMemTracker over FSDP2's fully_shard,
    MemTracker under torchtitan's RowwiseParallel plan for the table -- is the same with a
    FusedEmbedding as with an nn.Embedding."""
    import pyembed
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    mesh = init_device_mesh("cpu", (4,))

    def peak(embedding, plan: str) -> dict:
        with FakeTensorMode():
            model = nn.Sequential(embedding(), nn.Linear(LAYER_DIM, VOCAB))
            if plan == "FSDP2":
                for module in (model[0], model[1], model):
                    fully_shard(module, mesh=mesh)
            else:
                parallelize_module(model, mesh, {"0": RowwiseParallel()})
            optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
            tracker = FSDPMemTracker(model, optimizer) if plan == "FSDP2" else MemTracker()
            if plan != "FSDP2":
                tracker.track_external(model, optimizer)
            with tracker:
                model(torch.randint(0, VOCAB, (4, 64))).logsumexp(-1).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            return {str(device): stats["Total"] for device, stats in tracker.get_tracker_snapshot("peak").items()}

    try:
        for plan in ("FSDP2", "RowwiseParallel"):
            expected = peak(lambda: nn.Embedding(VOCAB, LAYER_DIM), plan)
            for backend in backends:
                got = peak(lambda: pyembed.FusedEmbedding(VOCAB, LAYER_DIM, backend=backend), plan)
                assert got == expected and expected["cpu"] > 0, f"{backend} under {plan}: {got} against {expected}"
    finally:
        dist.destroy_process_group()
