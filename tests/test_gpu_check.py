"""``make gpu-check`` on a machine without a GPU: one line saying so, exit status 2
(DESIGN §6). Its real run needs a GPU (README, "Tests on a GPU")."""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile

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


# make gpu-prepare (tests/gpu/gpu_prepare.py): the extension and Triton kernels made here
# beforehand, used on the GPU machine where they fit it.

def _gpu_prepare():
    _gpu_check()  # imports it, from tests/gpu
    return sys.modules["gpu_prepare"]


def test_a_prepared_extension_serves_only_the_stack_arch_and_sources_it_was_built_from(tmp_path):
    g = _gpu_prepare()
    here = {"torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12.3"}
    prepared = {"torch": "2.11.0+cu130", "cuda": "13.0", "python": "3.12", "arch": "9.0",
                "extension": g.sources_digest(g.extension_sources())}
    assert g.extension_mismatch(prepared, here, "9.0") is None  # 3.12.1 there, 3.12.3 here: one ABI
    for key, other in [("torch", "2.11.0+cu128"), ("cuda", "12.8"), ("python", "3.13")]:
        why = g.extension_mismatch({**prepared, key: other}, here, "9.0")
        assert why == f"made for {key} {other} (here {here[key] if key != 'python' else '3.12'})", why
    assert g.extension_mismatch(prepared, here, "10.0") == "made for arch 9.0 (here 10.0)"
    assert g.extension_mismatch({**prepared, "extension": "0" * 64, "torch": "2.10.0"}, here, "9.0") == \
        "made for torch 2.10.0 (here 2.11.0+cu130); the extension's sources changed since it was made"
    # The digest follows every byte and name of what it covers, and nothing else.
    (tmp_path / "a.cu").write_text("kernel")
    (tmp_path / "b.h").write_text("header")
    files = [tmp_path / "a.cu", tmp_path / "b.h"]
    before = g.sources_digest(files, tmp_path)
    assert g.sources_digest(files[::-1], tmp_path) == before
    (tmp_path / "b.h").write_text("headex")
    assert g.sources_digest(files, tmp_path) != before
    (tmp_path / "b.h").write_text("header")
    (tmp_path / "b.h").rename(tmp_path / "c.h")
    assert g.sources_digest([tmp_path / "a.cu", tmp_path / "c.h"], tmp_path) != before
    assert ROOT / "csrc" / "cuda" / "embedding_kernels.cuh" in g.extension_sources()


def test_kernels_compiled_in_a_run_are_counted_by_name_pyembeds_apart(tmp_path):
    g = _gpu_prepare()
    for entry, binary in [("A", "_finish_segments_kernel"), ("B", "_finish_segments_kernel"),
                          ("C", "_chunk_kernel"), ("D", "triton_poi_fused_add_0"), ("E", "_chunk_kernel")]:
        (tmp_path / entry).mkdir()
        (tmp_path / entry / f"{binary}.cubin").write_bytes(b"\0")
        (tmp_path / entry / f"{binary}.json").write_text("{}")
    assert g.compiled_since(tmp_path, {"E"}) == ("Triton kernels compiled in this run: 3 of pyembed's "
                                                "(_finish_segments_kernel 2, _chunk_kernel 1), 1 others (Inductor's)")
    assert g.compiled_since(tmp_path, g.cache_entries(tmp_path)) == \
        "Triton kernels compiled in this run: 0 of pyembed's, 0 others (Inductor's)"


_FORWARD_CALL = """
import torch, pyembed
weight = torch.randn(100, 16)
with torch.no_grad():
    pyembed.fused_embedding(torch.randint(0, 100, (2, 8)), weight, backend="triton")
"""


