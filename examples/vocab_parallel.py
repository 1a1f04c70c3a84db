"""Shard a token table over several processes with VocabParallelEmbeddingLayer.

Every rank builds the same single-device layer (one seed here; a checkpoint in real
use), keeps its own rows with ``from_full``, and runs forward and backward together
with the others; the output equals the single-device layer's, each rank's gradient is
its slice of the full one. At the end rank 0 gathers the full state_dict.

    torchrun --nproc-per-node 2 examples/vocab_parallel.py              # CPU: gloo
    torchrun --nproc-per-node 8 examples/vocab_parallel.py --vocab 128256 --dim 4096   # GPUs: nccl
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist

import pyembed
from pyembed.parallel import VocabParallelEmbeddingLayer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--seq-len", type=int, default=512)
    args = parser.parse_args()

    if torch.cuda.device_count() >= int(os.environ["WORLD_SIZE"]):  # one GPU per rank, else gloo on CPU
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)  # the same full layer on every rank
    full = pyembed.EmbeddingLayer(args.vocab, args.dim, args.seq_len, "learned", scale_embeddings=True,
                                  device=device)
    layer = VocabParallelEmbeddingLayer.from_full(full)  # the one-line change
    shard_mib = layer.token_embedding.weight.nbytes / 2**20
    print(f"rank {rank}/{world}: rows {layer.vocab_start}..{layer.vocab_end} "
          f"({shard_mib:.1f} MiB of {full.token_embedding.weight.nbytes / 2**20:.1f} MiB)", flush=True)

    generator = torch.Generator().manual_seed(1)  # the same batch on every rank
    ids = torch.randint(0, args.vocab, (4, args.seq_len), generator=generator).to(device)
    out = layer(ids)
    out.square().mean().backward()
    full(ids).square().mean().backward()
    mine = full.token_embedding.weight.grad[layer.vocab_start:layer.vocab_end]
    same_out = torch.equal(out, full(ids))  # bitwise: each token is computed by one rank
    same_grad = torch.equal(layer.token_embedding.weight.grad, mine)
    print(f"rank {rank}: output equals the single-device layer's: {same_out}; "
          f"weight gradient equals its slice of the full one: {same_grad}", flush=True)

    state = layer.full_state_dict()  # every rank calls it; rank 0 receives it
    if rank == 0:
        print(f"rank 0 gathered the full state_dict: "
              f"{ {k: tuple(v.shape) for k, v in state.items()} }", flush=True)
    dist.destroy_process_group()
    if not (same_out and same_grad):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
