"""``make gpu-check`` on a machine without a GPU: one line saying so, exit status 2
(DESIGN §6). Its real run needs a GPU (README, "Tests on a GPU")."""

import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU this would run the whole check")
def test_gpu_check_without_a_gpu_says_so_in_one_line_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], proc.stdout
    assert not list(tmp_path.iterdir())  # nothing built, nothing written


def _gpu_check():
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
    return gpu_check


def test_a_time_limit_gives_each_step_what_is_left_after_the_later_steps_minimum():
    # --time-limit (one GPU command): a step's timeout is its own cap, cut to what is left
    # of the limit once the later steps keep their minimum, never under the floor.
    gpu_check = _gpu_check()
    assert gpu_check.Deadline(None).timeout(900, reserve=500) == 900  # no limit: the cap
    deadline = gpu_check.Deadline(560)
    assert deadline.timeout(300, reserve=100) == 300  # the cap fits
    assert 455 <= deadline.timeout(900, reserve=100) <= 460  # cut to the limit less the reserve
    assert deadline.timeout(900, reserve=600) == deadline.floor  # nothing left: it still starts


def test_the_tests_keep_time_for_the_profile_but_not_for_a_benchmark_after_them_alone():
    # What each step leaves for the later ones (after the profile steps, the model step, the
    # tests): a first call without the profile leaves the summary's time alone, and its
    # benchmark takes what the tests leave; a full run keeps the profile's and the
    # benchmark's minimums; ncu counts only where it runs.
    import argparse

    g = _gpu_check()

    def reserves(**skips):
        flags = {"skip_profile": False, "skip_bench": False, "skip_ncu": False, "rehearse": False, **skips}
        return g.reserves(argparse.Namespace(**flags))

    assert reserves() == (g.BENCH_MIN + g.SUMMARY_MIN, g.BENCH_MIN + g.SUMMARY_MIN + g.PROFILE_MIN,
                          g.BENCH_MIN + g.SUMMARY_MIN + 6 * g.PROFILE_MIN)
    assert reserves(skip_ncu=True)[2] == g.BENCH_MIN + g.SUMMARY_MIN + 5 * g.PROFILE_MIN
    assert reserves(skip_profile=True)[2] == reserves(skip_profile=True, skip_bench=True)[2] == g.SUMMARY_MIN
    assert reserves(rehearse=True)[2] == g.SUMMARY_MIN


def test_a_skipped_step_is_named_in_the_summary_with_why(tmp_path):
    gpu_check = _gpu_check()
    check = gpu_check.Check(tmp_path, {})
    check.skip("benchmark (python -m bench --suite gpu)", "31 s left under --time-limit")
    info = {"torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12"}
    summary = gpu_check.write_summary(tmp_path, info, check, {}, 1.0, False).read_text()
    assert "| benchmark (python -m bench --suite gpu) | skipped: 31 s left under --time-limit | - | - |" in summary


def test_steps_side_by_side_are_timed_to_their_own_end(tmp_path):
    # The build and the Triton warm-up, or the tests and the sanitizers, run side by side and
    # are collected in the order they started: a short step collected after a long one is
    # still given its own time, not the long one's.
    gpu_check = _gpu_check()
    check = gpu_check.Check(tmp_path, {})
    check.start("long", [sys.executable, "-c", "import time; time.sleep(3)"], "long.log", 60)
    check.start("short", [sys.executable, "-c", "pass"], "short.log", 60)
    results = check.wait()
    assert results["long"][0] and results["short"][0]
    seconds = {name: took for name, _, took, _ in check.steps}
    assert seconds["long"] >= 3 > 2 > seconds["short"], seconds


def test_test_time_is_summed_by_module_and_the_backend_a_test_names(tmp_path):
    # junit.xml as pytest writes it: per test its module (classname), name and seconds.
    cases = [("tests.test_parity", "test_a[triton@cuda-int32]", 3.0),
             ("tests.test_parity", "test_a[cuda@cuda-int32]", 1.0), ("tests.test_parity", "test_b[triton@cuda]", 2.5),
             ("tests.gpu.test_gpu_parity", "test_c[768-triton]", 4.0), ("tests.gpu.test_gpu_parity", "test_d", 0.5),
             ("tests.gpu.test_gpu_parity", "test_e[x-cuda]", 1.0)]
    body = "".join(f'<testcase classname="{m}" name="{n}" time="{t}" />' for m, n, t in cases)
    (tmp_path / "junit.xml").write_text(f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>')
    lines = _gpu_check().junit_seconds(tmp_path / "junit.xml")
    assert lines[0] == "12 worker-seconds over 6 tests; by module and backend:"
    assert lines[4:] == ["| tests.test_parity | triton | 2 | 6 | 46% |",
                         "| tests.gpu.test_gpu_parity | triton | 1 | 4 | 33% |",
                         "| tests.test_parity | cuda | 1 | 1 | 8% |",
                         "| tests.gpu.test_gpu_parity | cuda | 1 | 1 | 8% |",
                         "| tests.gpu.test_gpu_parity | - | 1 | 0 | 4% |"]
    assert _gpu_check().junit_seconds(tmp_path / "missing.xml") == []
    cut = tmp_path / "cut.xml"  # a test step killed while pytest wrote it
    cut.write_text('<testsuites><testsuite name="pytest"><testcase classname="a" na')
    assert _gpu_check().junit_seconds(cut) == [] and _gpu_check().junit_counts(cut) == {}
    (tmp_path / "zero.xml").write_text('<testsuites><testsuite><testcase classname="m" name="t" time="0" /></testsuite>'
                                       '</testsuites>')
    assert _gpu_check().junit_seconds(tmp_path / "zero.xml")[-1] == "| m | - | 1 | 0 | 0% |"


def test_the_summary_carries_the_model_steps_tables_without_its_warnings(tmp_path):
    # model.log (python -m bench.model): each dtype's title and markdown table go into
    # summary.md, whatever else the run printed (warnings) does not.
    gpu_check = _gpu_check()
    title = "The input layer in a model: gpt2 (50257x768) 8x2048 fp32 (TF32 matmuls), 1 block(s), GPU; medians (40 s)"
    table = ["| model | fwd+bwd | step | its input layer in fwd+bwd | step, nn ops' / its |", "|---|---|---|---|---|",
             "| eager | 2.00 ms | 3.00 ms | 500 us |  |", "| pyembed-cuda | 1.70 ms | 2.80 ms | 200 us | 1.07x |"]
    (tmp_path / "model.log").write_text("\n".join(["W1129 some warning", title, "", *table, ""]))
    info = {"torch": "2.11", "cuda": "13.0", "triton": "3.6", "python": "3.12"}
    summary = gpu_check.write_summary(tmp_path, info, gpu_check.Check(tmp_path, {}), {}, 1.0, False).read_text()
    part = summary.split("## The input layer in a model (model.log: python -m bench.model)\n\n")[1]
    assert part.splitlines()[:5] == [title, *table]
    assert "W1129" not in summary
