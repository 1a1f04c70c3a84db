"""``python -m bench``: every provider on every case of a suite, as CSV, markdown, PNG.

Protocol (DESIGN §8):
- correctness gate first: each provider's output and gradients are compared with the
  float64 reference on that very case; a wrong provider is reported FAILED, never timed;
- timing: on a GPU ``triton.testing.do_bench``'s samples, taken in four rounds in which
  the providers and the copy baseline take turns; on a CPU a warmed-up
  ``time.perf_counter`` loop in which they take turns call by call; either way a noisy
  machine slows them all alike; median, p20, p80. do_bench flushes the L2 before each
  call and times it on the GPU, which hides as much host time as the flush takes (~85 us
  on an H100): right for a training-sized call, not for a decoding one, whose cost is its
  host time. So a GPU case of fewer than GPU_LOOP_TOKENS tokens is timed as a decoding loop
  runs, calls back to back with CUDA events between samples (the ``timing`` column);
- the same rounds time a plain ``copy_`` moving the case's minimal bytes, and every row
  reports its effective bandwidth as a percentage of that copy's.

Minimal bytes (what an ideal kernel must move; ``es`` element size, ``U`` unique ids):
  fwd = ids + U*d*es (rows read) + T*d*es (learned positions) + N*d*es (output written)
  bwd = ids + N*d*es (grad read) + U*d*es (touched grad rows written) + T*d*es (learned)
  fwd+bwd = fwd + bwd
  step = fwd+bwd + the optimizer's 7 passes (read param, grad, 2 moments; write param,
         2 moments) over the rows it updates: all V (+ T) rows with AdamW, U with SparseAdam

On a CPU each case runs in a fresh worker process (``--no-isolate`` turns it off): in one
long process every provider slows down late in the run on our test VM, unevenly (heap and
page state left by earlier cases), so a case's ratio depended on where it sat in the suite;
a fresh process per case is what pyperf does for the same reason, and what a training
process running one configuration sees.

Compiled providers are compiled afresh for every case (``torch._dynamo.reset()``), so no
case falls back to eager at Dynamo's recompile limit. A case whose p80/p20 spread is
above SPREAD_WARN is flagged "noisy" in its note. The run ends with the geometric mean,
per mode, of each pyembed provider's speed-up over the faster of eager and compile.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import datetime
import gc
import io
import multiprocessing
import platform
import time
from pathlib import Path

import torch
from tqdm import tqdm

import pyembed

from . import report
from .cases import DTYPES, MODES, SHAPES, Case, make_ids, suite
from .providers import Provider, Tables, providers

GATE_TOL = {"fp32": 2e-3, "fp16": 1e-2, "bf16": 6e-2}  # relative to the case's largest value
SPREAD_WARN = 1.5  # p80 / p20 above this: the machine was too noisy for that case's ratio
DEFAULT_OUT = Path(__file__).resolve().parents[1] / "build" / "bench"  # git-ignored; docs/bench holds the README's


def build_tables(case: Case, device, generator) -> Tables:
    dtype = DTYPES[case.dtype]
    weight = torch.randn(case.vocab, case.dim, generator=generator).to(device=device, dtype=dtype).requires_grad_()
    pos_weight = sinusoid = None
    if case.pos == "learned":
        pos_weight = (0.02 * torch.randn(max(case.seq_len, 1024), case.dim, generator=generator))
        pos_weight = pos_weight.to(device=device, dtype=dtype).requires_grad_()
    elif case.pos == "sinusoidal":
        sinusoid = pyembed.sinusoidal_table(case.seq_len, case.dim, dtype=dtype, device=device)
    positions = torch.arange(case.seq_len, device=device)
    return Tables(weight, pos_weight, sinusoid, positions)


def own_copy(tables: Tables, parameters: bool = False) -> Tables:
    """Fresh leaves with the same values; nn.Parameters when an optimizer is to run in the
    backward (pyembed.apply_optimizer_in_backward takes Parameters)."""
    def leaf(t):
        if t is None:
            return None
        copy = t.detach().clone()
        return torch.nn.Parameter(copy) if parameters else copy.requires_grad_()
    return Tables(leaf(tables.weight), leaf(tables.pos_weight), tables.sinusoid, tables.positions)


def minimal_bytes(case: Case, ids: torch.Tensor) -> int:
    es = torch.empty((), dtype=DTYPES[case.dtype]).element_size()
    row = case.dim * es
    unique = int(ids.unique().numel())
    pos = case.seq_len * row if case.pos == "learned" else 0
    ids_bytes = ids.numel() * ids.element_size()
    fwd = ids_bytes + unique * row + pos + case.tokens * row
    bwd = ids_bytes + case.tokens * row + unique * row + pos
    updated_rows = (unique if case.grad == "sparse" else case.vocab) * row + pos
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd, "step": fwd + bwd + 7 * updated_rows}[case.mode]


def grads_of(tables: Tables):
    return [t.grad for t in (tables.weight, tables.pos_weight) if t is not None]


def zero_grads(tables: Tables):
    for t in (tables.weight, tables.pos_weight):
        if t is not None:
            t.grad = None


def run_layer(provider: Provider, case: Case, ids, tables: Tables, sparse=None):
    return provider.fn(ids, tables, case.scale, case.grad == "sparse" if sparse is None else sparse, case.dropout)


def saved_bytes(provider: Provider, case: Case, ids, tables: Tables) -> int:
    """Bytes autograd holds for the backward after one forward (each storage once, the
    tables themselves excluded): a stored dropout mask shows here."""
    storages = {}
    params = {t.untyped_storage().data_ptr() for t in (tables.weight, tables.pos_weight) if t is not None}

    def pack(t):
        if t.layout == torch.strided and t.untyped_storage().data_ptr() not in params:
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run_layer(provider, case, ids, tables)
    return sum(storages.values())


def gate(provider: Provider, case: Case, ids, tables: Tables, dout) -> str | None:
    """None when outputs and gradients match the float64 reference, else what is wrong.
    With dropout each provider draws its own mask: the reference then applies the mask the
    provider's output shows (the table has no zero rows) to its output and gradient."""
    zero_grads(tables)
    out = run_layer(provider, case, ids, tables)
    out.backward(dout)
    got = [out] + grads_of(tables)
    zero_grads(tables)
    exact_tables = Tables(
        tables.weight.detach().double().requires_grad_(),
        None if tables.pos_weight is None else tables.pos_weight.detach().double().requires_grad_(),
        None if tables.sinusoid is None else tables.sinusoid.double(),
        tables.positions,
    )
    ref = pyembed.fused_embedding(ids, exact_tables.weight, exact_tables.pos_weight,
                                  pos_encoding="sinusoidal" if case.pos == "sinusoidal" else None,
                                  scale=case.scale, backend="reference")
    if case.dropout:
        kept = out.detach() != 0
        if not 0.5 * (1 - case.dropout) < kept.double().mean().item() < min(1.0, 1.5 * (1 - case.dropout)):
            return f"kept {kept.double().mean().item():.3f} of the output with dropout {case.dropout}"
        ref = torch.where(kept, ref / (1 - case.dropout), 0)
    ref.backward(dout.double())
    expected = [ref] + grads_of(exact_tables)
    for name, a, b in zip(("output", "weight grad", "pos grad"), got, expected):
        a = a.to_dense().double() if a.is_sparse else a.double()
        err = (a - b).abs().max().item() if a.numel() else 0.0
        if err > GATE_TOL[case.dtype] * (1.0 + b.abs().max().item()):
            return f"{name} differs from the float64 reference by {err:.3g}"
    if case.grad == "sparse":
        grad = torch.autograd.grad(run_layer(provider, case, ids, tables, sparse=True), tables.weight, dout)[0]
        if not grad.is_sparse:
            return "sparse=True gave a dense gradient"
    return None


