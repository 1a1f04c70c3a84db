"""``python -m bench.model``: the input layer inside a model's training step, eager and compiled.

The main suite times the input layer alone; a compiled layer alone is mostly
torch.compile's runtime (guards, AOTAutograd's Python backward node, autograd's device
thread: ~250-330 us of host time per forward + backward on the H200's host at 26f0ba6)
around one or two kernels, which a user compiling a whole model pays once per step for
all its layers, and during which a model's other kernels keep the GPU busy. What users
run is the layer inside a model compiled as one graph, where Inductor also fuses an
nn-ops layer's lookup into the first LayerNorm and its gradient's scatter into that
LayerNorm's backward, and cannot fuse pyembed's op. So: the same small model with its
input layer written either way, each eager and under ``torch.compile`` (the whole model,
one graph), one training step each:

- the model: input layer (token lookup * sqrt(d) + learned positions) -> ``blocks``
  pre-norm MLP blocks as GPT-2's (x + W2 gelu(W1 LayerNorm(x)), 4d wide) -> LayerNorm ->
  loss = the mean over tokens of the output along a fixed direction (no LM head: its
  matmul would be most of the step whatever the input layer does; ``--blocks`` adds work
  after the layer);
- ``eager`` / ``compile``: the input layer in nn ops (nn.Embedding, the scale, the learned
  positions' table); ``pyembed-<backend>`` / ``compile(pyembed-<backend>)``: the same
  layer as ``pyembed.EmbeddingLayer``, the same parameters (state_dict) -- a model with
  ``pyembed.replace_embeddings`` applied looks like this; for the C++ backends also
  ``compile(pyembed-<backend>, ATen forward)``, Inductor given pyembed's forward as ATen
  ops to fuse, the backward still pyembed's (an experiment: ATenForward);
- ``the rest``: the blocks and the loss alone, on a (B, T, d) input that wants a gradient
  (eager and compiled): what a step costs without any input layer, so that a provider's
  fwd+bwd less its mode's ``the rest`` is what its input layer adds to the step;
- ``fwd+bwd``: forward, loss, backward, the gradients set to None; ``step``: the same and
  AdamW over every parameter in torch's fastest form (``fused=True``, on CPU and CUDA), then
  ``zero_grad(set_to_none=True)``, as the main suite's ``step``.

Each model's input layer output, loss and input-layer gradients are first checked against
the eager nn-ops model run in float64 (a wrong one is reported FAILED, not timed). On a
GPU fp32 matmuls are timed with TF32 (``torch.set_float32_matmul_precision("high")``, as
fp32 training is usually run; said in the table's title), checked without; timings as
the main suite's (``bench.run``: do_bench's flushed samples in rotating rounds on a GPU,
interleaved calls on a CPU).
"""

from __future__ import annotations

import argparse
import copy
import math
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

import pyembed
from pyembed import dispatch

from .cases import DTYPES, SHAPES
from .run import FASTEST_ADAMW, GATE_TOL, time_cpu, time_gpu
from .targets import format_ms


class NNInputLayer(nn.Module):
    """The input layer as models write it, with pyembed.EmbeddingLayer's parameter names
    (``token_embedding.weight``, ``pos_embedding``): one state_dict loads into either."""

    def __init__(self, vocab: int, dim: int, max_seq_len: int, device=None, dtype=None):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, dim, device=device, dtype=dtype)
        self.pos_embedding = nn.Parameter(torch.empty(max_seq_len, dim, device=device, dtype=dtype))
        self.scale = math.sqrt(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device)
        return self.token_embedding(ids) * self.scale + F.embedding(positions, self.pos_embedding)