def test_a_triton_cache_packed_here_is_found_where_it_is_unpacked_without_compiling(tmp_path):
    """gpu-check unpacks the kernels make gpu-prepare compiled into another folder than
    theirs: Triton's group files name their members by absolute path, rewritten on
    unpacking -- the same specialisations, warmed from the new folder, compile nothing
    (each binary's file untouched), where the folder unpacked as packed recompiles them. And
    the warm-up names its kernels' cache folders, the ones gpu-prepare keeps and packs."""
    g = _gpu_prepare()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), str(ROOT / "tests")]))
    specs = tmp_path / "specs.json"

    def run(*args, cache=None, interpret=False):
        extra = {"TRITON_INTERPRET": "1"} if interpret else {"TRITON_CACHE_DIR": str(cache)}
        proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=tmp_path,
                              env={**env, **extra})
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc.stdout

    run("-c", f"import triton_specs\nlaunched = triton_specs.recording()\n{_FORWARD_CALL}\n"
              f"triton_specs.write_record({str(specs)!r}, launched)", interpret=True)
    warm = [str(ROOT / "tests" / "triton_specs.py"), "warm", str(specs), "1", "300"]
    folders = tmp_path / "folders.json"
    assert run(*warm, str(folders), cache=tmp_path / "compiled").startswith("2 of 2 specialisations compiled")
    # The warm-up names the folders of the kernels it compiled, and gpu-prepare keeps only those.
    used = set(json.loads(folders.read_text()))
    assert len(used) == 2 and used == g.cache_entries(tmp_path / "compiled")
    shutil.copytree(tmp_path / "compiled" / min(used), tmp_path / "compiled" / "EARLIER")  # another source's kernel
    assert g.prune_triton_cache(tmp_path / "compiled", used) == 1
    assert g.cache_entries(tmp_path / "compiled") == used
    for wrong in (set(), {"NOT-A-FOLDER"}):  # a warm-up that compiled nothing, or named other folders
        with pytest.raises(RuntimeError, match="none of the warm-up's"):
            g.prune_triton_cache(tmp_path / "compiled", wrong)
    assert g.cache_entries(tmp_path / "compiled") == used
    assert g.pack_triton_cache(tmp_path / "compiled", tmp_path / "cache.tar.xz") == 2
    (tmp_path / "compiled").rename(tmp_path / "gone")  # the folder they were compiled into

    def binaries(cache):
        return {p.relative_to(cache): (p.stat().st_ino, p.stat().st_mtime_ns) for p in cache.rglob("*.cubin")}

    import triton
    from triton.runtime.cache import triton_key

    stack = {"triton": triton.__version__, "triton_key": triton_key()[-16:]}
    prepared = {**stack, "triton_cache_entries": 2, "commit": "abc1234", "kernels": "?"}
    (tmp_path / "prepared").mkdir()
    (tmp_path / "cache.tar.xz").rename(tmp_path / "prepared" / g.CACHE_TARBALL)
    line = g.unpack_triton_cache(tmp_path / "prepared", prepared, stack, tmp_path / "unpacked")
    assert line.startswith("Triton cache: 2 kernels compiled beforehand (make gpu-prepare at abc1234"), line
    unpacked = binaries(tmp_path / "unpacked")
    assert len(unpacked) == 2
    assert run(*warm, cache=tmp_path / "unpacked").startswith("2 of 2 specialisations compiled")
    assert binaries(tmp_path / "unpacked") == unpacked  # found, not compiled again
    # Unpacked as packed, its group files name the folder that is gone: compiled again.
    with tarfile.open(tmp_path / "prepared" / g.CACHE_TARBALL) as tar:
        tar.extractall(tmp_path / "as-packed", filter="data")
    as_packed = binaries(tmp_path / "as-packed")
    run(*warm, cache=tmp_path / "as-packed")
    assert all(binaries(tmp_path / "as-packed")[p] != as_packed[p] for p in as_packed)
    # Another Triton's kernels are not unpacked at all.
    other = g.unpack_triton_cache(tmp_path / "prepared", {**prepared, "triton_key": "0" * 16}, stack,
                                  tmp_path / "other")
    assert other.startswith("Triton cache not used: compiled by Triton") and not (tmp_path / "other").exists()