def step_fn(provider: Provider, case: Case, ids, tables: Tables, dout):
    """A zero-argument callable doing one timed step of ``case.mode``."""
    sparse = case.grad == "sparse"
    if case.mode == "fwd":
        return lambda: run_layer(provider, case, ids, tables)
    if case.mode == "fwd+bwd":
        def fwd_bwd():
            zero_grads(tables)
            run_layer(provider, case, ids, tables).backward(dout)
        return fwd_bwd
    if case.mode == "step":
        optimizers = make_optimizers(tables, sparse, in_backward=provider.optimizer_in_backward)

        def train_step():
            run_layer(provider, case, ids, tables).backward(dout)
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
        return train_step
    out = run_layer(provider, case, ids, tables)  # bwd: one forward, many backwards

    def bwd():
        zero_grads(tables)
        out.backward(dout, retain_graph=True)
    return bwd


def step_peak_bytes(step) -> int:
    """GPU memory a training step allocates beyond what it starts with (the tables and the
    optimizer state, made by a first step): the gradient, unless the optimizer runs in the
    backward, and the temporaries."""
    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start


# torch's fastest AdamW, on a CPU as on CUDA: the fused kernel (one pass over p, grad, m, v).
# On the development VM it stepped a GPT-2 table 3.8x-7x faster than foreach=True (fp32 and
# bf16, 2026-12-01), which the step mode used on the CPU until then.
FASTEST_ADAMW = {"fused": True}


