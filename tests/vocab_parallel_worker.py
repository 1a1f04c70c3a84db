"""What each rank runs in tests/test_parallel.py (a plain module, so the spawned
processes import it without pytest). Every check compares the vocab-parallel layer with
the single-process EmbeddingLayer built from the same seed on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from helpers import process_group

# (vocab, dim, layer kwargs): learned + scaled + a padding row on the last shard; sinusoidal
# with sparse gradients and padding on the first shard; no positional encoding.
CONFIGS = [
    (50, 16, dict(pos_encoding="learned", scale_embeddings=True, padding_idx=-2)),
    (50, 16, dict(pos_encoding="sinusoidal", padding_idx=0, sparse=True)),
    (29, 12, dict(pos_encoding=None)),
]
MAX_SEQ_LEN = 16


def run(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    """Entry point of one rank: join the group over loopback, run every check, leave."""
    with process_group(rank, world_size, store_dir):
        for backend in backends:
            for vocab, dim, kwargs in CONFIGS:
                check_matches_single_process(vocab, dim, kwargs, backend)
            check_bad_ids_raise_on_every_rank(backend)
        compiled_backend = "cpu" if "cpu" in backends else backends[-1]
        for vocab, dim, kwargs in CONFIGS[:2]:  # dense and sparse
            check_matches_single_process(vocab, dim, kwargs, compiled_backend, compiled=True)
        check_bad_ids_raise_on_every_rank(compiled_backend, compiled=True)
        check_checkpoints(store_dir)


def _layers(vocab, dim, kwargs, backend, seed=0):
    import pyembed
    from pyembed.parallel import VocabParallelEmbeddingLayer

    torch.manual_seed(seed)  # the same single-process layer on every rank
    full = pyembed.EmbeddingLayer(vocab, dim, MAX_SEQ_LEN, backend=backend, **kwargs)
    return full, VocabParallelEmbeddingLayer.from_full(full)


def _ids(vocab, shape, seed=1):
    """The same ids on every rank, every row of the vocabulary hit (so every shard works)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, shape, generator=generator)
    ids.view(-1)[:vocab] = torch.randperm(vocab, generator=generator)[: ids.numel()]
    return ids


def _compiled(layer):
    """The layer under torch.compile(fullgraph=True): its collective range check and the
    sum over ranks in the graph (no graph break)."""
    torch._dynamo.reset()
    return torch.compile(layer, fullgraph=True)


def check_matches_single_process(vocab, dim, kwargs, backend, compiled=False):
    from pyembed.parallel import shard_range

    full, par = _layers(vocab, dim, kwargs, backend)
    run_par = _compiled(par) if compiled else par
    rank, world = dist.get_rank(), dist.get_world_size()
    assert (par.vocab_start, par.vocab_end) == shard_range(vocab, rank, world)
    assert par.token_embedding.weight.shape == (par.vocab_end - par.vocab_start, dim)
    torch.testing.assert_close(par.token_embedding.weight, full.token_embedding.weight[par.vocab_start:par.vocab_end],
                               rtol=0, atol=0)

    ids = _ids(vocab, (3, 11)).to(torch.int32)
    if kwargs.get("padding_idx") is not None:
        ids[1, :4] = kwargs["padding_idx"] % vocab  # the padding row is used, and gets no gradient
    position_ids = torch.randint(0, MAX_SEQ_LEN, ids.shape, generator=torch.Generator().manual_seed(2))
    dout = torch.randn(*ids.shape, dim, generator=torch.Generator().manual_seed(3))
    calls = [dict(), dict(offset=4)]
    if kwargs["pos_encoding"] is not None:
        calls.append(dict(position_ids=position_ids))
        calls.append(dict(position_ids=position_ids[0]))  # (T,): broadcast over the batch, as HF passes (1, T)
    for call in calls:
        for layer in (full, par):
            layer.zero_grad(set_to_none=True)
        expected = full(ids, **call)
        out = run_par(ids, **call)
        # The rank holding an id adds its row and position, the others exact zeros: bitwise the same.
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        expected.backward(dout)
        out.backward(dout)

        grad, full_grad = par.token_embedding.weight.grad, full.token_embedding.weight.grad
        assert grad.is_sparse == full_grad.is_sparse
        if grad.is_sparse:
            # Sorted unique local rows (AccumulateGrad drops the coalesced flag: pytorch#105916).
            rows = grad._indices()[0]
            assert torch.equal(rows, rows.unique())
            grad, full_grad = grad.to_dense(), full_grad.to_dense()
        # The same tokens, summed in the same order: the rank's slice of the full gradient.
        torch.testing.assert_close(grad, full_grad[par.vocab_start:par.vocab_end], rtol=0, atol=0)
        if kwargs.get("padding_idx") is not None:
            pad = kwargs["padding_idx"] % vocab
            if par.vocab_start <= pad < par.vocab_end:
                assert par.token_embedding.padding_idx == pad - par.vocab_start
                assert not grad[pad - par.vocab_start].any()
            else:
                assert par.token_embedding.padding_idx is None
        if par.pos_embedding is not None:
            # Every rank holds the whole output gradient, so every rank has the same dP.
            torch.testing.assert_close(par.pos_embedding.grad, full.pos_embedding.grad, rtol=0, atol=0)


