"""Where a GPU call's time goes, for ``make gpu-check`` (step "profile"): per backend and
``validate`` setting, the median of forward and forward + backward (do_bench), the number
of kernels one call launches, and torch.profiler's tables by GPU and by CPU time, at
GPT-2 8x2048 and 1x1 tokens (fp32, learned positions), after the host microseconds of
each layer of a one-token call, then an AdamW training step's kernels with torch's
optimizer and with the optimizer inside pyembed's backward, and a sparse step with
SparseAdam (nn ops, pyembed eager and compiled). ``--ncu`` instead runs one forward
per backend on a Llama-2 8x2048 table (fp32 and bf16) and one dense backward per backend
at GPT-2 8x2048 (fp32, a row used 12000 times) and 1x1 (the few-token kernel writing the
whole table), and one AdamW update inside the backward per backend (a Llama-2 bf16 table:
from gradient rows, and from dout with the backward's sums, optimizer_backward), for
Nsight Compute to read the kernels' DRAM throughput and occupancy.

The first GPU run (H100, torch 2.11) measured pyembed below eager and torch.compile in
most cases, by margins that host-side work (launches, the range check's sync) explains
better than the kernels: this is the breakdown that tells which.
"""

import argparse
import os

import torch
import triton.testing

import pyembed
from pyembed import dispatch

GPT2 = (50257, 768)
LLAMA3 = (128256, 4096)


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
            for validate in (True, "sync", False):
                calls[f"pyembed-{backend} validate={validate}"] = (
                    lambda b=backend, v=validate: pyembed.fused_embedding(ids, weight, pos_weight, scale=scale,
                                                                          validate=v, backend=b))
            # The learned positions' share: at 664ac49 a GPT-2 8x2048 fwd+bwd took 386 us with
            # them and 176 us with the sinusoid (`cuda`), more than their bytes explain.
            calls[f"pyembed-{backend} sinusoidal"] = (
                lambda b=backend: pyembed.fused_embedding(ids, weight, pos_encoding="sinusoidal", scale=scale,
                                                          backend=b))
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


def host_costs(backends, calls=300):
    """Host microseconds per call of each layer of a one-token forward (the GPU work is a
    few microseconds, so the host sets the pace), and of the dense backward ops at 8x2048:
    which layer holds the fixed cost -- Python checks, autograd.Function, the custom op's
    dispatch, the Triton launcher, or the range check's sync."""
    import time

    from pyembed import _triton

    weight, pos_weight, ids, _ = tensors(*GPT2, 1, 1, torch.float32)

    def per_call(fn):
        fn()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / calls * 1e6

    layers = {"eager F.embedding * scale + pos": lambda: torch.nn.functional.embedding(ids, weight) * 2.0 + pos_weight[:1]}
    for backend in backends:
        for validate in (True, "sync", False):
            layers[f"{backend}: fused_embedding validate={validate}"] = (
                lambda b=backend, v=validate: pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, validate=v,
                                                                      backend=b))
        op = dispatch.get(backend).forward
        layers[f"{backend}: forward op alone"] = lambda op=op: op(ids, weight, pos_weight, None, "learned", 2.0, 0,
                                                                  None, 0.0, 0, 0)
    if "triton" in backends:
        layers["triton: _forward body (no custom op)"] = lambda: _triton._forward(
            ids, weight, pos_weight, None, "learned", 2.0, 0, None, 0.0, launch=lambda kernel: kernel)
        out = torch.empty(1, 1, GPT2[1], device="cuda")
        kernels = _triton._kernels()
        layers["triton: launcher alone"] = lambda: kernels.embedding_forward(
            ids, weight, pos_weight, None, 1, 2.0, 0, None, 0, 1.0, 0, GPT2[1], out)
    layers["ids.item() (one sync)"] = lambda: ids.item()
    with torch.no_grad():
        for name, fn in layers.items():
            print(f"host 1x1 {name}: {per_call(fn):.1f} us/call", flush=True)
    # With a gradient, the layers a one-token `triton` call adds to the no_grad one: at
    # d81f5b2 ~20-26 us on the H100's host against ~6 us on the development VM. torch's own
    # cost of an autograd.Function's apply on a CUDA tensor calibrates the rest.
    from pyembed import _autograd

    class Identity(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad):
            return grad

    config = _autograd.FusedConfig("learned", 2.0, 0, None, False, False, False, "triton", 0.0, 0)
    graded = {"a plain autograd.Function's apply (a view)": lambda: Identity.apply(weight),
              "F.embedding": lambda: torch.nn.functional.embedding(ids, weight)}
    if "triton" in backends:
        graded["triton: FusedEmbeddingFunctionWithJvp.apply"] = lambda: _autograd.FusedEmbeddingFunctionWithJvp.apply(
            ids, weight, pos_weight, None, None, config)
        lookup = dispatch.get("triton").autograd_op
        graded["triton: its lookup op (C++ checks and node, Python kernels)"] = lambda: lookup(
            ids, weight, pos_weight, None, "learned", 2.0, 0, None, False, False, 0)
    for name, fn in graded.items():
        print(f"host 1x1 with a gradient, {name}: {per_call(fn):.1f} us/call", flush=True)
    host_cost_targets(backends, weight, ids, per_call)
    weight, pos_weight, ids, dout = tensors(*GPT2, 8, 2048, torch.float32)
    backward_args = (dout, ids, None, 0, GPT2[0], pos_weight.shape[0], 2.0, None, False, True, True)
    for backend in backends:
        op = dispatch.get(backend).backward
        us = per_call(lambda op=op: op(*backward_args))
        print(f"host 8x2048 {backend}: dense backward op: {us:.1f} us/call (GPU work included)", flush=True)
    # At 79bdffb (H200) `triton`'s op took 313 us a call back to back, 164 us of host with the
    # GPU held busy, ~110 us of GPU work: something waits. The CUDA runtime / driver calls of
    # 20 back-to-back calls, by total time, show which (an allocation, a synchronisation).
    for backend in backends:
        op = dispatch.get(backend).backward
        for _ in range(3):  # the plans bound (triton), the allocator's blocks cached
            op(*backward_args)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(20):
                op(*backward_args)
            torch.cuda.synchronize()
        runtime = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
        for e in sorted(runtime, key=lambda e: -e.cpu_time_total)[:6]:
            print(f"host 8x2048 {backend}: dense backward op x20, {e.key}: {e.count} calls, "
                  f"{e.cpu_time_total:.0f} us in all", flush=True)