def make_optimizers(tables: Tables, sparse: bool, in_backward: bool = False) -> list:
    """What a user trains the layer with: AdamW, or SparseAdam for a sparse token table
    (AdamW for a learned positional table, whose gradient stays dense). AdamW in torch's
    fastest form (FASTEST_ADAMW), the same for every provider. in_backward: the same
    optimizers run inside pyembed's backward instead."""
    dense = [t for t in (tables.pos_weight,) if t is not None]
    fastest = {} if in_backward else FASTEST_ADAMW
    groups = [(torch.optim.AdamW, [tables.weight, *dense], {"lr": 1e-4, **fastest})] if not sparse else (
        [(torch.optim.SparseAdam, [tables.weight], {"lr": 1e-4})]
        + ([(torch.optim.AdamW, dense, {"lr": 1e-4, **fastest})] if dense else []))
    if in_backward:
        return [opt for cls, params, kwargs in groups
                for opt in pyembed.apply_optimizer_in_backward(cls, params, kwargs)]
    return [cls(params, **kwargs) for cls, params, kwargs in groups]


def gate_optimizer_in_backward(provider: Provider, case: Case, ids, shared: Tables, dout) -> str | None:
    """A provider whose optimizer runs in the backward: one of its training steps against
    the same step taken by pyembed's default path and torch's optimizer (itself gated
    against the float64 reference), from the same tables and the same dropout mask."""
    plain_provider = Provider(provider.name, provider.fn)
    tables = {}
    for name, p in (("fused", provider), ("plain", plain_provider)):
        tables[name] = own_copy(shared, parameters=p.optimizer_in_backward)
        torch.manual_seed(0)  # the same dropout key for both
        step_fn(p, case, ids, tables[name], dout)()
    for name, a, b in zip(("weight", "pos weight"), *(table_values(tables[k]) for k in ("fused", "plain"))):
        err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        if err > GATE_TOL[case.dtype] * (1.0 + b.abs().max().item()):
            return f"{name} after one step differs from torch's optimizer by {err:.3g}"
    return None


def table_values(tables: Tables) -> list:
    return [t.detach() for t in (tables.weight, tables.pos_weight) if t is not None]


def time_cpu(fns: dict, budget_s: float, min_reps: int, max_reps: int) -> dict:
    """Interleaved rounds: every callable once per round, until the budget is spent. The
    order rotates from round to round, so no provider always runs right after the copy
    baseline (which evicts the caches) or right after another provider (which warms them)."""
    for fn in fns.values():
        for _ in range(2):
            fn()
    samples = {k: [] for k in fns}
    start = time.perf_counter()
    while True:
        for k in _rotated(list(fns), len(samples[next(iter(fns))])):
            fn = fns[k]
            t0 = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
        reps = len(next(iter(samples.values())))
        if reps >= max_reps or (reps >= min_reps and time.perf_counter() - start > budget_s):
            break
    return _median_p20_p80(samples)