def check_bad_ids_raise_on_every_rank(backend, compiled=False):
    full, par = _layers(50, 16, CONFIGS[0][2], backend)
    par = _compiled(par) if compiled else par
    ids = torch.arange(20, 30).reshape(2, 5)  # the bad id below leaves the other extreme in place
    for bad in (50, -1):
        with_bad = ids.clone()
        # Only the last rank sees the bad id: every rank must still raise (no hang).
        if dist.get_rank() == dist.get_world_size() - 1:
            with_bad[1, 3] = bad
        try:
            par(with_bad)
        except IndexError as e:
            message = str(e)
        else:
            raise AssertionError(f"no IndexError for id {bad} on rank {dist.get_rank()}")
        try:  # the single-process layer's message, for the ids the last rank saw
            bad_everywhere = ids.clone()
            bad_everywhere[1, 3] = bad
            full(bad_everywhere)
        except IndexError as e:
            assert message == str(e), (message, str(e))
    # The group is still in step: the next collective call works.
    torch.testing.assert_close(par(ids), full(ids), rtol=0, atol=0)


def check_checkpoints(store_dir):
    import pyembed

    full, par = _layers(50, 16, CONFIGS[0][2], "auto")
    rank = dist.get_rank()

    # Sharded: each rank saves its own state_dict and a fresh layer loads it back.
    torch.save(par.state_dict(), f"{store_dir}/shard{rank}.pt")
    _, fresh = _layers(50, 16, CONFIGS[0][2], "auto", seed=7)
    fresh.load_state_dict(torch.load(f"{store_dir}/shard{rank}.pt"))
    for (name, p), q in zip(par.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
    dist.barrier()  # every shard is on disk
    other = (rank + 1) % dist.get_world_size()
    try:
        fresh.load_state_dict(torch.load(f"{store_dir}/shard{other}.pt"))
    except (ValueError, RuntimeError) as e:  # RuntimeError: shards of different sizes
        assert f"rows {fresh.vocab_start}..{fresh.vocab_end}" in str(e) or "size mismatch" in str(e), str(e)
    else:
        raise AssertionError("a shard of other rows loaded without an error")

    # Gathered: the single-process state_dict on rank 0, loadable by EmbeddingLayer.
    state = par.full_state_dict()
    if rank == 0:
        assert state.keys() == {"token_embedding.weight", "pos_embedding"}
        for key, value in full.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)
        single = pyembed.EmbeddingLayer(50, 16, MAX_SEQ_LEN, **CONFIGS[0][2])
        single.load_state_dict(state)
    else:
        assert state == {}
