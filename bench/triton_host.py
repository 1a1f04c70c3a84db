"""``python -m bench.triton_host``: the host time of `triton` calls, measurable without a GPU.

On a GPU a one-token `triton` lookup is host-bound: what it costs is the Python around
its launches and Triton's own launch path. Here Triton's real JIT compiles every kernel
for sm_90, and a stand-in driver (bench/stand_in_driver.py) takes the launches as no-ops
-- Triton's own launcher object, its C call stubbed --, so everything but that C call
(its argument parsing and cuLaunchKernelEx) is timed: a raw Triton launch of a
one-store kernel, the same through pyembed's cached launcher (kernels/launch.py),
F.embedding on the CPU for scale, and pyembed's one-token forward (no gradient -- also as
the first call of its metadata, which launches without the plan later calls replay,
pyembed/_triton.py; with a gradient; with position_ids), forward + backward (also with dropout) -- the
default checks as on a GPU (inside the kernel) --, the dense backward op of a batch of
8x2048 tokens (four launches, the tile sort's two first), as the autograd path calls it
(replayed whole from its plan: allocations and launches) and through the cached launcher, and last, after the
others (fused_step_call says why), training steps (one token, 8x2048) with AdamW inside the backward
(``apply_optimizer_in_backward``). The calls take turns, round after round; each figure
is its best round.
Issue #29's target compares a one-token forward with a raw Triton launch (<= 2x); on a GPU
both also pay the launcher's C call, the same constant, which this leaves out. (Figures
before 2026-11-27's session 45 left out the launcher's Python too, ~2.5 us a launch,
which a raw launch pays and pyembed's launches since do not.)
"""

from __future__ import annotations

import argparse
import os
import timeit

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("bench.triton_host times Triton's compiled path: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from . import stand_in_driver  # noqa: E402

stand_in_driver.install().record = False

import pyembed  # noqa: E402  (after the driver: nothing compiles before it is in place)
from pyembed import _triton, checks  # noqa: E402
from pyembed.kernels.launch import cached  # noqa: E402


@triton.jit
def _touch(x_ptr):  # one pointer, one store: the least a Triton launch can do
    tl.store(x_ptr, 1.0)


def calls(vocab: int, dim: int) -> dict:
    ids = torch.tensor([[3]])
    weight = torch.randn(vocab, dim, requires_grad=True)
    pos_weight = torch.randn(1024, dim, requires_grad=True)
    frozen, frozen_pos = weight.detach(), pos_weight.detach()
    scratch = torch.empty(1)
    position_ids = torch.tensor([[7]])

    def forward_backward():
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton")
        out.backward(torch.ones_like(out))
        weight.grad = pos_weight.grad = None

    def forward_backward_dropout():  # GPT-2's embedding dropout: the backward regenerates the mask
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, dropout_p=0.1, backend="triton")
        out.backward(torch.ones_like(out))
        weight.grad = pos_weight.grad = None

    def first_call():  # the no-grad forward as the first call of its metadata: no launch plan to replay
        _triton.clear_plans(backward=False)
        return pyembed.fused_embedding(ids, frozen, frozen_pos, scale=2.0, backend="triton")

    batch_ids = torch.randint(0, vocab, (8, 2048))
    batch_dout = torch.ones(8, 2048, dim)

    def batch_backward(body):
        args = (batch_dout, batch_ids, None, 0, vocab, 2048, 2.0, None, False, True, True)
        return lambda: body(*args)

    return {
        "raw Triton launch": lambda: _touch[(1,)](scratch),
        "raw launch, cached": lambda: cached(_touch)[(1,)](scratch),
        "F.embedding (CPU)": lambda: torch.nn.functional.embedding(ids, frozen),
        "triton 1x1 fwd, no grad": lambda: pyembed.fused_embedding(ids, frozen, frozen_pos, scale=2.0,
                                                                    backend="triton"),
        "triton 1x1 fwd, no grad, first call": first_call,
        "triton 1x1 fwd": lambda: pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton"),
        # as a Hugging Face model's fused wte / wpe is called at each decoding step
        "triton 1x1 fwd, position_ids": lambda: pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0,
                                                                         position_ids=position_ids, backend="triton"),
        "triton 1x1 fwd+bwd": forward_backward,
        "triton 1x1 fwd+bwd, dropout": forward_backward_dropout,
        "triton 8x2048 dense backward": batch_backward(_triton.backward),
        "8x2048 backward, cached launches": batch_backward(_triton._backward),
    }


def fused_step_call(vocab: int, dim: int, batch: int = 1, seq_len: int = 1):
    """A training step with AdamW inside the backward, of one token or a batch (whose
    token table is updated by the optimizer_backward op: sort, chunks, one kernel). Made
    after the other calls are timed, so that they run as in a process without such a
    table: from the first one on, every lookup checks its tables for an optimizer
    (pyembed.optim.tables_are_fused; timed before this call was moved last: no difference
    within the noise, 16.7 us a one-token forward with a gradient)."""
    ids = torch.randint(0, vocab, (batch, seq_len))
    fused_step = pyembed.EmbeddingLayer(vocab, dim, max_seq_len=max(seq_len, 1024), backend="triton")
    pyembed.apply_optimizer_in_backward(torch.optim.AdamW, fused_step.parameters())
    dout = torch.ones(batch, seq_len, dim)

    def step_in_backward():  # forward, backward, AdamW on both tables inside the backward
        fused_step(ids).backward(dout)
    return step_in_backward


def best_times(timed: dict, rounds: int, number: int) -> dict:
    """{name: us per call, the best of `rounds` rounds in which the calls take turns}."""
    for fn in timed.values():
        fn()  # compiles
    best = dict.fromkeys(timed, float("inf"))
    for _ in range(rounds):
        for name, fn in timed.items():
            best[name] = min(best[name], timeit.timeit(fn, number=number) / number * 1e6)
    return best


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.triton_host", description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--number", type=int, default=2000, help="calls per timing")
    ap.add_argument("--vocab", type=int, default=1000, help="table rows (the backward writes all of them)")
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args(argv)
    _triton._INTERPRETED = True  # lets the backend take CPU tensors; its kernels still go through the JIT
    checks.KERNEL_CHECKED_DEVICES = (*checks.KERNEL_CHECKED_DEVICES, "cpu")  # the default check, as on a GPU
    torch.set_num_threads(1)
    best = best_times(calls(args.vocab, args.dim), args.rounds, args.number)
    best.update(best_times({"triton 1x1 fused AdamW step": fused_step_call(args.vocab, args.dim),
                            "triton 8x2048 fused AdamW step": fused_step_call(args.vocab, args.dim, 8, 2048)},
                           args.rounds, args.number))
    raw = best["raw Triton launch"]
    print(f"host time per call, Triton {triton.__version__}, stand-in sm_90 driver (launches not run), "
          f"best of {args.rounds} rounds x {args.number} calls")
    for name, us in best.items():
        print(f"{name:36s} {us:8.2f} us   {us / raw:5.2f}x a raw Triton launch")


if __name__ == "__main__":
    main()