def _rotated(names: list, round_index: int) -> list:
    """The callables' order in round ``round_index``: each round starts one further on."""
    first = round_index % len(names)
    return names[first:] + names[:first]


def _median_p20_p80(samples: dict) -> dict:
    """name -> [median, p20, p80] of its samples (nearest rank)."""
    return {k: torch.tensor(v).quantile(torch.tensor([0.5, 0.2, 0.8]), interpolation="nearest").tolist()
            for k, v in samples.items()}


GPU_ROUNDS = 4  # rounds of GPU_ROUND_MS each: the 100 ms of samples do_bench takes by default, in turns
GPU_ROUND_MS = 25


def time_gpu(fns: dict) -> dict:
    """Median, p20 and p80 (ms) of each callable's calls as ``triton.testing.do_bench``
    times them (the L2 cache flushed before each, CUDA events), in GPU_ROUNDS rounds that
    take the callables in a rotating order, as time_cpu does: a drift in the machine's
    speed (another tenant, clocks; the H100 runs flagged many cases noisy) then lands on
    every provider of the case alike, not on whichever was being timed during it."""
    import triton.testing

    samples = {k: [] for k in fns}
    for r in range(GPU_ROUNDS):
        for k in _rotated(list(fns), r):
            # The first round warms each callable up as do_bench does by default (25 ms).
            samples[k] += triton.testing.do_bench(fns[k], warmup=25 if r == 0 else 1, rep=GPU_ROUND_MS,
                                                  return_mode="all")
    return _median_p20_p80(samples)


# Fewer tokens than this: a call's cost is mostly its host time (a one-token call is), so
# the GPU rounds time calls back to back (time_gpu_loop) instead of do_bench's flushed calls.
GPU_LOOP_TOKENS = 512
GPU_LOOP_SAMPLE_MS = 1.0  # back-to-back calls per sample: about this long


def time_gpu_loop(fns: dict) -> dict:
    """Median, p20 and p80 (ms per call) of each callable run back to back, as a decoding
    loop runs it: no L2 flush, CUDA events between samples of about GPU_LOOP_SAMPLE_MS, so
    a sample is the GPU's time or the host's, whichever is longer. do_bench flushes the L2
    before each call and times the call on the GPU while the host is still ahead of it, so
    up to the flush's time (~85 us on an H100) of host work never shows: at 664ac49 its
    one-token figures were the kernels' microseconds for some providers and host hiccups of
    100+ us for others. The same rounds and rotating order as time_gpu."""
    calls, per_round = {}, {}
    for name, fn in fns.items():
        fn()  # compiled, allocated
        call_ms = _back_to_back(fn, 5, 1)[0]
        calls[name] = max(1, round(GPU_LOOP_SAMPLE_MS / call_ms))
        # GPU_ROUND_MS of calls per round, as do_bench's rounds (a call longer than a sample
        # -- a one-token step over a Llama table -- is a sample of its own)
        per_round[name] = max(1, round(GPU_ROUND_MS / max(GPU_LOOP_SAMPLE_MS, call_ms)))
    samples = {k: [] for k in fns}
    for r in range(GPU_ROUNDS):
        for k in _rotated(list(fns), r):
            samples[k] += _back_to_back(fns[k], calls[k], per_round[k])
    return _median_p20_p80(samples)


def _back_to_back(fn, calls: int, samples: int) -> list:
    """ms per call of ``samples`` runs of ``calls`` back-to-back calls, an event between runs."""
    events = [torch.cuda.Event(enable_timing=True) for _ in range(samples + 1)]
    torch.cuda.synchronize()
    events[0].record()
    for event in events[1:]:
        for _ in range(calls):
            fn()
        event.record()
    torch.cuda.synchronize()
    return [max(a.elapsed_time(b), 1e-6) / calls for a, b in zip(events, events[1:])]


