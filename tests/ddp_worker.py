"""What each rank runs in tests/test_parallel.py's DistributedDataParallel test (a plain
module, so the spawned processes import it without pytest): FusedEmbedding and
nn.Embedding built from the same table, each wrapped in DDP, trained side by side on
each rank's own batches -- dense gradients with Adam, sparse ones with SparseAdam -- end
on the same table. DDP all-reduces the gradient after the backward (a sparse one by
gathering every rank's rows), so this checks that pyembed's gradients go through it as
nn.Embedding's do."""

from __future__ import annotations

import torch

from helpers import process_group

STEPS = 3


def run(rank: int, world_size: int, store_dir: str, backends: list[str]) -> None:
    with process_group(rank, world_size, store_dir):
        for backend in backends:
            for sparse in (False, True):
                check_matches_nn_embedding(rank, backend, sparse)


def check_matches_nn_embedding(rank: int, backend: str, sparse: bool) -> None:
    import pyembed

    table = torch.randn(40, 8, generator=torch.Generator().manual_seed(0))
    ours = pyembed.FusedEmbedding.from_pretrained(table.clone(), freeze=False, sparse=sparse, padding_idx=2,
                                                 backend=backend)
    theirs = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False, sparse=sparse, padding_idx=2)
    optimizer = torch.optim.SparseAdam if sparse else torch.optim.Adam
    generator = torch.Generator().manual_seed(100 + rank)  # each rank its own batches
    batches = [(torch.randint(0, 40, (3, 10), generator=generator), torch.randn(3, 10, 8, generator=generator))
               for _ in range(STEPS)]
    for module in (ours, theirs):
        model = torch.nn.parallel.DistributedDataParallel(module)
        opt = optimizer(model.parameters(), lr=0.1)
        for ids, dout in batches:
            # A fresh output gradient each step: nn.Embedding's sparse gradient shares its
            # memory, and DDP averages the gradient in place.
            model(ids).backward(dout.clone())
            grad = module.weight.grad
            if sparse:
                rows = grad._indices()[0]
                assert grad.is_sparse and (not grad.is_coalesced() or bool(torch.all(rows[1:] > rows[:-1]))), \
                    f"{backend}: a gradient flagged coalesced must have sorted unique rows"
            opt.step()
            opt.zero_grad()
    torch.testing.assert_close(ours.weight.detach(), theirs.weight.detach(), rtol=1e-5, atol=1e-6,
                               msg=lambda m: f"{backend} sparse={sparse}: {m}")
    assert not torch.equal(ours.weight.detach(), table), "the steps must move the table"
