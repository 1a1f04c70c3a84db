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