def time_gpu_graphs(fns: dict) -> dict:
    """GPU-only time: each callable captured in a CUDA graph and replayed (no host work
    between kernels), median ms; a callable that cannot be captured (it waits for the
    device) is left out."""
    import triton.testing

    timings = {}
    for name, fn in fns.items():
        try:
            # return_mode, not quantiles=[0.5]: Triton returns one quantile as a float, and
            # indexing it raised a TypeError here that left every graph_ms empty on the H100.
            timings[name] = triton.testing.do_bench_cudagraph(fn, return_mode="median")
        except RuntimeError:  # a host sync inside the call: not capturable, no GPU-only time
            torch.cuda.synchronize()
    return timings


# The caching allocator's calls into the driver (memory_stats), which a call of the layer
# should never need once warm: a cudaMalloc costs the host, a cudaFree or an allocation
# retry waits for the device.
ALLOCATOR_CALLS = {"num_device_alloc": "cudaMalloc", "num_device_free": "cudaFree",
                   "num_alloc_retries": "allocation retries", "num_sync_all_streams": "allocator syncs"}


def device_calls(fn, calls: int = 3, flushed: bool = False) -> str:
    """What ``calls`` more calls of a warm ``fn`` do besides launching kernels, per call:
    the caching allocator's calls into the driver, and the syncs torch's sync debug mode
    reports (a read of device data, a stream synchronize); "" when none. ``flushed``: each
    call after an L2 flush of do_bench's buffer, as time_gpu times it (the buffer held, its
    memory taken, as there). At 26f0ba6 (H200) compiled pyembed's forward + backward took
    905 us at Llama-3 bf16 8x2048 against eager pyembed's 575, its graphed GPU time the
    same 568: host work serialised with the GPU's, which either would show here."""
    import warnings

    flush = lambda: None  # noqa: E731
    if flushed:
        import triton

        driver = triton.runtime.driver.active
        cache = driver.get_empty_cache_for_benchmark()
        flush = lambda: driver.clear_cache(cache)  # noqa: E731
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(calls):
                flush()
                fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    found = {name: (after.get(key, 0) - before.get(key, 0)) / calls for key, name in ALLOCATOR_CALLS.items()}
    found["host syncs"] = sum("synchronizing" in str(w.message) for w in caught) / calls
    return ", ".join(f"{n:g} {name}" for name, n in found.items() if n) + (" per call" if any(found.values()) else "")


def case_inputs(case: Case, device) -> tuple[Tables, torch.Tensor, torch.Tensor]:
    """A case's tables, ids and output gradient, from one generator seeded alike for every
    case (every run and every provider sees the same)."""
    generator = torch.Generator().manual_seed(0)
    tables = build_tables(case, device, generator)
    ids = make_ids(case, device, generator)
    dout = torch.randn(case.batch, case.seq_len, case.dim, generator=generator).to(device=device,
                                                                                   dtype=DTYPES[case.dtype])
    return tables, ids, dout