def host_us_gpu_busy(fn, calls: int) -> float:
    """Host microseconds per call of ``fn`` with the GPU held by a ~0.25 s sleep kernel
    queued first, so the host never waits for it (a call that does wait, a sync, shows as
    ~0.25 s / calls)."""
    import time

    fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(500_000_000)  # cycles: ~0.25 s at the H100's 1.98 GHz, past any 40 calls' host time
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _timed(fn, spent: list):
    """``fn``, adding each call's seconds and count to ``spent``."""
    import time

    def timed(*args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1
    return timed


def host_only_costs(backends, calls=40, rounds=3):
    """The host time of a GPT-2 8x2048 forward + backward alone: the GPU is held by a ~0.25 s
    sleep kernel first, so the host never waits for it (a call that does wait, a sync,
    shows as ~0.25 s / calls). With autograd's device thread as torch sets it up (the CUDA
    part of a backward handed to a worker thread) and without it
    (``set_multithreading_enabled(False)``: the calling thread runs it): at d81f5b2 the
    handoff cost every backward ~100-300 us on the H100's host, torch's own included, and
    more where the node is Python (`triton`: 548 against 273 us; `cuda`, a C++ node: 210
    against 97). So the same for ``x * 2`` as a C++ node and inside a trivial Python
    autograd.Function (what a Python node costs there, whatever it runs), for each backend
    with dropout, and for each backend with AdamW inside its backward (since 3fa9b56 the C++
    node, its update a Python call). Beside each, the wall time per call spent inside pyembed's Python
    backward (``_autograd._gradients``, triton's backward kernel, the node's update
    ``_autograd.fused_step``; on whichever thread runs it): at de2aee7 a `triton`
    fwd+bwd took 722 us with the threads and 279 without (with dropout 377 / 234), against
    202 / 80 for ``x * 2`` in a Python Function -- whether that is the handoff or Python
    running slower on the device thread, this says. Then the parts of pyembed's backward:
    the dense backward op and torch.sort, which `triton` takes without its tile sort
    (PYEMBED_TRITON_TILE_SORT=0)."""
    from pyembed import _autograd, _extension

    weight, pos_weight, ids, dout = tensors(*GPT2, 8, 2048, torch.float32)
    scale = GPT2[1] ** 0.5

    def host_only(fn):
        return host_us_gpu_busy(fn, calls)

    def fwd_bwd(layer):
        def run():
            weight.grad = pos_weight.grad = None
            layer().backward(dout)
        return run

    class Double(torch.autograd.Function):  # the least a Python node can do
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return grad * 2

    layers = {"eager F.embedding * scale + pos": fwd_bwd(
        lambda: torch.nn.functional.embedding(ids, weight) * scale + pos_weight[:2048]),
        "x * 2 (a C++ node)": fwd_bwd(lambda: dout.detach().requires_grad_() * 2),
        "x * 2 in a Python autograd.Function": fwd_bwd(lambda: Double.apply(dout.detach().requires_grad_()))}
    layers.update({f"pyembed {b}": fwd_bwd(lambda b=b: pyembed.fused_embedding(ids, weight, pos_weight, scale=scale,
                                                                                  backend=b)) for b in backends})
    # With dropout: at d81f5b2 a Python Function (787 us a `cuda` fwd+bwd in the benchmark
    # against 232 without), now the C++ node on `cuda`.
    layers.update({f"pyembed {b}, dropout 0.1": fwd_bwd(
        lambda b=b: pyembed.fused_embedding(ids, weight, pos_weight, scale=scale, dropout_p=0.1, backend=b))
        for b in backends})
    for b in backends:  # the dense token table's update: optimizer_backward on both GPU backends
        tables = [torch.nn.Parameter(weight.detach().clone()), torch.nn.Parameter(pos_weight.detach().clone())]
        pyembed.apply_optimizer_in_backward(torch.optim.AdamW, tables, {"lr": 1e-4})
        layers[f"pyembed {b}, AdamW inside the backward"] = (
            lambda b=b, tables=tables: pyembed.fused_embedding(ids, *tables, scale=scale, backend=b).backward(dout))
    spent = [0.0, 0]  # seconds inside _gradients (or triton's node's backward, or fused_step), its calls
    gradients = _autograd._gradients
    timed_gradients = _timed(gradients, spent)
    _autograd._gradients = timed_gradients  # read as a global by every Function's backward
    # A plain `triton` call's backward is the C++ node's Python kernel (csrc/pyembed.cpp), not
    # _gradients: timed by registering a timed copy of it for the loop -- and, from a
    # metadata's third call on, the whole replay the node calls instead (set_backward_replay),
    # its plans made afresh so that the node keeps a timed copy of it.
    python_kernels = set_backward_replay = None
    if "triton" in backends and getattr(_extension._C, "set_python_kernels", None) is not None:
        from pyembed import _triton

        python_kernels = (_triton.node_forward, _triton.backward, _triton.sparse_backward)
        _extension._C.set_python_kernels(python_kernels[0], _timed(python_kernels[1], spent), python_kernels[2])
        set_backward_replay = getattr(_extension._C, "set_backward_replay", None)
        if set_backward_replay is not None:
            _extension._C.set_backward_replay = lambda *args: set_backward_replay(*args[:-1], _timed(args[-1], spent))
            _triton.clear_plans(forward=False)
    # A fused table's node runs the update through the fused_step registered with _C.
    has_fused_step = getattr(_extension._C, "set_fused_step", None) is not None
    if has_fused_step:
        _extension._C.set_fused_step(_timed(_autograd.fused_step, spent))
    try:
        for threads in (True, False):
            with torch.autograd.set_multithreading_enabled(threads):
                for name, fn in layers.items():
                    fn()  # its kernels compiled (dropout's, the optimizer's: a first call took ~15 ms at 1b594a4)
                    spent[:] = [0.0, 0]
                    us = min(host_only(fn) for _ in range(rounds))
                    inside = f", {spent[0] / spent[1] * 1e6:.1f} us of it in pyembed's Python backward" if spent[1] else ""
                    print(f"host 8x2048 fwd+bwd, GPU busy, autograd threads {'on' if threads else 'off'}: {name}: "
                          f"{us:.1f} us/call{inside}", flush=True)
    finally:
        _autograd._gradients = gradients
        if python_kernels is not None:
            _extension._C.set_python_kernels(*python_kernels)
        if set_backward_replay is not None:
            _extension._C.set_backward_replay = set_backward_replay
            _triton.clear_plans(forward=False)  # (the node's copies are timed)
        if has_fused_step:
            _extension._C.set_fused_step(_autograd.fused_step)
    for backend in backends:
        # The op (through the dispatcher) and, where the backend has one, the eager body
        # the autograd path calls (triton: its launches replayed from a plan after two calls;
        # cuda: the op's typed call, pyembed._C, without the boxed call's argument parsing).
        bodies = {"dense backward op": dispatch.get(backend).backward,
                  "dense backward, eager body": dispatch.get(backend).eager_backward}
        for name, op in bodies.items():
            if op is not None:
                us = min(host_only(lambda op=op: op(dout, ids, None, 0, GPT2[0], 2048, scale, None, False, True, True))
                         for _ in range(rounds))
                print(f"host 8x2048 GPU busy: {backend} {name}: {us:.1f} us/call", flush=True)
    if "triton" in backends:
        from pyembed.kernels import embedding as kernels

        keys = ids.reshape(-1).to(kernels.sort_key_dtype(GPT2[0]))
        us = min(host_only(lambda: keys.sort(stable=True)) for _ in range(rounds))
        print(f"host 8x2048 GPU busy: torch.sort of the {keys.dtype} keys (triton's backward without its tile sort): "
              f"{us:.1f} us/call",
              flush=True)


def pointer_arguments_cost(calls=400, rounds=5):
    """What Triton's launcher costs per pointer argument on this host: one compiled kernel
    of eight pointers launched as pyembed's replays launch (CompiledKernel.run), given
    tensors -- the launcher calls data_ptr() and cuPointerGetAttribute for each -- and given
    their addresses, what the replays pass since be1f9c5 (Inductor's static launcher passes
    addresses too). The GPU held busy; 400 launches stay inside the driver's queue."""
    import triton
    import triton.language as tl

    @triton.jit
    def _eight(p0, p1, p2, p3, p4, p5, p6, p7):
        tl.store(p0, tl.load(p1) + tl.load(p2) + tl.load(p3) + tl.load(p4) + tl.load(p5) + tl.load(p6) + tl.load(p7))

    buffers = [torch.zeros(16, device="cuda") for _ in range(8)]
    compiled = _eight[(1,)](*buffers)
    driver = triton.runtime.driver.active
    stream = driver.get_current_stream(driver.get_current_device())
    forms = {"tensors": buffers, "addresses": [t.data_ptr() for t in buffers]}

    def launch(args):
        compiled.run(1, 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)

    best = {name: min(host_us_gpu_busy(lambda a=args: launch(a), calls) for _ in range(rounds))
            for name, args in forms.items()}
    for name, us in best.items():
        print(f"host: a Triton launch of 8 pointers given {name}: {us:.2f} us/call", flush=True)
    print(f"host: per pointer given as a tensor, {(best['tensors'] - best['addresses']) / 8:.2f} us more", flush=True)


def python_profile(backends, top=22):
    """cProfile's view of the `triton` backend's host time, the GPU held by a sleep kernel so
    nothing waits for it: a one-token forward with a gradient (at d81f5b2 75 us on the
    H100's host against 44 us under no_grad, where the development VM shows ~6 us between
    them) and a GPT-2 8x2048 forward + backward run on the calling thread (526 us of host
    against `cuda`'s 183 us). Which Python functions hold the difference -- the VM cannot
    say: its tensors are on the CPU."""
    import cProfile
    import pstats

    if "triton" not in backends:
        return
    one_weight, one_pos, one_ids, _ = tensors(*GPT2, 1, 1, torch.float32)
    weight, pos_weight, ids, dout = tensors(*GPT2, 8, 2048, torch.float32)

    def forward_with_grad():
        pyembed.fused_embedding(one_ids, one_weight, one_pos, scale=2.0, backend="triton")

    def fwd_bwd():
        weight.grad = pos_weight.grad = None
        pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton").backward(dout)

    for name, fn, calls in (("1x1 forward with a gradient", forward_with_grad, 300),
                            ("8x2048 forward + backward, autograd threads off", fwd_bwd, 30)):
        with torch.autograd.set_multithreading_enabled(False):
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            torch.cuda._sleep(1_000_000_000)  # ~0.5 s: the host never waits for the GPU
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(calls):
                fn()
            profiler.disable()
        torch.cuda.synchronize()
        # Per call, in microseconds: print_stats' seconds in three decimals hid most of the
        # 8x2048 figures (1b594a4: "0.001" for 30 calls of a 33 us function).
        stats = pstats.Stats(profiler).stats  # {(file, line, function): (primitive, calls, own s, cumulative s, _)}
        print(f"== cProfile, triton {name}, {calls} calls: us per call, own / cumulative, by own time", flush=True)
        for (path, line, function), (_, count, own, cumulative, _) in sorted(
                stats.items(), key=lambda item: -item[1][2])[:top]:
            where = f"{os.path.basename(path)}:{line}({function})" if line else function
            print(f"{own / calls * 1e6:9.1f} {cumulative / calls * 1e6:9.1f}  x{count / calls:<5g} {where}", flush=True)


def host_cost_targets(backends, weight, ids, per_call, rounds=15):
    """Issue #29's host-cost targets, side by side in one process: a one-token lookup
    (default arguments, a table that wants a gradient, and under no_grad) against
    F.embedding's host cost (`cuda`: <= 1.3x) and a raw Triton launch's (`triton`: <= 2x);
    also the same raw kernel through pyembed's cached launcher, the floor of a `triton` launch;
    then #30's: a one-token forward + backward against eager nn ops' (<= 1x).
    The calls take turns, round after round, both grad modes in each round (at 82eabd8, the
    modes in turn and 5 rounds, F.embedding's best was 14.8 us with a gradient and 19.3 under
    no_grad: the machine drifts); each figure is its best round (~0.1 s a round)."""
    import triton
    import triton.language as tl

    from pyembed.kernels.launch import cached

    @triton.jit
    def _touch(x_ptr):  # one pointer, one store: the least a Triton launch can do
        tl.store(x_ptr, 1.0)

    scratch = torch.empty(1, device=weight.device)
    calls = {"F.embedding": lambda: torch.nn.functional.embedding(ids, weight),
             "raw Triton launch": lambda: _touch[(1,)](scratch),
             "raw launch, cached (kernels/launch.py)": lambda: cached(_touch)[(1,)](scratch)}
    calls.update({f"pyembed {b}": lambda b=b: pyembed.fused_embedding(ids, weight, backend=b) for b in backends})
    bests = {grad: dict.fromkeys(calls, float("inf")) for grad in (True, False)}
    for _ in range(rounds):
        for grad, best in bests.items():
            with torch.set_grad_enabled(grad):
                for name, fn in calls.items():
                    best[name] = min(best[name], per_call(fn))
    for grad, best in bests.items():
        mode = "with a gradient" if grad else "no_grad"
        for name, us in best.items():
            print(f"host 1x1 target ({mode}) {name}: {us:.1f} us/call", flush=True)
        for backend, base, target in (("cuda", "F.embedding", 1.3), ("triton", "raw Triton launch", 2.0)):
            if f"pyembed {backend}" in best:
                ratio = best[f"pyembed {backend}"] / best[base]
                print(f"host 1x1 target ({mode}) {backend}: {ratio:.2f}x {base} (target <= {target}x: "
                      f"{'met' if ratio <= target else 'NOT met'})", flush=True)
    # Issue #30: a one-token forward + backward no slower than eager nn ops' (wall clock, GPU
    # work included: each writes the table's whole dense gradient; eager's embedding backward
    # also reads a count back to the host).
    pos_weight = torch.randn(1024, weight.shape[1], device=weight.device, requires_grad=True)
    dout = torch.ones(1, 1, weight.shape[1], device=weight.device)

    def fwd_bwd(layer):
        def run():
            layer().backward(dout)
            weight.grad = pos_weight.grad = None
        return run
    steps = {"eager nn ops": fwd_bwd(lambda: torch.nn.functional.embedding(ids, weight) * 2.0 + pos_weight[:1])}
    steps.update({f"pyembed {b}": fwd_bwd(lambda b=b: pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0,
                                                                             backend=b)) for b in backends})
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for name, fn in steps.items():
            best[name] = min(best[name], per_call(fn))
    for name, us in best.items():
        print(f"host 1x1 fwd+bwd target {name}: {us:.1f} us/call", flush=True)
    for backend in backends:
        ratio = best[f"pyembed {backend}"] / best["eager nn ops"]
        print(f"host 1x1 fwd+bwd target {backend}: {ratio:.2f}x eager nn ops (target <= 1.0x: "
              f"{'met' if ratio <= 1.0 else 'NOT met'})", flush=True)


