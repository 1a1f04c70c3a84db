"""``python -m bench.compiled_host``: where the host time of a compiled input layer goes.

The same layer (token lookup * scale + learned positions) under ``torch.compile``, written
with nn ops and with pyembed, one call at a time. The H100 run at d81f5b2 measured
compiled pyembed ~120 us of host time above compiled nn ops per GPT-2 8x2048 forward +
backward (autograd's device thread off), though pyembed's GPU work is the same and its
graphs hold fewer kernels; this splits a call into what each layer of torch.compile's
runtime costs, so the difference can be placed:

- ``fwd``: a whole compiled forward (grad mode on, tables that want gradients);
- ``guards``: Dynamo's guard evaluation of that frame: the forward's time less its time
  with guard evaluation skipped (``torch.compiler.set_stance(skip_guard_eval_unsafe=True)``);
- ``check``: the same evaluation timed by itself -- the frame's guard manager checked
  against the call's arguments in a loop -- and ``count``, how many guards it holds: a
  difference of two noisy times, ``guards`` came out negative at 8x2048 on the H200 at
  1b594a4 (-52 us for nn ops); on the development VM a one-token call's guards check in
  ~1.6-1.8 us for nn ops (18 guards) and ~4.5-5.3 us for pyembed (93);
- ``graph``: the compiled function Dynamo's frame calls (AOTAutograd's runtime wrapper,
  its autograd.Function and the forward graph: pyembed's op or Inductor's kernels);
- ``frame``: the rest of the forward (Dynamo's frame around the two above);
- ``bwd``: ``.backward()`` of an output (the engine, AOTAutograd's backward, the graph,
  accumulating the gradients), timed over outputs made beforehand.

On a GPU the device is held by a sleep kernel while the calls run, so host time alone is
timed (a call that waits for the device would show the sleep); on the CPU the `cpu`
backend's kernels run in the timing, and the gap to nn ops includes the C++ kernels'
differences (Inductor's fused C++ kernel against pyembed's op). Each figure is the best
of a few rounds in which the parts take turns.
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch

import pyembed
from pyembed import dispatch

from .cases import DTYPES


def nn_layer(ids, weight, pos_weight, scale):
    return torch.nn.functional.embedding(ids, weight) * scale + pos_weight[:ids.shape[-1]]


def pyembed_layer(backend: str):
    def layer(ids, weight, pos_weight, scale):
        return pyembed.fused_embedding(ids, weight, pos_weight, scale=scale, backend=backend)
    return layer


class HostTimer:
    """Per-call host time of ``calls`` calls; on CUDA with the device held by a sleep kernel
    queued first (~0.2 s, longer than the calls take), so no call waits for GPU work."""

    def __init__(self, device: torch.device, calls: int):
        self.cuda = device.type == "cuda"
        self.calls = calls

    def __call__(self, fn, prepare=None) -> float:
        items = prepare() if prepare is not None else [None] * self.calls
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda._sleep(400_000_000)  # cycles: ~0.2 s at an H100's 1.98 GHz
        start = time.perf_counter()
        for item in items:
            fn(item)
        us = (time.perf_counter() - start) / len(items) * 1e6
        if self.cuda:
            torch.cuda.synchronize()
        return us


def _compiled_entry(layer):
    """Dynamo's cache entry for ``layer``'s code: its one compiled frame."""
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(layer.__code__)
    if len(entries) != 1:
        raise RuntimeError(f"expected one compiled frame of {layer.__name__}, found {len(entries)}")
    return entries[0]


def _graph_call(layer, compiled, args):
    """(the compiled function Dynamo's frame for ``layer`` calls, the arguments it passes),
    found by wrapping that function once (after a call that compiles it, if none has)."""
    compiled(*args)
    entry = _compiled_entry(layer)
    name = next(n for n in entry.code.co_names if n.startswith("__compiled_fn"))
    namespace = layer.__globals__
    graph, seen = namespace[name], []
    namespace[name] = lambda *a: seen.append(a) or graph(*a)
    try:
        compiled(*args)
    finally:
        namespace[name] = graph
    return graph, seen[0]


def _guard_check(layer, args):
    """(a call of the guard check of ``layer``'s compiled frame on ``args``, the number of
    guards it evaluates), found in Dynamo's cache entry for the layer's code."""
    manager = _compiled_entry(layer).guard_manager
    code = layer.__code__
    f_locals = dict(zip(code.co_varnames[:code.co_argcount], args))
    f_locals.update(zip(code.co_freevars, (cell.cell_contents for cell in layer.__closure__ or ())))
    if not manager.check(f_locals):  # the locals as the frame holds them, or the timing means nothing
        raise RuntimeError(f"the guards of {layer.__name__}'s compiled frame fail on its own arguments")

    def count(node) -> int:
        if node is None:
            return 0
        children = list(node.get_child_managers())
        if hasattr(node, "get_key_value_managers"):  # a dict's managers hang off its entries
            children += [m for pair in node.get_key_value_managers().values() for m in pair]
        return len(node.get_leaf_guards()) + sum(count(child) for child in children)
    return (lambda _=None: manager.check(f_locals)), count(manager.root)


def _without_guard_eval(timing):
    """timing() with Dynamo's guard evaluation skipped (the cached graph reused as it is)."""
    with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
        return timing()


def breakdown(layers: dict, args: tuple, calls: int, rounds: int) -> dict:
    """{name: {part: us}} for each compiled layer (see the module's docstring)."""
    ids, weight, pos_weight, scale = args
    timer = HostTimer(ids.device, calls)
    dout = torch.ones(*ids.shape, weight.shape[1], device=ids.device, dtype=weight.dtype)
    parts = {}
    for name, layer in layers.items():
        torch._dynamo.reset()  # a fresh cache: the layer's own frame, compiled once
        compiled = torch.compile(layer)
        for _ in range(2):
            compiled(*args).backward(dout)
        graph, graph_args = _graph_call(layer, compiled, args)
        check, guard_count = _guard_check(layer, args)

        def clear(_=None):
            weight.grad = pos_weight.grad = None

        def backward(out):
            out.backward(dout)
            clear()

        timings = {
            "fwd": lambda: timer(lambda _: compiled(*args)),
            "unguarded": lambda: _without_guard_eval(lambda: timer(lambda _: compiled(*args))),
            "graph": lambda: timer(lambda _: graph(*graph_args)),
            "check": lambda: timer(check),
            "bwd": lambda: timer(backward, lambda: [compiled(*args) for _ in range(calls)]),
        }
        best = dict.fromkeys(timings, math.inf)
        for _ in range(rounds):
            for part, run in timings.items():
                best[part] = min(best[part], run())
                clear()
        best["guards"] = best["fwd"] - best.pop("unguarded")
        best["frame"] = best["fwd"] - best["guards"] - best["graph"]
        best["count"] = guard_count
        parts[name] = best
    torch._dynamo.reset()
    return parts


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.compiled_host", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--vocab", type=int, default=None, help="table rows (default: GPT-2's 50257 on a GPU, 100 on CPU)")
    ap.add_argument("--dim", type=int, default=None, help="default: 768 on a GPU, 64 on CPU")
    ap.add_argument("--shape", action="append", default=None, metavar="BxT",
                    help="batch x sequence length, repeatable (default: 1x1, and 8x2048 on a GPU)")
    ap.add_argument("--calls", type=int, default=None,
                    help="calls per timing (default: 200, 20 past 64 tokens: the backward's outputs are made first)")
    ap.add_argument("--dtype", action="append", choices=sorted(DTYPES), default=None,
                    help="table dtype, repeatable (default: fp32)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-autograd-threads", action="store_true",
                    help="run backwards on the calling thread (torch.autograd.set_multithreading_enabled(False))")
    ap.add_argument("--layer", action="append", choices=["nn", "cpu", "cuda", "triton"],
                    help="the layers to time, repeatable: nn (nn ops) or a pyembed backend (default: nn ops and "
                         "every backend the device has)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    vocab, dim = args.vocab or (50257 if gpu else 100), args.dim or (768 if gpu else 64)
    layers = {"compile(nn ops)": nn_layer} if not args.layer or "nn" in args.layer else {}
    layers.update({f"compile(pyembed-{b})": pyembed_layer(b) for b in dispatch.backends_for(device)
                   if b != "reference" and (not args.layer or b in args.layer)})
    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    parts = ("fwd", "guards", "graph", "frame", "bwd", "check", "count")
    for shape, dtype in itertools.product(args.shape or (["1x1", "8x2048"] if gpu else ["1x1"]),
                                          args.dtype or ["fp32"]):
        batch, seq_len = (int(n) for n in shape.split("x"))
        calls = args.calls or (200 if batch * seq_len <= 64 else 20)
        g = torch.Generator(device=device).manual_seed(0)
        weight = torch.randn(vocab, dim, device=device, generator=g).to(DTYPES[dtype]).requires_grad_()
        pos_weight = (0.02 * torch.randn(max(seq_len, 64), dim, device=device, generator=g)).to(
            DTYPES[dtype]).requires_grad_()
        ids = torch.randint(0, vocab, (batch, seq_len), device=device, generator=g)
        with torch.autograd.set_multithreading_enabled(not args.no_autograd_threads):
            found = breakdown(layers, (ids, weight, pos_weight, math.sqrt(dim)), calls, args.rounds)
        print(f"\nhost us per call, {shape} tokens, {vocab}x{dim} {dtype} table, learned positions, {where}, torch "
              f"{torch.__version__}, autograd threads {'off' if args.no_autograd_threads else 'on'}; best of "
              f"{args.rounds} rounds x {calls} calls", flush=True)
        print(f"{'layer':28s}" + "".join(f"{part:>9s}" for part in parts))
        for name, best in found.items():
            print(f"{name:28s}" + "".join(f"{best[part]:9.0f}" if part == "count" else f"{best[part]:9.1f}"
                                          for part in parts), flush=True)


if __name__ == "__main__":
    main()
