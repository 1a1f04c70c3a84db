"""The benchmark harness runs end to end on a tiny shape: every provider passes its
correctness gate, and the CSV has the documented columns."""

import csv
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import pyembed

from bench import report, run
from bench.cases import Case, suite
from bench.providers import Provider, eager_input_layer, providers


def test_quick_suite_writes_csv_table_and_plots(tmp_path, capsys):
    # In one process: a fresh one per case (the CPU default) costs each case a torch import
    # and cold compiles (this test 93 -> 63 s on the development VM); the next test runs a
    # case that way.
    rows = run.main(["--quick", "--out", str(tmp_path), "--budget", "0.05", "--min-reps", "3", "--no-isolate"])
    with (tmp_path / "results.csv").open() as f:
        reader = csv.DictReader(f)
        assert reader.fieldnames == report.COLUMNS
        written = list(reader)
    assert len(written) == len(rows) > 0
    for row in written:
        no_sparse = row["provider"] == "liger" and row["grad"] == "sparse"  # torch.compile traces nn's sparse one
        step_only = row["provider"].endswith("-fused") and row["mode"] != "step"  # the optimizer in the backward
        if no_sparse or step_only:
            assert row["status"] == "n/a"
        else:
            assert row["status"] == "ok", row
            assert float(row["median_ms"]) > 0 and float(row["pct_of_copy"]) > 0
    assert {r["provider"] for r in written} >= {"eager", "compile"} | (
        {"pyembed-cpu-fused"} if "cpu" in pyembed.available_backends() else set())
    assert sorted(p.name for p in tmp_path.glob("*.png")) == [
        "bench_bwd.png", "bench_fwd.png", "bench_fwd_bwd.png", "bench_step.png"]
    out = capsys.readouterr().out
    assert "| tiny 2x16 fwd |" in out and "| tiny 2x16 step |" in out
    for mode in ("fwd", "bwd", "fwd+bwd", "step"):  # the summary: one geometric mean per mode and provider
        assert any(line.startswith(f"{mode:8s} pyembed-") and "the faster of eager/compile" in line
                   for line in out.splitlines()), mode
    # The CSV alone gives back this run's table (python -m bench.report, for a GPU machine's CSV).
    names = list(dict.fromkeys(r["provider"] for r in rows))
    table = (tmp_path / "results.md").read_text()
    assert table.startswith(report.markdown(rows, names))
    assert report.markdown(report.load_csv(tmp_path / "results.csv"), names) == report.markdown(rows, names)


def test_the_summary_is_the_geometric_mean_against_the_faster_baseline():
    # Each case counts its speed-up over the faster of eager and compile (the smaller ratio);
    # a compiled pyembed provider counts compile only. One case is named, not "averaged".
    def row(label, provider, eager, compile_):
        return {"mode": "fwd", "label": label, "provider": provider, "median_ms": 1.0,
                "speedup_vs_eager": eager, "speedup_vs_compile": compile_}
    rows = [row("a", "pyembed-cpu", 2.0, 4.0), row("b", "pyembed-cpu", 9.0, 8.0),
            row("a", "compile(pyembed-cpu)", None, 3.0)]
    assert report.summary(rows) == [
        f"fwd      pyembed-cpu: {math.sqrt(2.0 * 8.0):.2f}x the faster of eager/compile "
        "(geometric mean of 2 cases; lowest 2.00x, a)",
        "fwd      compile(pyembed-cpu): 3.00x compiled nn ops (one case, a)"]


def test_a_time_limit_leaves_out_the_cases_that_would_pass_it_and_names_them(tmp_path):
    # One GPU call has 10 minutes: --time-limit starts a case only while the run, as its
    # cases have taken so far, ends within the limit. With none left, the first case runs
    # (there is nothing to go by), the rest are named in the table; plots and CSV as usual.
    rows = run.main(["--quick", "--out", str(tmp_path), "--budget", "0.05", "--min-reps", "3", "--time-limit", "0"])
    cases = suite("quick")
    assert {r["label"] for r in rows} == {cases[0].label()}
    assert {r["label"] for r in report.load_csv(tmp_path / "results.csv")} == {cases[0].label()}
    table = (tmp_path / "results.md").read_text()
    assert table.rstrip().splitlines()[-1] == (f"{len(cases) - 1} of {len(cases)} cases left out by --time-limit 0 s: "
                                               + "; ".join(c.label() for c in cases[1:]))
    assert (tmp_path / "bench_fwd.png").exists()