class FixedInput(nn.Module):
    """``the rest``: no input layer; the blocks get a fixed input that wants a gradient (its
    backward computes what an input layer's backward would receive). A Parameter, so that
    torch.compile takes it as an input, not a constant; the optimizer leaves it out."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self.x = nn.Parameter(x)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.x


class Block(nn.Module):
    def __init__(self, dim: int, device=None, dtype=None):
        super().__init__()
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        self.up = nn.Linear(dim, 4 * dim, device=device, dtype=dtype)
        self.down = nn.Linear(4 * dim, dim, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    def __init__(self, input_layer: nn.Module, dim: int, blocks: int, device=None, dtype=None):
        super().__init__()
        self.input_layer = input_layer
        self.blocks = nn.Sequential(*(Block(dim, device, dtype) for _ in range(blocks)))
        self.norm = nn.LayerNorm(dim, device=device, dtype=dtype)
        # The loss: each token's output along a fixed random direction, averaged (a linear
        # stand-in for an LM head's loss; its squared norm would be constant: LayerNorm's).
        self.register_buffer("probe", torch.randn(dim, device=device).to(dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.norm(self.blocks(self.input_layer(ids))) * self.probe).float().sum(-1).mean()


class ATenForward:
    """A compiled pyembed model whose forward op Inductor takes in its ATen form
    (``pyembed.decompositions()``: a gather, the scale, the positions' gather), so that it
    can fuse it into the next LayerNorm as it does an nn-ops layer's, while the backward stays
    pyembed's op (deterministic, the table written once). An experiment of this benchmark's,
    not a pyembed feature: Inductor's decomposition table is process-wide, so the form is put
    there only around this model's calls (its compiles happen in its first calls), with
    Inductor's and AOTAutograd's caches off meanwhile -- they key on the graph Dynamo traced,
    the plain compiled model's too, and handed either model the other's code (seen here).
    Bad ids are left to the gathers (on a GPU a device-side assert), not pyembed's check.
    The switching costs each call ~7 us of host time on the development VM (in its figures)."""

    def __init__(self, compiled):
        self.compiled, self._orig_mod = compiled, compiled._orig_mod
        self.op = torch.ops.pyembed.embedding_forward.default  # the C++ backends' forward op
        self.form = pyembed.decompositions()[self.op]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        from torch._functorch import config as aot_config
        from torch._inductor import config as inductor_config, decomposition

        table, caches = decomposition.decompositions, (inductor_config.fx_graph_cache, aot_config.enable_autograd_cache)
        table[self.op] = self.form
        decomposition.fast_random_decomps.cache_clear()  # select_decomp_table's copy of the table
        inductor_config.fx_graph_cache = aot_config.enable_autograd_cache = False
        try:
            return self.compiled(ids)
        finally:
            del table[self.op]
            decomposition.fast_random_decomps.cache_clear()
            inductor_config.fx_graph_cache, aot_config.enable_autograd_cache = caches


def build_models(vocab, dim, batch, seq_len, blocks, dtype, device, backends, seed=0, compile_mode=None) -> dict:
    """{provider: its model}: each eager model and, after it, its compiled twin (own
    parameters, own forward code; torch.compile's ``mode``), all starting from the same
    parameters."""
    torch.manual_seed(seed)
    base = Model(NNInputLayer(vocab, dim, seq_len, device, dtype), dim, blocks, device, dtype)
    with torch.no_grad():
        base.input_layer.token_embedding.weight.normal_()
        base.input_layer.pos_embedding.normal_(std=0.02)
    state = base.state_dict()
    models = {"eager": base}
    for backend in backends:
        layer = pyembed.EmbeddingLayer(vocab, dim, max_seq_len=seq_len, pos_encoding="learned",
                                       scale_embeddings=True, backend=backend, device=device, dtype=dtype)
        model = Model(layer, dim, blocks, device, dtype)
        model.load_state_dict(state)
        models[f"pyembed-{backend}"] = model
    x = torch.randn(batch, seq_len, dim, device=device, dtype=dtype)
    rest = Model(FixedInput(x), dim, blocks, device, dtype)
    rest.load_state_dict({k: v for k, v in state.items() if not k.startswith("input_layer.")}, strict=False)
    models["the rest"] = rest
    found = {}
    for name, model in models.items():
        found[name] = model
        found["compile" if name == "eager" else f"compile({name})"] = _compiled_twin(model, compile_mode)
        if name in ("pyembed-cpu", "pyembed-cuda"):
            found[f"compile({name}, ATen forward)"] = ATenForward(_compiled_twin(model, compile_mode))
    return found


def _compiled_twin(model: nn.Module, compile_mode) -> nn.Module:
    """torch.compile of a copy of ``model``: its own parameters, so that each provider's steps
    update only its own, and a forward of its own code. Dynamo keeps compiled graphs per
    code object: with Model.forward's one code, every compiled model's call would first try
    the graphs of those called before it, and the whole set would share one recompile limit
    (8 graphs)."""
    twin = copy.deepcopy(model)
    forward = Model.forward
    twin.forward = types.MethodType(types.FunctionType(forward.__code__.replace(), forward.__globals__), twin)
    return torch.compile(twin, mode=compile_mode)


def _module(model) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's OptimizedModule (ATenForward) holds the model


CHECKED = ("input layer's output", "loss", "token table's gradient", "positions' gradient")


def checked_values(model, ids: torch.Tensor) -> list:
    """What the gate compares (CHECKED), from one forward and backward of ``model``: the
    input layer's output by itself too, since the model's LayerNorms make its loss and
    gradients all but blind to a uniformly wrong scale of that output."""
    module = _module(model)
    with torch.no_grad():
        layer_out = module.input_layer(ids)
    module.zero_grad(set_to_none=True)
    loss = model(ids)
    loss.backward()
    values = [layer_out, loss.detach(), module.input_layer.token_embedding.weight.grad,
              module.input_layer.pos_embedding.grad]
    module.zero_grad(set_to_none=True)
    return values


def gate(name: str, model, want: list, ids: torch.Tensor, dtype: str) -> str | None:
    """None when ``model``'s checked values match ``want``, the float64 nn-ops model's
    (checked_values of the eager model's first state, in float64), else what differs."""
    if isinstance(_module(model).input_layer, FixedInput):
        return None  # no input layer to check: the blocks are nn modules
    for what, a, b in zip(CHECKED, checked_values(model, ids), want):
        err = (a.double() - b).abs().max().item()
        if err > GATE_TOL[dtype] * b.abs().max().item():
            return f"{name}: {what} differs from the float64 nn-ops model's by {err:.3g} (largest {b.abs().max():.3g})"
    return None


def step_fns(model, ids: torch.Tensor) -> dict:
    """{"fwd+bwd": ..., "step": ...}: zero-argument callables on the model's own parameters."""
    module = _module(model)
    leaves = list(module.parameters())
    fixed = module.input_layer.x if isinstance(module.input_layer, FixedInput) else None
    params = [p for p in leaves if p is not fixed]
    optimizer = torch.optim.AdamW(params, lr=1e-4, **FASTEST_ADAMW)

    def fwd_bwd():
        for p in leaves:
            p.grad = None
        model(ids).backward()

    def step():
        model(ids).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if fixed is not None:
            fixed.grad = None
    return {"fwd+bwd": fwd_bwd, "step": step}


def measure(vocab, dim, batch, seq_len, blocks, dtype, device, backends, budget_s=2.0, tf32=False,
            compile_mode=None) -> dict:
    """{provider: {"fwd+bwd": (median, p20, p80) ms, "step": ..., "status": ...}}; ``tf32``:
    timed with TF32 matmuls (checked without: the gate's tolerance is fp32's)."""
    torch._dynamo.reset()
    models = build_models(vocab, dim, batch, seq_len, blocks, DTYPES[dtype], device, backends,
                          compile_mode=compile_mode)
    ids = torch.randint(0, vocab, (batch, seq_len), device=device, generator=torch.Generator(device).manual_seed(1))
    want = checked_values(copy.deepcopy(models["eager"]).double(), ids)
    results, fns = {}, {}
    for name, model in models.items():
        try:
            problem = gate(name, model, want, ids, dtype)
        except Exception as exc:  # noqa: BLE001 - a crashing provider is a failed provider
            problem = f"{name}: {type(exc).__name__}: {exc}"
        results[name] = {"status": "FAILED: " + problem if problem else "ok"}
        if problem is None:
            for kind, fn in step_fns(model, ids).items():
                fns[(name, kind)] = fn
    del want
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if tf32 else precision)  # (a compiled model recompiles once)
    try:
        for kind in ("fwd+bwd", "step"):
            chosen = {name: fn for (name, k), fn in fns.items() if k == kind}
            timings = time_gpu(chosen) if device.type == "cuda" else time_cpu(chosen, budget_s, 5, 200)
            for name, figures in timings.items():
                results[name][kind] = figures
    finally:
        torch.set_float32_matmul_precision(precision)
    return results


def table(results: dict, title: str) -> str:
    """The figures as markdown: medians, what each input layer adds to its mode's rest, and
    each pyembed model's step against the nn-ops model's in the same mode."""
    rest = {"eager": results.get("the rest", {}).get("fwd+bwd"),
            "compiled": results.get("compile(the rest)", {}).get("fwd+bwd")}
    nn_step = {"eager": results.get("eager", {}).get("step"), "compiled": results.get("compile", {}).get("step")}
    lines = [title, "", "| model | fwd+bwd | step | its input layer in fwd+bwd | step, nn ops' / its |",
             "|---|---|---|---|---|"]
    for name, found in results.items():
        if found["status"] != "ok":
            lines.append(f"| {name} | {found['status']} | | | |")
            continue
        mode = "compiled" if name.startswith("compile") else "eager"
        fwd_bwd, step = found["fwd+bwd"][0], found["step"][0]
        share = "" if "the rest" in name or rest[mode] is None else format_ms(fwd_bwd - rest[mode][0])
        versus = ("" if "pyembed" not in name or nn_step[mode] is None else f"{nn_step[mode][0] / step:.2f}x")
        lines.append(f"| {name} | {format_ms(fwd_bwd)} | {format_ms(step)} | {share} | {versus} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.model", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="gpt2", choices=sorted(SHAPES), help="the input layer's (vocab, dim)")
    ap.add_argument("--tokens", default=None, metavar="BxT", help="default: 8x2048 on a GPU, 4x128 on CPU")
    ap.add_argument("--dtype", action="append", choices=sorted(DTYPES), default=None,
                    help="the model's dtype, repeatable (default: fp32)")
    ap.add_argument("--blocks", type=int, default=1, help="MLP blocks after the input layer (default: 1)")
    ap.add_argument("--backend", action="append", default=None,
                    help="pyembed backends, repeatable (default: every one this device has but the reference)")
    ap.add_argument("--budget", type=float, default=2.0, help="CPU: seconds of timing per mode")
    ap.add_argument("--compile-mode", default=None, choices=["default", "reduce-overhead", "max-autotune",
                                                             "max-autotune-no-cudagraphs"],
                    help="torch.compile's mode for the compiled models (reduce-overhead: CUDA graphs, no host "
                         "time per kernel)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batch, seq_len = (int(n) for n in (args.tokens or ("8x2048" if gpu else "4x128")).split("x"))
    vocab, dim = SHAPES[args.shape]
    backends = args.backend or [b for b in dispatch.backends_for(device) if b != "reference"]
    where = torch.cuda.get_device_name(device) if gpu else "CPU"
    for dtype in args.dtype or ["fp32"]:
        start = time.perf_counter()
        results = measure(vocab, dim, batch, seq_len, args.blocks, dtype, device, backends, args.budget, tf32=gpu,
                          compile_mode=args.compile_mode)
        tf32 = " (TF32 matmuls)" if gpu and dtype == "fp32" else ""
        title = (f"The input layer in a model: {args.shape} ({vocab}x{dim}) {batch}x{seq_len} {dtype}{tf32}, "
                 f"{args.blocks} block(s), torch.compile mode {args.compile_mode or 'default'}, {where}, torch "
                 f"{torch.__version__}, pyembed {pyembed.__version__}; "
                 f"medians ({time.perf_counter() - start:.0f} s)")
        print(table(results, title) + "\n", flush=True)


if __name__ == "__main__":
    main()
