"""Where a GPU call's time goes, for ``make gpu-check`` (step "profile"): per backend and
``validate`` setting, the median of forward and forward + backward (do_bench), the number
of kernels one call launches, and torch.profiler's tables by GPU and by CPU time, at
GPT-2 8x2048 and 1x1 tokens (fp32, learned positions). ``--ncu`` instead runs one forward
per backend on a Llama-2 8x2048 table (fp32 and bf16), for Nsight Compute to read the
forward kernels' DRAM throughput and occupancy.

The first GPU run (H100, torch 2.11) measured pyembed below eager and torch.compile in
most cases, by margins that host-side work (launches, the range check's sync) explains
better than the kernels: this is the breakdown that tells which.
"""

import argparse

import torch
import triton.testing

import pyembed
from pyembed import dispatch

GPT2 = (50257, 768)


def tensors(vocab, dim, batch, seq_len, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(vocab, dim, device="cuda", generator=g).to(dtype).requires_grad_()
    pos_weight = (0.02 * torch.randn(max(seq_len, 1024), dim, device="cuda", generator=g)).to(dtype).requires_grad_()
    ids = torch.randint(0, vocab, (batch, seq_len), device="cuda", generator=g)
    dout = torch.randn(batch, seq_len, dim, device="cuda", generator=g).to(dtype)
    return weight, pos_weight, ids, dout


def profile(backends, shapes):
    for batch, seq_len in shapes:
        weight, pos_weight, ids, dout = tensors(*GPT2, batch, seq_len, torch.float32)
        scale = GPT2[1] ** 0.5

        def eager():
            return torch.nn.functional.embedding(ids, weight) * scale + pos_weight[:seq_len]

        calls = {"eager": eager}
        for backend in backends:
            for validate in (True, False):
                calls[f"pyembed-{backend} validate={validate}"] = (
                    lambda b=backend, v=validate: pyembed.fused_embedding(ids, weight, pos_weight, scale=scale,
                                                                          validate=v, backend=b))
        for name, fwd in calls.items():
            def fwd_bwd(fwd=fwd):
                weight.grad = pos_weight.grad = None
                fwd().backward(dout)

            ms = [triton.testing.do_bench(f, quantiles=[0.5]) for f in (fwd, fwd_bwd)]  # medians
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                fwd_bwd()
                torch.cuda.synchronize()
            kernels = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
            print(f"{batch}x{seq_len} {name}: fwd {ms[0] * 1e3:.1f} us, fwd+bwd {ms[1] * 1e3:.1f} us, "
                  f"{kernels} GPU ops per fwd+bwd", flush=True)
        for name, fwd in calls.items():
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    weight.grad = pos_weight.grad = None
                    fwd().backward(dout)
                torch.cuda.synchronize()
            for key in ("cuda_time_total", "cpu_time_total"):
                print(f"\n== {batch}x{seq_len} {name}, fwd+bwd x5, by {key}")
                print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=50))


def ncu_forwards(backends):
    for dtype in (torch.float32, torch.bfloat16):
        weight, pos_weight, ids, _ = tensors(32000, 4096, 8, 2048, dtype)
        for backend in backends:
            with torch.no_grad():
                pyembed.fused_embedding(ids, weight, pos_weight, scale=64.0, validate=False, backend=backend)
    torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true", help="one forward per backend and dtype, for ncu")
    args = ap.parse_args()
    backends = [b for b in dispatch.backends_for("cuda") if b != "reference"]
    if args.ncu:
        ncu_forwards(backends)
    else:
        profile(backends, [(8, 2048), (1, 1)])


if __name__ == "__main__":
    main()
