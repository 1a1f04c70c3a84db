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


def test_a_time_limit_gives_each_step_what_is_left_after_the_later_steps_minimum():
    # --time-limit (one GPU command): a step's timeout is its own cap, cut to what is left
    # of the limit once the later steps keep their minimum, never under the floor.
    sys.path.insert(0, str(ROOT / "tests" / "gpu"))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(ROOT / "tests" / "gpu"))
    assert gpu_check.Deadline(None).timeout(900, reserve=500) == 900  # no limit: the cap
    deadline = gpu_check.Deadline(560)
    assert deadline.timeout(300, reserve=100) == 300  # the cap fits
    assert 455 <= deadline.timeout(900, reserve=100) <= 460  # cut to the limit less the reserve
    assert deadline.timeout(900, reserve=600) == deadline.floor  # nothing left: it still starts