def run_case(case: Case, device, provs: list[Provider], args) -> list[dict]:
    # The earlier cases' tables, freed: an optimizer inside the backward and its parameter
    # refer to each other (torch.distributed.optim's convention), so only the collector
    # frees them. On the H100 at d81f5b2, 10 Llama-3 rows failed out of memory: the first
    # provider of a 1x1 case with ~62 GB allocated where its own tables take ~4 GB.
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    shared_tables, ids, dout = case_inputs(case, device)
    nbytes = minimal_bytes(case, ids)
    rows, fns = [], {}
    for p in provs:
        if p.reset is not None:
            p.reset()
        # Each provider gets its own copy of the tables, so the gradient a step frees
        # (set to None, as optimizer.zero_grad does) is the provider's own previous one.
        tables = own_copy(shared_tables, parameters=p.optimizer_in_backward)
        row = {**case.as_dict(), "label": case.label(), "tokens": case.tokens, "provider": p.name, "status": "ok"}
        reason = p.why_not(case)
        if reason is None:
            try:
                reason = (gate_optimizer_in_backward(p, case, ids, shared_tables, dout) if p.optimizer_in_backward
                          else gate(p, case, ids, tables, dout))
                if reason is not None:
                    row["status"] = "FAILED"
            except Exception as exc:  # noqa: BLE001 - a crashing provider is a failed provider
                row["status"], reason = "FAILED", f"{type(exc).__name__}: {exc}"
        else:
            row["status"] = "n/a"
        row["note"] = reason or ""
        if row["status"] == "ok":
            fns[p.name] = step_fn(p, case, ids, tables, dout)
            if case.mode in ("bwd", "fwd+bwd"):
                zero_grads(tables)
                fns[p.name]()
                row["grad_bytes"] = sum(g._values().nbytes + g._indices().nbytes if g.is_sparse else g.nbytes
                                        for g in grads_of(tables))
            if case.mode != "fwd":
                row["saved_bytes"] = saved_bytes(p, case, ids, tables)
            if case.mode == "step" and device.type == "cuda":
                row["step_peak_bytes"] = step_peak_bytes(fns[p.name])
        rows.append(row)
    # The copy baseline moves the same minimal bytes: half read, half written.
    src = torch.empty(max(nbytes // 2 // 4, 1), dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    fns["copy"] = lambda: dst.copy_(src)
    graphed = {}
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        timing = "loop" if case.tokens < GPU_LOOP_TOKENS else "flushed"
        timings = time_gpu_loop(fns) if timing == "loop" else time_gpu(fns)
        # GPU-only, after the wall-clock timings: training-sized forwards and backwards
        # against the bytes floor (DESIGN §8), and short forwards as a decoding loop under
        # CUDA graphs runs them (a short backward writes the whole gradient per call, and a
        # capture of thousands of those costs seconds).
        if case.mode == "fwd" or (case.mode == "fwd+bwd" and case.tokens >= 4096):
            graphed = time_gpu_graphs(fns)
        for row in rows:  # after every timing: its calls change no figure
            found = device_calls(fns[row["provider"]], flushed=timing == "flushed") if row["provider"] in fns else ""
            if found:
                row["note"] = (row["note"] + "; " if row["note"] else "") + found
    else:
        timing = "cpu"
        timings = time_cpu(fns, args.budget, args.min_reps, args.max_reps)
    copy_ms = timings["copy"][0]
    for row in rows:
        if row["provider"] in timings:
            med, p20, p80 = timings[row["provider"]]
            row.update(median_ms=med, p20_ms=p20, p80_ms=p80, gbps=nbytes / med / 1e6,
                       pct_of_copy=100.0 * copy_ms / med, spread=p80 / p20)
            if p80 / p20 > SPREAD_WARN:
                row["note"] = (row["note"] + "; " if row["note"] else "") + f"noisy (p80/p20 = {p80 / p20:.2f})"
        row.update(copy_ms=copy_ms, min_bytes=nbytes, timing=timing)
        if row["provider"] in graphed and "copy" in graphed:
            row.update(graph_ms=graphed[row["provider"]],
                       graph_pct_of_copy=100.0 * graphed["copy"] / graphed[row["provider"]])
    by_name = {r["provider"]: r for r in rows}
    for row in rows:
        for base in ("eager", "compile"):
            ref = by_name.get(base, {}).get("median_ms")
            if ref and row.get("median_ms"):
                row[f"speedup_vs_{base}"] = ref / row["median_ms"]
    return rows


def _quiet_cpp_extension_import() -> None:
    """Inductor imports torch.utils.cpp_extension, which prints "No CUDA runtime is found,
    using CUDA_HOME=..." once per process on a machine with a CUDA toolkit and no GPU: once
    per compiled case, each in a process of its own. The benchmark imports it first with
    that line silenced (in its own processes: the library changes nothing)."""
    with contextlib.redirect_stderr(io.StringIO()):
        import torch.utils.cpp_extension  # noqa: F401


def _run_case_in_worker(case: Case, device_type: str, provider_names: list, args) -> list[dict]:
    """run_case in this (fresh) process, with the providers rebuilt by name."""
    _quiet_cpp_extension_import()
    torch.autograd.set_multithreading_enabled(args.autograd_threads)
    device = torch.device(device_type)
    provs = [p for p in providers(device, args.reference) if p.name in provider_names]
    return run_case(case, device, provs, args)


def run_case_isolated(case: Case, device, provs: list[Provider], args) -> list[dict]:
    """run_case in a fresh process of its own (spawned: no state inherited from earlier cases)."""
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=context) as worker:
        return worker.submit(_run_case_in_worker, case, device.type, [p.name for p in provs], args).result()


class TimeLimit:
    """--time-limit: a case starts only if the run would still be within the limit when it
    ends, taking as long as the median of the cases of its shape so far (of all cases, before
    one of its shape has run; the first case always runs). A case that does not fit is left
    out and named, and the next ones are still tried (a smaller table's may fit)."""

    def __init__(self, seconds: float | None):
        self.seconds, self.start = seconds, time.perf_counter()
        self.took: dict[str, list[float]] = {}  # seconds per case, by shape
        self.left_out: list[str] = []

    def fits(self, case: Case) -> bool:
        if self.seconds is None or not self.took:
            return True
        seen = self.took.get(case.shape) or [t for times in self.took.values() for t in times]
        expected = sorted(seen)[len(seen) // 2]
        if time.perf_counter() - self.start + expected <= self.seconds:
            return True
        self.left_out.append(case.label())
        return False

    @contextlib.contextmanager
    def timing(self, case: Case):
        start = time.perf_counter()
        yield
        self.took.setdefault(case.shape, []).append(time.perf_counter() - start)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default=None, choices=["quick", "main", "cpu", "gpu", "all"],
                    help="default: main on a CPU (a few minutes), gpu on a GPU; all: the whole cross product (hours)")
    ap.add_argument("--quick", action="store_true", help="the quick suite: one tiny shape, seconds")
    ap.add_argument("--full", action="store_true",
                    help="the whole suite of this device: cpu (46 cases, ~10 min on 2 cores) or gpu")
    ap.add_argument("--shape", nargs="*", choices=sorted(SHAPES), help="only these shapes")
    ap.add_argument("--mode", nargs="*", choices=list(MODES), help="only these modes")
    ap.add_argument("--provider", nargs="*", help="only these providers (eager, compile, pyembed-cpu, ...)")
    ap.add_argument("--dtype", nargs="*", choices=sorted(DTYPES), help="only these dtypes")
    ap.add_argument("--label", help="only cases whose label contains this text (e.g. 'dropout', '8x512 step')")
    ap.add_argument("--reference", action="store_true", help="also time the (slow) reference backend")
    ap.add_argument("--budget", type=float, default=0.6, help="CPU: seconds of timing per case (default 0.6)")
    ap.add_argument("--min-reps", type=int, default=25,
                    help="CPU: rounds at least, even past the budget (default 25: with 10, the ratio of a "
                         "20 ms SparseAdam step moved from 1.04x to 1.34x between runs)")
    ap.add_argument("--max-reps", type=int, default=300)
    ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                    help="run each case in a fresh process (default: on a CPU)")
    ap.add_argument("--autograd-threads", action=argparse.BooleanOptionalAction, default=True,
                    help="--no-autograd-threads: every backward runs on the calling thread "
                         "(torch.autograd.set_multithreading_enabled(False)), not handed to autograd's "
                         "device thread -- on an H100 host that halved a backward's host time for every provider")
    ap.add_argument("--time-limit", type=float, default=None, metavar="SECONDS",
                    help="start a case only if the run, by the time it ends, stays within SECONDS (as the cases of "
                         "its shape took so far); the rest are left out and named -- for a host that limits one "
                         "command's time (the gpu suite runs in priority order)")
    ap.add_argument("--out", default=str(DEFAULT_OUT),
                    help="folder for results.csv, results.md and the PNG plots, written anew by each run "
                         "(default build/bench, git-ignored; "
                         "the README's figures are refreshed on purpose with --out docs/bench)")
    return ap.parse_args(argv)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    _quiet_cpp_extension_import()
    torch.autograd.set_multithreading_enabled(args.autograd_threads)  # a setting of this thread, kept
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    name = "quick" if args.quick else args.suite or ("gpu" if on_gpu else "cpu" if args.full else "main")
    cases = [c for c in suite(name)
             if (not args.shape or c.shape in args.shape) and (not args.mode or c.mode in args.mode)
             and (not args.dtype or c.dtype in args.dtype)
             and (not args.label or args.label in c.label())
             and not (device.type == "cpu" and c.shape == "llama3")]  # 2 GB tables: GPU only
    named = set(args.provider or ())
    available = providers(device, include_reference=True)  # (asking for the reference by name times it too)
    unknown = sorted(named - {p.name for p in available})
    if unknown:
        raise SystemExit(f"python -m bench: no provider {', '.join(map(repr, unknown))} on {device.type}; "
                         f"this device's: {', '.join(p.name for p in available)}")
    provs = [p for p in available if p.name in named or not named and (args.reference or "reference" not in p.name)]
    if not cases:
        raise SystemExit(f"python -m bench: no case of the {name} suite matches the filters given"
                         + ("; llama3 runs on a GPU only" if device.type == "cpu" and "llama3" in (args.shape or ())
                            else "") + " (--full: this device's whole suite; --suite all: every case)")
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else (platform.processor() or platform.machine())
    meta = {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": f"{device.type}: {device_name}, {torch.get_num_threads()} threads" if device.type == "cpu"
        else f"cuda: {device_name}",
        "torch": torch.__version__,
        "pyembed": pyembed.__version__,
        "suite": name,
    }
    if not args.autograd_threads:
        meta["device"] += " (backward on the calling thread)"
    isolate = args.isolate if args.isolate is not None else device.type == "cpu"
    print(f"pyembed benchmark: suite {name}, {len(cases)} cases, providers {[p.name for p in provs]}, on {meta['device']}"
          + (", each case in a fresh process" if isolate else ""))
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    csv_path.unlink(missing_ok=True)  # this run's results only (an earlier run's are not mixed in)
    limit = TimeLimit(args.time_limit)
    for case in tqdm(cases, desc="cases", unit="case"):
        if not limit.fits(case):
            continue
        with limit.timing(case):
            measured = run_case_isolated(case, device, provs, args) if isolate else run_case(case, device, provs, args)
        case_rows = [{**meta, **r} for r in measured]
        rows += case_rows
        report.append_csv(case_rows, csv_path)  # case by case: a run cut short keeps what it measured
    table = report.table(rows, [p.name for p in provs])
    if limit.left_out:
        table += (f"\n{len(limit.left_out)} of {len(cases)} cases left out by --time-limit {args.time_limit:g} s: "
                  + "; ".join(limit.left_out) + "\n")
    (out / "results.md").write_text(table)
    print(table)
    if name == "main":
        print("(the main cases only; --full runs the whole suite of this device)")
    noisy = [f"{r['label']} {r['provider']}" for r in rows if "noisy" in r.get("note", "")]
    if noisy:
        print(f"warning: {len(noisy)} timings had p80/p20 > {SPREAD_WARN} (a busy machine?): {'; '.join(noisy)}")
    pngs = report.plots(rows, out, meta)
    plots = ", ".join(str(p) for p in pngs) or "none (the plots show the fp32 / learned / uniform / dense grid, not in this run)"
    print(f"\nCSV written to {csv_path}, this run's table in {out / 'results.md'}; plots: {plots}")
    return rows
