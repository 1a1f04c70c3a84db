"""A small run of every kernel, for compute-sanitizer (memcheck, racecheck, initcheck):
forward in every positional mode with and without position_ids, fp32 / fp16 / bf16,
16-byte-aligned and misaligned views, unchecked out-of-range ids; backward dense and
sparse with a hot row (summed in pieces across 128-position chunks), learned positions by batch sum and by
position_ids, frequency scaling and padding; dropout (d a multiple of 4 or not) forward
and backward; optimizers inside the backward. Every backend that runs on the device.

Run by tests/gpu/gpu_check.py as ``compute-sanitizer --tool X python3 this.py`` with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 and PYEMBED_CUDA_SCRATCH=separate (each tensor, and each
array of the cuda backward's scratch, its own allocation, so an access past one is past an
allocation). ``--device cpu`` rehearses it without a GPU (cpu,
reference and, under TRITON_INTERPRET=1, triton). Prints one line per backend.
"""

import argparse
import math
import os

import torch

import pyembed
from pyembed import dispatch


def misaligned(shape, dtype, device, generator):
    flat = torch.randn(math.prod(shape) + 1, generator=generator).to(device=device, dtype=dtype)
    return flat[1:].view(*shape)  # starts one element past the allocation's alignment


def run_backend(backend: str, device: torch.device) -> int:
    g = torch.Generator().manual_seed(0)
    calls = 0
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for dim, aligned in ((64, True), (72, False), (10, True)):
            vocab, batch, seq_len = 40, 2, 200
            ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
            ids[:, :110] = 3  # a hot row: 220+ uses, summed in pieces by the chunks of 128 sorted tokens
            ids = ids.to(device)
            position_ids = torch.randint(0, seq_len, (batch, seq_len), generator=g).to(device)
            make = (lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)) if aligned else (
                lambda *s: misaligned(s, dtype, device, g))
            weight, pos_weight, dout = make(vocab, dim), make(seq_len + 4, dim), make(batch, seq_len, dim)
            for pos_encoding in ("none", "learned", "sinusoidal"):
                for pos_ids in (None, position_ids) if pos_encoding != "none" else (None,):
                    for sparse, dropout_p in ((False, 0.0), (True, 0.0), (False, 0.3)):
                        w = weight.detach().clone().requires_grad_()
                        p = pos_weight.detach().clone().requires_grad_() if pos_encoding == "learned" else None
                        out = pyembed.fused_embedding(
                            ids, w, p, pos_encoding=pos_encoding, position_ids=pos_ids, scale=1.5,
                            offset=2 if pos_ids is None and pos_encoding != "none" else 0, padding_idx=5,
                            scale_grad_by_freq=sparse, sparse=sparse, dropout_p=dropout_p, backend=backend)
                        out.backward(dout)
                        calls += 1
            bad = torch.tensor([[0, vocab, -1, 2**40]], device=device)
            pyembed.fused_embedding(bad, weight, validate=False, backend=backend)
            pyembed.fused_embedding(bad, weight, pos_encoding="sinusoidal", validate=False, backend=backend)
            calls += 2
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls + run_sorts(backend, device) + run_finish_groups(backend, device) + run_optimizers(backend, device)


def run_sorts(backend: str, device: torch.device) -> int:
    """The dense and sparse backward at the batch sizes of the sorts the small batches above
    never reach: the tile sorts across several tiles (their merge launch; `cuda`'s rank
    kernel counts from shared memory behind a block barrier, racecheck's subject), a hot row
    among them; CUB's and torch's sorts past them."""
    g = torch.Generator().manual_seed(1)
    calls = 0
    for n in (600, 5000, 16384, 16385):
        ids = torch.randint(0, 50257, (n,), generator=g)
        ids[::3] = 7  # a third of the tokens on one row: segments span sort tiles and blocks
        ids = ids.to(device)
        weight = torch.randn(50257, 16, generator=g).to(device)
        for sparse in (False, True):
            w = weight.detach().clone().requires_grad_()
            pyembed.fused_embedding(ids, w, sparse=sparse, backend=backend).sum().backward()
            calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def run_finish_groups(backend: str, device: torch.device) -> int:
    """`cuda`'s finish_segments_solo_kernel at each of its group sizes
    (PYEMBED_CUDA_FINISH_GROUP): learned positions from 0 over every token, so that their
    blocks write the one-token rows; a hot row summed in pieces, a row count that is no
    multiple of 16; fp32 and bf16."""
    if backend != "cuda":
        return 0
    g = torch.Generator().manual_seed(2)
    calls = 0
    for rows in ("4", "8", "16", "8-last"):
        os.environ["PYEMBED_CUDA_FINISH_GROUP"] = rows
        for dtype in (torch.float32, torch.bfloat16):
            ids = torch.randint(0, 5003, (4, 300), generator=g)
            ids[:, ::2] = 7  # 600 uses: pieces of several chunks
            weight = torch.randn(5003, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()
            pos_weight = torch.randn(300, 64, generator=g).to(device=device, dtype=dtype).requires_grad_()
            pyembed.fused_embedding(ids.to(device), weight, pos_weight, pos_encoding="learned",
                                    backend=backend).sum().backward()
            calls += 1
    os.environ.pop("PYEMBED_CUDA_FINISH_GROUP", None)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def run_optimizers(backend: str, device: torch.device) -> int:
    """The optimizer inside the backward (apply_optimizer_in_backward), whose update reads
    and writes the table in place: each GPU backend's optimizer_backward (each row's
    segment summed in the update's own kernel) and position_update (the learned positions'
    batch sums, likewise) and every backend's update kernels, with a
    hot row summed in pieces, the padding row and dropout; fp32 and bf16, 16-byte rows and not."""
    g = torch.Generator().manual_seed(2)
    calls = 0
    for dtype in (torch.float32, torch.bfloat16):
        for dim in (64, 10):
            for cls, kwargs in ((torch.optim.AdamW, {"lr": 1e-3}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
                                (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.01})):
                ids = torch.randint(0, 40, (2, 200), generator=g)
                ids[:, :110] = 3  # 220 uses: longer than a chunk
                ids = ids.to(device)
                weight = torch.nn.Parameter(torch.randn(40, dim, generator=g).to(device=device, dtype=dtype))
                pos_weight = torch.nn.Parameter(torch.randn(204, dim, generator=g).to(device=device, dtype=dtype))
                pyembed.apply_optimizer_in_backward(cls, [weight, pos_weight], kwargs)
                dout = torch.randn(2, 200, dim, generator=g).to(device=device, dtype=dtype)
                for dropout_p in (0.0, 0.3):
                    pyembed.fused_embedding(ids, weight, pos_weight, scale=1.5, padding_idx=5, dropout_p=dropout_p,
                                            backend=backend).backward(dout)
                    calls += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    return calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--sorts-only", action="store_true", help="only the sort-sized backward (run_sorts)")
    ap.add_argument("--backend", help="this backend alone (default: every one on the device)")
    args = ap.parse_args()
    device = torch.device(args.device)
    for backend in [args.backend] if args.backend else dispatch.backends_for(device):
        if backend == "reference" and device.type == "cuda":
            continue  # plain torch: its kernels are PyTorch's, not ours
        calls = run_sorts(backend, device) if args.sorts_only else run_backend(backend, device)
        print(f"{backend}: {calls} calls on {device}", flush=True)


if __name__ == "__main__":
    main()