def test_filters_that_select_nothing_say_so_and_run_nothing(tmp_path):
    # A misspelt provider, or filters no case of the suite meets, stop the run with what
    # this device has, before anything is timed or written (they ran every case with no
    # provider, or none, and wrote empty tables).
    with pytest.raises(SystemExit, match=r"no provider 'pyembed-cdua' on cpu; this device's: eager, compile, .*"):
        run.main(["--quick", "--provider", "pyembed-cdua", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no case of the main suite matches the filters given; llama3 runs on a GPU"):
        run.main(["--shape", "llama3", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no case of the quick suite matches"):
        run.main(["--quick", "--label", "no such case", "--out", str(tmp_path)])
    assert not (tmp_path / "results.csv").exists()


def test_the_gpu_suite_runs_the_issues_targets_first():
    # What a time-limited GPU call measures first: the 8x2048 forward and forward + backward
    # at GPT-2 and Llama-3 (fp32, bf16, learned positions), then those tables' one-token calls.
    cases = suite("gpu")
    first = {(c.shape, c.batch, c.seq_len, c.mode, c.dtype, c.pos, c.grad, c.dropout) for c in cases[:8]}
    assert first == {(s, 8, 2048, m, d, "learned", "dense", 0.0) for s in ("gpt2", "llama3")
                     for m in ("fwd", "fwd+bwd") for d in ("fp32", "bf16")}
    assert all((c.batch, c.seq_len, c.pos) == (1, 1, "learned") and c.mode != "step" for c in cases[8:16])
    assert len(cases) == len(set(cases)) == 76  # the same cases as before the order


def test_backward_on_the_calling_thread_is_run_and_recorded(tmp_path, monkeypatch):
    """--no-autograd-threads: each case runs with autograd's engine threads off (in the
    worker process too), and the rows say so; the flag's default leaves them on."""
    seen = []
    real_run_case = run.run_case

    def recording(case, device, provs, args):
        seen.append(torch._C._is_multithreading_enabled())
        return real_run_case(case, device, provs, args)

    monkeypatch.setattr(run, "run_case", recording)
    common = ["--quick", "--no-isolate", "--mode", "fwd+bwd", "--provider", "eager", "--budget", "0.05",
              "--min-reps", "3", "--out", str(tmp_path)]
    try:
        off = run.main(common + ["--no-autograd-threads"])
    finally:
        torch.autograd.set_multithreading_enabled(True)
    on = run.main(common)
    assert seen == [False] * len(off) + [True] * len(on) and off and on
    assert all(r["device"].endswith("(backward on the calling thread)") and r["status"] == "ok" for r in off)
    assert not any("calling thread" in r["device"] for r in on)


def test_compiled_provider_never_falls_back_to_eager():
    # With one compiled function across cases, Dynamo stops compiling at its recompile
    # limit and the "compile" column silently becomes eager. Every case compiles afresh:
    # with a limit of 1, two cases of different dtypes both compile a frame.
    from torch._dynamo.utils import counters

    args = run.parse_args(["--budget", "0.01", "--min-reps", "2"])
    provider = [p for p in providers(torch.device("cpu")) if p.name == "compile"]
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype in ("fp32", "bf16"):
            counters.clear()
            rows = run.run_case(Case("tiny", 2, 16, "fwd", dtype=dtype), torch.device("cpu"), provider, args)
            assert rows[0]["status"] == "ok"
            assert counters["frames"]["ok"] >= 1, (dtype, dict(counters["frames"]))


def test_gate_reports_a_dropout_whose_backward_ignores_the_mask(tmp_path):
    case = Case("tiny", 2, 16, "fwd+bwd", dropout=0.25)

    def unmasked_backward(ids, tables, scale, sparse, dropout):
        out = eager_input_layer(ids, tables, scale, sparse)
        return out + (torch.nn.functional.dropout(out.detach(), dropout) - out.detach())  # gradient not masked

    args = run.parse_args(["--budget", "0.01", "--min-reps", "2"])
    good, bad = run.run_case(case, torch.device("cpu"), [Provider("eager", eager_input_layer),
                                                          Provider("unmasked", unmasked_backward)], args)
    assert good["status"] == "ok", good["note"]
    assert bad["status"] == "FAILED" and "weight grad differs" in bad["note"]


def test_gate_reports_a_wrong_provider_as_failed(tmp_path):
    case = Case("tiny", 2, 16, "fwd")
    wrong = Provider("off-by-scale", lambda ids, tables, scale, sparse, dropout: eager_input_layer(ids, tables, scale * 1.01, sparse))
    args = run.parse_args(["--budget", "0.01", "--min-reps", "2"])
    rows = run.run_case(case, torch.device("cpu"), [wrong], args)
    assert rows[0]["status"] == "FAILED" and "output differs" in rows[0]["note"]
    assert "median_ms" not in rows[0]


def test_triton_host_timing_runs_without_a_gpu():
    # python -m bench.triton_host: Triton's compiled path with a stand-in driver (it refuses
    # the interpreter, which this suite sets), one short round of every call it times.
    pytest.importorskip("triton", reason="triton is not installed")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    # The checkout after what PYTHONPATH holds, and this directory kept (python -m puts it
    # first): make gpu-check runs the suite from a staged build, which the source must not hide.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(root)]))
    proc = subprocess.run([sys.executable, "-m", "bench.triton_host", "--rounds", "1", "--number", "5"],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("host time per call, Triton")
    assert [line.split("  ")[0] for line in lines[1:]] == [
        "raw Triton launch", "raw launch, cached", "F.embedding (CPU)", "triton 1x1 fwd, no grad",
        "triton 1x1 fwd, no grad, first call", "triton 1x1 fwd", "triton 1x1 fwd, position_ids",
        "triton 1x1 fwd+bwd", "triton 1x1 fwd+bwd, dropout", "triton 8x2048 dense backward",
        "8x2048 backward, cached launches", "triton 1x1 fused AdamW step", "triton 8x2048 fused AdamW step"]


def test_gpu_timings_take_turns_and_summarise_every_rounds_samples(monkeypatch):
    # On a GPU the providers of a case are timed in rounds, in a rotating order (a drift in
    # the machine's speed then slows them all alike), and each row's quantiles are over the
    # samples of every round, not of one do_bench call.
    pytest.importorskip("triton", reason="triton is not installed")
    import triton.testing

    order, warmups = [], []
    rounds = {"copy": [[1.0, 1.0]] * run.GPU_ROUNDS, "pyembed": [[8.0, 10.0], [2.0], [6.0], [4.0]]}

    def bench(fn, warmup, rep, return_mode):
        name = fn()
        order.append(name)
        warmups.append(warmup)
        assert rep == run.GPU_ROUND_MS and return_mode == "all"
        return list(rounds[name][order.count(name) - 1])

    monkeypatch.setattr(triton.testing, "do_bench", bench)
    assert run.GPU_ROUNDS == 4
    timings = run.time_gpu({"copy": lambda: "copy", "pyembed": lambda: "pyembed"})
    assert order == ["copy", "pyembed", "pyembed", "copy", "copy", "pyembed", "pyembed", "copy"]
    assert warmups == [25, 25] + [1] * 6  # each callable warmed up once, in the first round
    assert timings["copy"] == [1.0, 1.0, 1.0]
    assert timings["pyembed"] == [6.0, 4.0, 8.0]  # median, p20, p80 of 2, 4, 6, 8, 10 (nearest rank)


def test_gpu_decoding_timings_are_calls_back_to_back_in_rounds(monkeypatch):
    # A decoding-sized GPU case is timed as a decoding loop runs: calls back to back, CUDA
    # events between samples of ~1 ms, so host time shows (do_bench's L2 flush hid up to
    # ~85 us of it per call on the H100). Stand-in events read a clock each call advances.
    clock, order = [0.0], []

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock[0]

        def elapsed_time(self, end):
            return end.at - self.at

    def provider(name, ms):
        def call():
            order.append(name)
            clock[0] += ms
        return call

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    timings = run.time_gpu_loop({"copy": provider("copy", 0.004), "pyembed": provider("pyembed", 0.05),
                                 "step": provider("step", 5.0)})
    assert timings["copy"] == pytest.approx([0.004] * 3) and timings["pyembed"] == pytest.approx([0.05] * 3)
    assert timings["step"] == pytest.approx([5.0] * 3)
    runs = [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name]
    # one call and a 5-call estimate each, then 4 rounds in a rotating order
    assert runs == ["copy", "pyembed", "step"] + ["copy", "pyembed", "step", "pyembed", "step", "copy",
                                                  "step", "copy", "pyembed", "copy", "pyembed", "step"]
    # Each round ~GPU_ROUND_MS of calls: ~1 ms samples of several calls, or one call per
    # sample where a call is longer.
    per_sample = {"copy": round(run.GPU_LOOP_SAMPLE_MS / 0.004), "pyembed": round(run.GPU_LOOP_SAMPLE_MS / 0.05)}
    samples = run.GPU_ROUNDS * round(run.GPU_ROUND_MS / run.GPU_LOOP_SAMPLE_MS)
    assert {name: order.count(name) for name in per_sample} == {
        name: 6 + samples * calls for name, calls in per_sample.items()}
    assert order.count("step") == 6 + run.GPU_ROUNDS * round(run.GPU_ROUND_MS / 5.0)


def test_gpu_graph_timings_are_triton_medians_and_skip_uncapturable_calls(monkeypatch):
    # The GPU-only column (graph_ms) from do_bench_cudagraph as Triton summarises it: the
    # H100 run at 664ac49 got no graph_ms at all, indexing the float that one quantile gives.
    triton = pytest.importorskip("triton", reason="triton is not installed")
    import triton.testing

    def replay(fn, **kwargs):  # Triton's own summary of three replays, from the arguments it was given
        fn()
        return triton.testing._summarize_statistics([0.3, 0.1, 0.2], kwargs.get("quantiles"),
                                                    kwargs.get("return_mode", "mean"))

    def syncs():
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", replay)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: None)
    assert run.time_gpu_graphs({"copy": lambda: None, "pyembed": lambda: None, "syncs": syncs}) == {
        "copy": 0.2, "pyembed": 0.2}


@pytest.mark.skipif("cpu" not in pyembed.available_backends(), reason="the cpu backend is not built")
def test_compiled_host_breakdown_times_the_graph_dynamo_runs():
    # python -m bench.compiled_host: the function it times as "graph" is the one Dynamo's
    # frame calls (found by wrapping it), which gives the layer's output (against nn ops).
    from bench import compiled_host

    weight = torch.randn(20, 8, requires_grad=True)
    pos_weight = torch.randn(16, 8, requires_grad=True)
    ids = torch.tensor([[3, 19, 0]])
    args = (ids, weight, pos_weight, 2.0)
    layer = compiled_host.pyembed_layer("cpu")
    torch._dynamo.reset()
    compiled = torch.compile(layer)
    graph, graph_args = compiled_host._graph_call(layer, compiled, args)
    torch.testing.assert_close(graph(*graph_args)[0], compiled_host.nn_layer(*args))
    parts = compiled_host.breakdown({"nn": compiled_host.nn_layer, "pyembed": layer}, args, calls=2, rounds=1)
    for timed in parts.values():
        assert set(timed) == {"fwd", "guards", "graph", "frame", "bwd", "check", "count"}
        assert timed["fwd"] > 0 and timed["graph"] > 0 and timed["bwd"] > 0
        # the guards timed by themselves: checked against the frame's own arguments (a
        # failing check raises), at least one per input tensor's metadata
        assert timed["check"] > 0 and timed["count"] >= 3
    assert weight.grad is None and pos_weight.grad is None  # each timing clears what it accumulated
    torch._dynamo.reset()


def _case_rows(case: Case, times: dict, **fields) -> list[dict]:
    """Rows of one measured case as report.load_csv gives them: provider -> median ms."""
    return [{**case.as_dict(), "label": case.label(), "tokens": case.tokens, "provider": name, "status": "ok",
             "median_ms": ms, **fields} for name, ms in times.items()]


def test_bytes_floor_is_the_forward_and_a_whole_gradient_at_the_faster_copy():
    from bench.targets import floor_ms

    case = Case("gpt2", 8, 2048, "fwd+bwd")
    vocab, row, used, ids = 50257, 768 * 4, 14000, case.tokens * 8
    positions, out = 2048 * row, case.tokens * row
    # The benchmark's minimal bytes: the rows used read, their gradient rows written.
    minimal = (ids + used * row + positions + out) + (ids + out + used * row + positions)
    # #30's floor: the forward (ids, the rows used, positions, the output), the backward
    # (ids, dout, the whole table's gradient, the positions' gradient).
    floor_bytes = (ids + used * row + positions + out) + (ids + out + vocab * row + positions)
    r = {**case.as_dict(), "tokens": case.tokens, "min_bytes": minimal, "graph_ms": 0.2, "graph_pct_of_copy": 50.0}
    assert floor_ms({**r, "copy_ms": 0.05}) == pytest.approx(0.05 * floor_bytes / minimal)  # the flushed copy faster
    assert floor_ms({**r, "copy_ms": 0.5}) == pytest.approx(0.1 * floor_bytes / minimal)  # the graphed one (0.2 x 50%)


def test_targets_are_met_within_two_percent_or_not_and_unmeasured_ones_say_so():
    from bench import targets

    forward = Case("gpt2", 8, 2048, "fwd")
    rows = _case_rows(forward, {"eager": 1.0, "compile": 0.5, "pyembed-cuda": 0.44, "pyembed-triton": 0.455},
                      pct_of_copy=80.0)
    rows += _case_rows(Case("gpt2", 8, 2048, "fwd", dist="zipf"), {"eager": 1.0, "pyembed-cuda": 2.0})  # no target's
    found = {(target, case): verdict for _, target, case, _, verdict in targets.targets(rows)}
    label = forward.label()
    assert found["forward >= 1.1x the faster of eager / compiled nn ops (cuda)", label] == "met"  # 0.5 / 0.44 = 1.14
    assert found["forward >= 1.1x the faster of eager / compiled nn ops (triton)", label] == "within 2%"  # 1.099
    assert found["forward: triton within 1.15x of cuda", label] == "met"  # 0.455 / 0.44 = 1.03
    assert found["forward >= 85% of a copy of its bytes (cuda)", label] == "not met"
    assert found["graphed forward + backward <= 1.3x its bytes floor (cuda)", "-"] is None  # no fwd+bwd case
    assert not any(case == Case("gpt2", 8, 2048, "fwd", dist="zipf").label() for _, case in found)
    # The four forward targets above were measured; every other target (no case of it) was not.
    assert targets.markdown(targets.targets(rows)).splitlines()[0] == (
        "Of 4 (target, case) pairs measured: 2 met, 1 within 2% of the target, 1 not met; "
        f"{len(targets.specs()) - 4} targets not measured in this run.")


def test_a_speedup_asking_less_than_the_bytes_floor_says_so():
    from bench import targets

    case = Case("llama3", 8, 2048, "fwd+bwd")
    # the benchmark's minimal bytes (test above): the rows used read, their gradients written
    row, used = 4096 * 4, 15000
    minimal = 2 * (case.tokens * 8 + used * row + 2048 * row + case.tokens * row)
    fields = {"min_bytes": minimal, "copy_ms": 1.0, "graph_ms": 2.0, "graph_pct_of_copy": 50.0}
    floor = targets.floor_ms({**case.as_dict(), "tokens": case.tokens, **fields})
    target = "forward + backward >= 1.5x the faster of eager / compiled nn ops (cuda)"

    def found(nn_ops, cuda):
        rows = _case_rows(case, {"eager": 3 * floor, "compile": nn_ops * floor, "pyembed-cuda": cuda * floor}, **fields)
        return next((text, verdict) for _, name, label, text, verdict in targets.targets(rows)
                    if (name, label) == (target, case.label()))

    # Compiled nn ops at 1.3x the floor: 1.5x faster than them is 0.87x the floor, which no kernel reaches.
    text, verdict = found(1.3, 1.05)
    assert verdict == "below the floor" and "1.5x asks" in text and "below the bytes floor" in text, text
    # At 1.8x the floor it asks 1.2x the floor: reachable, so a shortfall is "not met"; a win is "met".
    assert found(1.8, 1.3)[1] == "not met" and found(1.8, 1.1)[1] == "met"


def test_device_calls_counts_the_allocators_driver_calls_and_host_syncs_per_call(monkeypatch):
    import warnings

    stats = iter([{"num_device_alloc": 4, "num_device_free": 1}, {"num_device_alloc": 10, "num_device_free": 1,
                                                                  "num_alloc_retries": 3},
                  {"num_device_alloc": 10}, {"num_device_alloc": 10}])
    modes = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: next(stats))
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def syncing():  # what torch's sync debug mode "warn" says for a read of device data
        warnings.warn("called a synchronizing CUDA operation")

    assert run.device_calls(syncing, calls=3) == "2 cudaMalloc, 1 allocation retries, 1 host syncs per call"
    assert modes == ["warn", 0]  # the mode set for the calls only
    assert run.device_calls(lambda: None, calls=3) == ""


def test_device_calls_of_a_flushed_timing_flush_before_each_call_as_do_bench(monkeypatch):
    import triton

    events = []

    class Driver:  # do_bench's L2 flush: a buffer made once, cleared before each call
        def get_empty_cache_for_benchmark(self):
            events.append("buffer")
            return "cache"

        def clear_cache(self, cache):
            events.append(f"clear {cache}")

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda mode: None)
    # (reset_active() would make the default driver, which needs a GPU: the attribute is restored instead)
    monkeypatch.setattr(triton.runtime.driver, "_active", Driver())
    assert run.device_calls(lambda: events.append("call"), calls=2, flushed=True) == ""
    assert events == ["buffer", "clear cache", "call", "clear cache", "call"]


def test_model_bench_times_each_model_eager_and_compiled_from_the_same_parameters():
    # python -m bench.model: the input layer inside a small model, in nn ops and with
    # pyembed, eager and compiled; every model starts from the same parameters, each
    # compiled model is a graph of its own (none falls back to eager) with parameters of its
    # own, and each is checked against the float64 nn-ops model before it is timed.
    from torch._dynamo.utils import counters

    from bench import model as bench_model

    models = bench_model.build_models(1000, 64, 2, 16, 1, torch.float32, torch.device("cpu"), ["cpu"])
    assert list(models) == ["eager", "compile", "pyembed-cpu", "compile(pyembed-cpu)",
                            "compile(pyembed-cpu, ATen forward)", "the rest", "compile(the rest)"]
    state = models["eager"].state_dict()
    for name in ("compile", "pyembed-cpu", "compile(pyembed-cpu)", "compile(pyembed-cpu, ATen forward)"):
        module = bench_model._module(models[name])
        assert module is not models["eager"] and state.keys() == module.state_dict().keys()
        for key, value in module.state_dict().items():
            assert torch.equal(value, state[key]) and value.data_ptr() != state[key].data_ptr(), (name, key)
    ids = torch.randint(0, 1000, (2, 16))
    # The ATen forward's model compiles its forward through pyembed's ATen form (and only it:
    # the plain compiled model, compiled first, does not; nor does the ATen one take the
    # plain one's code from Inductor's or AOTAutograd's caches, which key on Dynamo's graph,
    # the same for both), and leaves Inductor's table as it was.
    aten_forward, formed = models["compile(pyembed-cpu, ATen forward)"], []
    form = aten_forward.form
    aten_forward.form = lambda *args, **kwargs: formed.append(1) or form(*args, **kwargs)
    from torch._inductor import decomposition

    compiled = ("compile", "compile(pyembed-cpu)", "compile(pyembed-cpu, ATen forward)", "compile(the rest)")
    for name, forms_so_far in zip(compiled, (0, 0, 1, 1)):
        models[name](ids)
        assert len(formed) == forms_so_far, name
        assert aten_forward.op not in decomposition.select_decomp_table()
    # Dynamo's cache is per code object: each compiled model's graph under a forward of its own
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list
    assert not entries(bench_model.Model.forward.__code__)
    assert all(len(entries(bench_model._module(models[name]).forward.__code__)) == 1 for name in compiled)
    counters.clear()
    results = bench_model.measure(1000, 64, 2, 16, 1, "fp32", torch.device("cpu"), ["cpu"], budget_s=0.01)
    assert set(results) == set(models)
    for name, found in results.items():
        assert found["status"] == "ok", (name, found["status"])
        assert all(found[mode][0] > 0 for mode in ("fwd+bwd", "step")), name
    # one frame and one graph for each compiled model: no graph break, no recompile
    assert counters["frames"]["total"] == counters["frames"]["ok"] == counters["stats"]["unique_graphs"] == 4
    table = bench_model.table(results, "title")
    assert table.count("\n| ") == 1 + len(results)  # the header's separator and a row each
    torch._dynamo.reset()


def test_model_bench_gate_reports_a_wrong_output_or_gradient_and_leaves_the_fixed_input_alone():
    from bench import model as bench_model

    class OffByScale(bench_model.NNInputLayer):
        def forward(self, ids):
            return super().forward(ids) * 1.01

    class NextRow(bench_model.NNInputLayer):
        def forward(self, ids):
            return super().forward((ids + 1) % self.token_embedding.num_embeddings)

    class DoubledGradient(bench_model.NNInputLayer):
        def forward(self, ids):
            out = super().forward(ids)
            return out + (out - out.detach())  # the same values, twice the gradient

    torch.manual_seed(0)
    reference = bench_model.Model(bench_model.NNInputLayer(100, 16, 8), 16, 1).double()
    with torch.no_grad():
        reference.input_layer.pos_embedding.normal_(std=0.02)
    ids = torch.randint(0, 100, (2, 8))
    want = bench_model.checked_values(reference, ids)
    for layer, what in ((bench_model.NNInputLayer, None), (OffByScale, "input layer's output"),
                        (NextRow, "input layer's output"), (DoubledGradient, "token table's gradient")):
        model = bench_model.Model(layer(100, 16, 8), 16, 1)
        model.load_state_dict(reference.state_dict())
        problem = bench_model.gate(layer.__name__, model, want, ids, "fp32")
        assert (problem is None) if what is None else (problem is not None and what in problem), \
            (layer.__name__, problem)

    rest = bench_model.Model(bench_model.FixedInput(torch.randn(2, 8, 16)), 16, 1)
    fixed = rest.input_layer.x.detach().clone()
    norm = rest.norm.weight.detach().clone()
    bench_model.step_fns(rest, ids)["step"]()
    assert torch.equal(rest.input_layer.x, fixed) and rest.input_layer.x.grad is None
    assert not torch.equal(rest.norm.weight, norm)  # the rest's own parameters are trained


def test_targets_read_a_runs_cases_split_over_several_csvs(tmp_path, capsys):
    # gpu-check's two calls may each run part of the benchmark (--bench-args='--mode fwd' in
    # one, the other modes in the next): read together, their CSVs give the table of the
    # whole run's (the H200 run at 26f0ba6, split by mode).
    from bench import targets

    whole = pathlib.Path(__file__).resolve().parents[1] / "docs" / "bench-h200" / "26f0ba6" / "results.csv"
    with whole.open(newline="") as f:
        reader = csv.DictReader(f)
        rows, fields = list(reader), reader.fieldnames
    parts = []
    for name, keep in (("fwd", lambda mode: mode == "fwd"), ("rest", lambda mode: mode != "fwd")):
        parts.append(tmp_path / f"{name}.csv")
        with parts[-1].open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            writer.writerows(row for row in rows if keep(row["mode"]))
    targets.main([str(whole)])
    expected = capsys.readouterr().out
    targets.main([str(part) for part in parts])
    assert capsys.readouterr().out == expected and "met" in expected
    targets.main([str(parts[0])])  # the forward cases alone: fewer pairs measured
    assert capsys.readouterr().out != expected


def test_targets_compare_a_profiles_kernel_settings_case_by_case():
    # The profile times kernel variants against each other (its dense backward op at each
    # setting, e.g. PYEMBED_CUDA_FINISH_GROUP): bench.targets lists each case's times in the
    # order run and the fastest as a ratio to the first, from the lines the profile prints.
    import sys

    gpu_tests = str(pathlib.Path(__file__).resolve().parent / "gpu")
    sys.path.insert(0, gpu_tests)
    try:
        from profile_workload import backward_op_line
    finally:
        sys.path.remove(gpu_tests)
    from bench import targets

    llama, gpt2 = (128256, 4096), (50257, 768)
    graphed = {("off", "uniform"): 431.4, ("8", "uniform"): 388.0, ("8-last", "uniform"): 402.5,
               ("off", "zipf"): 455.8, ("8", "zipf"): 470.1, ("8-last", "zipf"): 455.8}
    lines = ["sort tile sort: ..."]  # not a complete line: skipped
    lines += [backward_op_line("tile sort", "cuda", gpt2, torch.float32, 8, 2048, "uniform", 0.11, 0.1066, 42.0, 4),
              backward_op_line("CUB device sort", "cuda", gpt2, torch.float32, 8, 2048, "uniform", 0.13, 0.1256, 50, 6)]
    lines += [backward_op_line(f"tile sort, {value} finish group", "cuda", llama, torch.bfloat16, 8, 2048, dist,
                               us * 1.01e-3, us * 1e-3, 40.0, 4) for (value, dist), us in graphed.items()]
    found = targets.setting_comparisons("\n".join(lines))
    assert found == [
        "`cuda` sort, 50257x768 float32 8x2048, uniform ids: tile sort 106.6, CUB device sort 125.6 us graphed; "
        f"fastest tile sort ({1:.2f}x the first)",
        "`cuda` finish group, 128256x4096 bfloat16 8x2048, uniform ids: off 431.4, 8 388.0, 8-last 402.5 us graphed; "
        f"fastest 8 ({388.0 / 431.4:.2f}x the first)",
        "`cuda` finish group, 128256x4096 bfloat16 8x2048, zipf ids: off 455.8, 8 470.1, 8-last 455.8 us graphed; "
        "fastest off (1.00x the first)"]  # a tie: the first listed
    assert targets.markdown([], settings=found).endswith("\n".join(f"- {line}" for line in found) + "\n")
    # Over its cases: 8 is faster than off at uniform ids and slower at Zipf ones, so no value
    # wins everywhere; with 8 faster at Zipf ids too (by more than 2%), it does, 8-last not.
    assert targets.setting_verdicts("\n".join(lines)) == [
        "`cuda` sort, 1 case: no value faster than tile sort by more than 2% in every case",
        "`cuda` finish group, 2 cases: no value faster than off by more than 2% in every case"]
    graphed[("8", "zipf")] = 440.0
    faster = [backward_op_line(f"tile sort, {value} finish group", "cuda", llama, torch.bfloat16, 8, 2048, dist,
                               us * 1.01e-3, us * 1e-3, 40.0, 4) for (value, dist), us in graphed.items()]
    settled = targets.setting_verdicts("\n".join(faster))
    assert settled == ["`cuda` finish group, 2 cases: faster than off by more than 2% in every case: "
                       f"8 ({388.0 / 431.4:.2f}x-{440.0 / 455.8:.2f}x)"]
    assert targets.markdown([], settled=settled).endswith(f"- {settled[0]}\n")