def ncu_kernels(backends):
    for dtype in (torch.float32, torch.bfloat16):
        weight, pos_weight, ids, _ = tensors(32000, 4096, 8, 2048, dtype)
        for backend in backends:
            with torch.no_grad():
                pyembed.fused_embedding(ids, weight, pos_weight, scale=64.0, validate=False, backend=backend)
    # GPT-2 bf16: cuda's forward furthest from a copy at 26f0ba6 (77% of a graphed copy in
    # its four-row blocks, triton's 98%), each backend's default form.
    weight, pos_weight, ids, _ = tensors(*GPT2, 8, 2048, torch.bfloat16)
    for backend in backends:
        with torch.no_grad():
            pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, validate=False, backend=backend)
    weight, pos_weight, ids, dout = tensors(*GPT2, 8, 2048, torch.float32)
    ids[:, :1500] = 17  # a hot row: the chunk kernel's long-segment pieces run too
    for backend in backends:  # the backward's kernels: the sort's, chunks, the table's rows, batch sum
        dispatch.get(backend).backward(dout, ids, None, 0, GPT2[0], pos_weight.shape[0], 2.0, None, False, True, True)
    for backend in backends:  # a one-token backward: the few-token kernel writes the whole table alone
        dispatch.get(backend).backward(dout[:1, :1], ids[:1, :1], None, 0, GPT2[0], pos_weight.shape[0], 2.0, None,
                                       False, True, True)
    # Llama-3 bf16, uniform ids: a 1 GB table mostly of zeros. At de2aee7 `triton`'s op took 565
    # us here against `cuda`'s 403 and the one-token kernel's 246 for the same table; since,
    # both write its zeros with streaming stores (MemoryWorkloadAnalysis: L2's hit rate).
    weight, pos_weight, ids, dout = tensors(*LLAMA3, 8, 2048, torch.bfloat16)
    del weight
    for backend in backends:
        dispatch.get(backend).backward(dout, ids, None, 0, LLAMA3[0], pos_weight.shape[0], 64.0, None, False, True,
                                       True)
    if "triton" in backends:  # and triton's with one tile a program (ROW_TILES): the zero branch alone
        from pyembed import _triton

        os.environ[ROW_TILES] = "1"
        _triton.clear_plans(forward=False)
        dispatch.get("triton").backward(dout, ids, None, 0, LLAMA3[0], pos_weight.shape[0], 64.0, None, False, True,
                                        True)
        del os.environ[ROW_TILES]
        _triton.clear_plans(forward=False)
    # The optimizer inside the backward: AdamW over every row of a Llama-2 bf16 table (p, m
    # and v each read and written once), 2048 rows with a gradient.
    table = torch.randn(32000, 4096, device="cuda", dtype=torch.bfloat16)
    rows = torch.randperm(32000, device="cuda")[:2048].sort().values
    values = torch.randn(2048, 4096, device="cuda", dtype=torch.bfloat16)
    adamw = [1e-3, 0.9, 0.999, 1e-8, 0.01, 1.0, 0.0, 0.1, 0.03]  # csrc/optim.h's Adam order: decoupled, not maximize
    for backend in backends:
        update = dispatch.get(backend).optimizer_update
        if update is not None:
            update(table, torch.zeros_like(table), torch.zeros_like(table), rows, values, 1, adamw, True)
    # The same update inside a dense backward (optimizer_backward: each row's segment summed
    # in the update's kernel), 8x2048 tokens over that table: sort, chunks, segment_update.
    ids = torch.randint(0, 32000, (8, 2048), device="cuda")
    dout = torch.randn(8, 2048, 4096, device="cuda", dtype=torch.bfloat16)
    for backend in backends:
        fused = dispatch.get(backend).optimizer_backward
        if fused is not None:
            fused(dout, ids, 64.0, None, False, None, 0.0, table, torch.zeros_like(table), torch.zeros_like(table), 1,
                  adamw, True)
    torch.cuda.synchronize()


