"""Train a tiny LM whose input layer is a pyembed EmbeddingLayer, tensor-parallel with
torchtitan's plan: the embedding vocab-sharded with a sequence-sharded output, the norm
sequence-parallel, the LM head column-parallel (torch's styles; pyembed's RowwiseParallel
for the EmbeddingLayer). Every rank also trains the same model on one device and checks
that the losses agree at each step, dropout included (one dropout key for the mesh).

    torchrun --nproc-per-node 2 examples/tensor_parallel.py          # CPU: gloo
    torchrun --nproc-per-node 4 examples/tensor_parallel.py          # GPUs: nccl
"""

from __future__ import annotations

import argparse
import copy
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel, parallelize_module

import pyembed
from pyembed.parallel import RowwiseParallel  # torch's, which also takes an EmbeddingLayer


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, seq_len: int, device, dtype) -> None:
        super().__init__()
        self.embed = pyembed.EmbeddingLayer(vocab, dim, seq_len, "learned", scale_embeddings=True, dropout=0.1,
                                            device=device, dtype=dtype)
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.head = nn.Linear(dim, vocab, bias=False, device=device, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(ids)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]):  # one GPU per rank, else gloo on CPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    # Named, not left to init_device_mesh: with CUDA present but unused, its default group
    # may have no CPU backend ("No backend type associated with device type cpu", torch 2.11).
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    mesh = init_device_mesh(device.type, (int(os.environ["WORLD_SIZE"]),))
    rank = dist.get_rank()

    torch.manual_seed(0)  # the same model on every rank
    single = TinyLM(args.vocab, args.dim, args.seq_len, device, torch.float64)
    model = parallelize_module(copy.deepcopy(single), mesh, {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (single, model)]
    loss_fn = nn.CrossEntropyLoss()
    generator = torch.Generator().manual_seed(1)  # the same batches on every rank
    agree = True
    for step in range(args.steps):
        ids = torch.randint(0, args.vocab, (4, args.seq_len + 1), generator=generator).to(device)
        losses = []
        for m, optimizer in zip((single, model), optimizers):
            torch.manual_seed(100 + step)  # the dropout key: the first rank's is the mesh's
            logits = m(ids[:, :-1])
            loss = loss_fn(logits.reshape(-1, args.vocab), ids[:, 1:].reshape(-1))
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        same = abs(losses[0] - losses[1]) <= 1e-9 * abs(losses[0])
        agree &= same
        print(f"rank {rank} step {step}: loss one device {losses[0]:.12f}, tensor parallel {losses[1]:.12f}, "
              f"agree: {same}", flush=True)
    del model, optimizers, mesh  # the group's last users go before the group does
    gc.collect()
    dist.destroy_process_group()
    if not agree:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
