"""Entry point of ``make bench``: for now, times the forward and forward+backward of every
available CPU backend against eager PyTorch on the GPT-2 shape (the full suite is its own
issue)."""

import math
import statistics
import time

import torch
import torch.nn.functional as F

import pyembed
from pyembed import dispatch


def _time_ms(fn, warmup=3, reps=10):
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def main():
    vocab, dim, batch, seq_len = 50257, 768, 8, 512
    weight = torch.randn(vocab, dim, requires_grad=True)
    pos_weight = torch.randn(1024, dim, requires_grad=True)
    ids = torch.randint(0, vocab, (batch, seq_len))
    scale = math.sqrt(dim)

    def eager():
        return F.embedding(ids, weight) * scale + F.embedding(torch.arange(seq_len), pos_weight)

    providers = {"eager": eager}
    for name in dispatch.backends_for("cpu"):
        providers[name] = lambda name=name: pyembed.fused_embedding(ids, weight, pos_weight, scale=scale, backend=name)
    print(f"GPT-2 shape V={vocab} d={dim} B={batch} T={seq_len}, fp32, learned PE, CPU, {torch.get_num_threads()} threads")
    print(f"{'provider':<12}{'fwd ms':>10}{'fwd+bwd ms':>14}")
    for name, fn in providers.items():
        with torch.no_grad():
            fwd = _time_ms(fn)
        both = _time_ms(lambda: fn().sum().backward())
        print(f"{name:<12}{fwd:>10.2f}{both:>14.2f}")


if __name__ == "__main__":
    main()