def step_profile(backends, batch=8, seq_len=2048):
    """Where an AdamW training step's GPU time goes, GPT-2 fp32 8x2048: torch's fused AdamW
    after pyembed's dense backward, and AdamW inside pyembed's backward. The H100 run at
    664ac49 measured the latter slower at this shape (1.38 against 0.68 ms, `cuda`; faster
    at 1 token and on Llama tables), though it moves fewer bytes."""
    for backend in backends:
        for in_backward in (False, True):
            weight, pos_weight, ids, dout = tensors(*GPT2, batch, seq_len, torch.float32)
            weight, pos_weight = torch.nn.Parameter(weight.detach()), torch.nn.Parameter(pos_weight.detach())
            if in_backward:
                pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [weight, pos_weight], {"lr": 1e-4})
                optimizer = None
            else:
                optimizer = torch.optim.AdamW([weight, pos_weight], lr=1e-4, fused=True)

            def step():
                pyembed.fused_embedding(ids, weight, pos_weight, scale=GPT2[1] ** 0.5, backend=backend).backward(dout)
                if optimizer is not None:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)

            name = f"{batch}x{seq_len} {backend} AdamW step, " + ("inside the backward" if in_backward else
                                                                 "torch's fused=True after the backward")
            print(f"{name}: {triton.testing.do_bench(step, return_mode='median') * 1e3:.1f} us", flush=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            print(f"\n== {name}, x5, by cuda_time_total")
            print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


def sparse_step_profile(backends, batch=8, seq_len=2048):
    """A sparse training step, GPT-2 fp32 8x2048 with learned positions: SparseAdam on the
    token table, torch's fused AdamW on the positions, as the benchmark's sparse `step`
    cases. At 26f0ba6 the H200 took 1.34 ms with nn ops (whose gradient SparseAdam
    coalesces), 1.44 with pyembed `cuda` (coalesced by its backward) and 2.08 with that
    layer compiled, whose .grad then lost its coalesced flag (kept since): the sort and the
    host syncs of each, and whether .grad reached SparseAdam flagged coalesced."""
    def nn_layer(ids, weight, pos_weight):
        return torch.nn.functional.embedding(ids, weight, sparse=True) * GPT2[1] ** 0.5 + pos_weight[:ids.shape[1]]

    def pyembed_layer(backend):
        def layer(ids, weight, pos_weight):
            return pyembed.fused_embedding(ids, weight, pos_weight, scale=GPT2[1] ** 0.5, sparse=True, backend=backend)
        return layer

    variants = [("nn ops", nn_layer)]
    for backend in backends:
        variants += [(f"pyembed-{backend}", pyembed_layer(backend)),
                     (f"compile(pyembed-{backend})", torch.compile(pyembed_layer(backend), fullgraph=True))]
    for name, layer in variants:
        weight, pos_weight, ids, dout = tensors(*GPT2, batch, seq_len, torch.float32)
        weight, pos_weight = torch.nn.Parameter(weight.detach()), torch.nn.Parameter(pos_weight.detach())
        optimizers = (torch.optim.SparseAdam([weight], lr=1e-4), torch.optim.AdamW([pos_weight], lr=1e-4, fused=True))
        flagged = []

        def step():
            layer(ids, weight, pos_weight).backward(dout)
            flagged.append(weight.grad.is_coalesced())
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

        label = f"{batch}x{seq_len} sparse SparseAdam step, {name}"
        print(f"{label}: {triton.testing.do_bench(step, return_mode='median') * 1e3:.1f} us; .grad flagged "
              f"coalesced in {sum(flagged)} of {len(flagged)} steps", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        events = prof.key_averages()
        syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize"))
        print(f"\n== {label}, x5, by cuda_time_total ({syncs} stream/device syncs)")
        print(events.table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


# `triton`'s finish_segments: tiles of rows a program (kernels' finish_row_tiles; by
# default 4 for a 2-byte table of 2^16 rows or more, else 1), by the variable that
# overrides it when a call is planned; the zero-fill case sets it to 1 (one tile, the zero
# branch alone). A program with nothing to sum stores its rows' zeros after one bounds
# load: at Llama-3 bf16 (1b594a4, one tile, before the zero branch) the kernel ran at 48%
# of DRAM, 32 bytes a thread per load. (Its values 1, 2 and 4 were timed until 82eabd8:
# the default within noise.)
ROW_TILES = "PYEMBED_TRITON_ROW_TILES"
# `triton`'s finish_segments: the loop summing a segment's rows as written (1) or pipelined
# (kernels' finish_sum_stages: by default 3 in a 2-byte table's four-tile programs, else 1).
# Row by row it is two dependent loads a row, and a tile takes as long as its longest
# segment: Zipf ids (rows of 100-128 uses at GPT-2) cost 193 against 106 us uniform at
# 1b594a4. Pipelined, ~one round trip a row, for more registers in every tile (fp32 92 ->
# 101 at two stages, sm_90): timed with both. (Two stages, timed at 26f0ba6 and 82eabd8, were
# never faster than the better of one and three beyond noise: left out since.)
SUM_STAGES = ("PYEMBED_TRITON_SUM_STAGES", ("1", "3"))
# `cuda`'s finish_segments where the position blocks write the one-token rows (learned
# positions over every token, as in these cases): finish_segments_kernel ("off", the
# default) against finish_segments_solo_kernel at 4, 8 and 16 rows a thread group, whose
# groups load two bounds a row and store their untouched rows' zeros, and at 8 with the
# position blocks last, as `triton` orders them. At 82eabd8 the default ran Llama-3 bf16 at
# 60% of DRAM bandwidth; `triton`'s, sixteen rows' bounds a program there, at 72%.
FINISH_GROUP = ("PYEMBED_CUDA_FINISH_GROUP", ("off", "4", "8", "16", "8-last"))


def sort_comparison(backends, batch=8, seq_len=2048, calls=40):
    """The dense backward op at GPT-2 and Llama-3 8x2048 (fp32, bf16, learned positions),
    per GPU backend with its tile sort: GPU time (do_bench, and a CUDA graph's replay: the
    kernels alone), host time with the GPU held by a sleep kernel, GPU ops per call. At
    79bdffb (H200) CUB's sort was 7 of `cuda`'s 10 GPU ops, ~23 us; torch's, 7 of `triton`'s
    10 (its host time 41 us). Then the table's zeros alone (zero_fill_case), `triton`'s with
    each of SUM_STAGES' settings and `cuda`'s with each of FINISH_GROUP's (uniform and Zipf
    ids). (Timed until 82eabd8 and left out since, settled -- docs/bench-h200/82eabd8/profile.log:
    the library sorts, CUB's (PYEMBED_CUDA_SORT=cub) and torch's (PYEMBED_TRITON_TILE_SORT=0),
    and `cuda`'s one-block sort, slower than the tile sorts in every case (since removed);
    ROW_TILES' settings, the defaults within noise; `triton`'s tile merge without its
    maxnreg, the same; `cuda`'s first pass over spread rows (PYEMBED_CUDA_FINISH_ROWS), no
    faster anywhere.)"""
    for backend in ("cuda", "triton"):
        if backend not in backends:
            continue
        for table in (GPT2, LLAMA3):
            for dtype in (torch.float32, torch.bfloat16):
                sort_case(backend, "tile sort", table, dtype, batch, seq_len, calls)
        # Rows used more than a chunk's 128 times, which real text always has: the chunk
        # kernels' pieces (at e204d9e ~61-64 us each with a 12000-use row, ncu; since loaded
        # several rows ahead of their adds).
        for dist in ("zipf", "onehot"):
            sort_case(backend, "tile sort", GPT2, torch.float32, batch, seq_len, calls, dist)
    for table in (GPT2, LLAMA3):
        for dtype in (torch.float32, torch.bfloat16):
            zero_fill_case(table, dtype)
    zipf_cases = [(table, dtype, dist) for table, dtype in ((GPT2, torch.float32), (GPT2, torch.bfloat16),
                                                           (LLAMA3, torch.bfloat16)) for dist in ("uniform", "zipf")]
    if "triton" in backends:  # its rows' loop, pipelined or not
        setting_cases("triton", SUM_STAGES, "sum stages", zipf_cases, batch, seq_len, calls)
    if "cuda" in backends:
        group_cases = [(table, dtype, dist) for table, dtype in ((GPT2, torch.float32), (LLAMA3, torch.bfloat16))
                       for dist in ("uniform", "zipf")]
        setting_cases("cuda", FINISH_GROUP, "finish group", group_cases, batch, seq_len, calls)


def setting_cases(backend, setting, label, cases, batch, seq_len, calls):
    """``backend``'s dense backward op at each of ``setting``'s values ((variable, values)),
    over ``cases`` ((table, dtype, ids' distribution)); `triton`'s planned afresh at each (a
    plan replays the launch it was bound with)."""
    from pyembed import _triton

    variable, values = setting
    for value in values:
        os.environ[variable] = value
        _triton.clear_plans(forward=False)
        for table, dtype, dist in cases:
            sort_case(backend, f"tile sort, {value} {label}", table, dtype, batch, seq_len, calls, dist)
    del os.environ[variable]


def zero_fill_case(table, dtype):
    """The dense gradient's table written with zeros alone (Tensor.zero_, a memset), graphed:
    the least time a kernel writing that table can take. At 82eabd8 (H200, ncu) `cuda`'s
    finish_segments wrote Llama-3 bf16's -- 88% of its rows zeros -- at 60% of DRAM
    bandwidth (414 us), `triton`'s at 72% (345): this says how far from writing speed."""
    grad = torch.empty(table, device="cuda", dtype=dtype)
    graphed = triton.testing.do_bench_cudagraph(grad.zero_, return_mode="median")
    gbps = grad.numel() * grad.element_size() / (graphed * 1e-3) / 1e9
    print(f"the gradient table's zeros alone (zero_, a memset): {table[0]}x{table[1]} {str(dtype)[6:]}: "
          f"graphed {graphed * 1e3:.1f} us, {gbps:.0f} GB/s", flush=True)


def sort_case(backend, which, table, dtype, batch, seq_len, calls, dist="uniform"):
    weight, pos_weight, ids, dout = tensors(*table, batch, seq_len, dtype)
    num_positions, (vocab, dim) = pos_weight.shape[0], table
    del weight, pos_weight
    if dist != "uniform":
        from bench.cases import SHAPES, Case, make_ids

        shape = next(name for name, value in SHAPES.items() if value == table)
        ids = make_ids(Case(shape, batch, seq_len, "bwd", dist=dist), ids.device, torch.Generator().manual_seed(0))
    op = dispatch.get(backend).backward

    def call():
        return op(dout, ids, None, 0, vocab, num_positions, dim ** 0.5, None, False, True, True)

    wall = triton.testing.do_bench(call, return_mode="median")
    graphed = triton.testing.do_bench_cudagraph(call, return_mode="median")
    host = host_us_gpu_busy(call, calls)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    ops = sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA)
    print(backward_op_line(which, backend, (vocab, dim), dtype, batch, seq_len, dist, wall, graphed, host, ops),
          flush=True)


def backward_op_line(which, backend, table, dtype, batch, seq_len, dist, wall_ms, graphed_ms, host_us, ops):
    """sort_case's line, which python -m bench.targets reads (setting_comparisons): ``which``
    the sort, or "tile sort, VALUE LABEL" for setting_cases' VALUE of a setting."""
    return (f"sort {which}: the `{backend}` dense backward op, {table[0]}x{table[1]} {str(dtype)[6:]} "
            f"{batch}x{seq_len}{'' if dist == 'uniform' else ', ' + dist + ' ids'}: {wall_ms * 1e3:.1f} us, "
            f"graphed {graphed_ms * 1e3:.1f} us, host {host_us:.1f} us (GPU busy), {ops} GPU ops")


def forward_comparison(backends, batch=8, seq_len=2048):
    """The forward op at GPT-2 and Llama-3 8x2048 (fp32, bf16, learned positions -- and bf16
    with the sinusoid --, the default in-kernel range check): each GPU backend's kernel
    against a copy of its output's bytes
    (the rows it reads and writes; the positional rows come from L2) -- GPU time by do_bench
    and by a CUDA graph's replay (the kernel alone). At 1b594a4 (H200) the one-token kernel
    reached 84% of copy bandwidth at Llama-3 bf16 and `triton`'s 92% (ncu). (`cuda`'s rows a
    block, PYEMBED_CUDA_FORWARD_ROWS=1|4, timed until 82eabd8: the default, four where a row
    is at most 8 KB, the faster in every case at 26f0ba6 and 82eabd8; the variable is gone.)"""
    from pyembed import checks

    runs = [backend for backend in ("cuda", "triton") if backend in backends]
    # bf16 with the sinusoid too: its sine and cosine by the SFU since 26f0ba6, where
    # the Llama-2 bf16 sinusoidal forward ran at 65% of a copy (`cuda`), 0.79x `cuda` (`triton`).
    sinusoid = [(backend, "sinusoidal") for backend in ("cuda", "triton") if backend in backends]
    for table in (GPT2, LLAMA3):
        for dtype in (torch.float32, torch.bfloat16):
            weight, pos_weight, ids, _ = tensors(*table, batch, seq_len, dtype)
            weight, pos_weight = weight.detach(), pos_weight.detach()
            record = checks.error_record_address(weight.device)
            out = torch.empty(batch, seq_len, table[1], device="cuda", dtype=dtype)
            copy = torch.empty_like(out)
            copy_graphed = triton.testing.do_bench_cudagraph(lambda: copy.copy_(out), return_mode="median")
            for backend, encoding in [(b, "learned") for b in runs] + (sinusoid if dtype == torch.bfloat16 else []):
                op = dispatch.get(backend).forward
                table_pe = pos_weight if encoding == "learned" else None

                def call():
                    return op(ids, weight, table_pe, None, encoding, table[1] ** 0.5, 0, None, 0.0, 0, 0, record)

                which = "sinusoid" if encoding == "sinusoidal" else "its kernel"
                case = f"the `{backend}` forward op, {table[0]}x{table[1]} {str(dtype)[6:]} {batch}x{seq_len}"
                try:  # new in this profile: a failure is reported here, and the profile goes on
                    wall = triton.testing.do_bench(call, return_mode="median")
                    graphed = triton.testing.do_bench_cudagraph(call, return_mode="median")
                    print(f"forward {which}: {case}: {wall * 1e3:.1f} us, graphed {graphed * 1e3:.1f} us, "
                          f"{100 * copy_graphed / graphed:.0f}% of a graphed copy", flush=True)
                except Exception as error:
                    print(f"forward {which}: {case}: FAILED {type(error).__name__}: {error}", flush=True)
    checks.check_errors("cuda")


def gpu_timeline(events: list, marker: str) -> list[list[str]]:
    """For each call marked ``marker`` (a record_function) among a Chrome trace's events from
    torch.profiler, the lines telling its GPU side: its host time, the GPU's busy time, when
    its last GPU work ended, then each kernel or memset in order -- its start and length
    from the call's start, and when and from which CPU op the host launched it. A GPU idle
    before work launched late is host time the GPU waited for."""
    gpu_kinds = ("kernel", "gpu_memset", "gpu_memcpy")
    launches = {e["args"]["correlation"]: e for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    blocks = []
    for call in sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"] == marker),
                       key=lambda e: e["ts"]):
        t0, t1 = call["ts"], call["ts"] + call["dur"]
        work = sorted((e for e in events if e.get("cat") in gpu_kinds
                       and t0 <= launches.get(e["args"].get("correlation"), {"ts": -1})["ts"] <= t1),
                      key=lambda e: e["ts"])
        lines = [f"{marker}: host {call['dur']:.0f} us"]
        blocks.append(lines)
        if not work:
            lines[0] += ", no GPU work found"
            continue
        busy, covered = 0.0, t0
        for e in work:  # the union of the intervals: kernels of one stream do not overlap, but be safe
            start, end = max(e["ts"], covered), e["ts"] + e["dur"]
            busy, covered = busy + max(0.0, end - start), max(covered, end)
        lines[0] += (f", GPU busy {busy:.0f} us, its last work ends at +{covered - t0:.0f} us "
                     f"(the GPU idle {covered - t0 - busy:.0f} us of it)")
        for e in work:
            launch = launches[e["args"]["correlation"]]
            by = [o for o in ops if o["tid"] == launch["tid"] and o["ts"] <= launch["ts"] <= o["ts"] + o["dur"]]
            by = min(by, key=lambda o: o["dur"])["name"] if by else "-"
            lines.append(f"  {e['ts'] - t0:+8.0f} {e['dur']:6.0f} us  {e['name'][:56]:56}  launched at "
                         f"+{launch['ts'] - t0:.0f} by {by[:40]}")
    return blocks


def _timeline(label: str, fn, calls: int = 3) -> None:
    """Print do_bench's median of ``fn``, then the GPU timeline (gpu_timeline) of the last
    of ``calls`` profiled calls, each started on an idle GPU (synchronized before), as
    after do_bench's L2 flush."""
    import json
    import tempfile

    median = triton.testing.do_bench(fn, return_mode="median") * 1e3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            torch.cuda.synchronize()
            with torch.profiler.record_function(label):
                fn()
            torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = json.load(f)["traceEvents"]
    print(f"\n== timeline: {label}, do_bench median {median:.0f} us", flush=True)
    print("\n".join(gpu_timeline(events, label)[-1]), flush=True)  # the last, warmest call


def compiled_timeline(backends, batch=8, seq_len=2048):
    """Eager and compiled pyembed's forward + backward on the GPU's timeline, Llama-3
    8x2048, fp32 and bf16, autograd's device thread on (as the benchmark runs): at 26f0ba6
    (H200) compiled `cuda` took 905 us at bf16 against eager's 575, though both do the
    same 568 us of GPU work (graph replay) -- while at fp32 both took ~800 us, their GPU
    time. As if the compiled call's ~330 us of host time (compiled-host-threads.log, GPT-2)
    were added to its GPU time at bf16 alone: this shows where the GPU waits."""
    for dtype in (torch.float32, torch.bfloat16):
        weight, pos_weight, ids, dout = tensors(*LLAMA3, batch, seq_len, dtype)
        scale = LLAMA3[1] ** 0.5
        for backend in backends:
            def layer(ids, weight, pos_weight, backend=backend):
                return pyembed.fused_embedding(ids, weight, pos_weight, scale=scale, backend=backend)

            torch._dynamo.reset()
            for name, fwd in ((f"pyembed-{backend}", layer), (f"compile(pyembed-{backend})", torch.compile(layer))):
                def fwd_bwd(fwd=fwd):
                    weight.grad = pos_weight.grad = None
                    fwd(ids, weight, pos_weight).backward(dout)

                _timeline(f"{name} {str(dtype)[6:]} {batch}x{seq_len} fwd+bwd", fwd_bwd)


def step_timeline(backend: str, device: str = "cuda"):
    """The benchmark's own GPT-2 8x2048 training steps (bench.run.step_fn: forward,
    backward, fused AdamW, zero_grad) on the GPU's timeline, with learned and with
    sinusoidal positions, for compiled nn ops and eager and compiled pyembed: at 26f0ba6
    (H200) each compiled provider's sinusoidal step took ~400 us more than its learned one
    (compile 948 against 522 us, compiled `cuda` 1014 against 600), while the eager ones did
    not (`cuda` 606 against 569, eager nn ops 915 against 979)."""
    from bench import run
    from bench.cases import Case
    from bench.providers import providers

    device = torch.device(device)
    names = ("compile", f"pyembed-{backend}", f"compile(pyembed-{backend})")
    chosen = [p for p in providers(device) if p.name in names]
    for pos in ("learned", "sinusoidal"):
        case = Case("gpt2", 8, 2048, "step", pos=pos)
        shared, ids, dout = run.case_inputs(case, device)
        for provider in chosen:
            if provider.reset is not None:
                provider.reset()
            _timeline(f"{provider.name} {case.label()}", run.step_fn(provider, case, ids, run.own_copy(shared), dout))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ncu", action="store_true", help="one forward per backend and dtype and one backward, for ncu")
    ap.add_argument("--timeline", action="store_true", help="only eager and compiled pyembed's forward + backward, "
                                                            "and training steps, on the GPU's timeline "
                                                            "(compiled_timeline, step_timeline)")
    ap.add_argument("--sort", action="store_true", help="only the dense backward ops' times, then at each "
                                                        "setting's values (sort_comparison)")
    args = ap.parse_args()
    backends = [b for b in dispatch.backends_for("cuda") if b != "reference"]
    if args.ncu:
        ncu_kernels(backends)
    elif args.sort:
        sort_comparison(backends)
    elif args.timeline:
        compiled_timeline(backends)
        step_timeline("cuda" if "cuda" in backends else backends[0])
    else:
        forward_comparison(backends)
        sort_comparison(backends)
        host_costs(backends)
        host_only_costs(backends)
        if "triton" in backends:
            pointer_arguments_cost()
        python_profile(backends)
        profile(backends, [(8, 2048), (1, 1)])
        step_profile(backends)
        sparse_step_profile(backends)


if __name__ == "__main__":
    main()
