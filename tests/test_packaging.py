"""How the package installs (DESIGN §9): the README's Python runs as written, setup.py
refuses a build without torch with one instruction (and needs no torch for metadata),
and the extension records the torch it was built against."""

import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import pyembed

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_blocks_run_as_written(index):
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, f"README python block {index}:\n{PYTHON_BLOCKS[index]}\n{proc.stderr[-3000:]}"


def _setup_py(*argv):
    """Run setup.py as pip would, with `import torch` failing."""
    code = ("import sys; sys.modules['torch'] = None; "
            f"sys.argv = ['setup.py', *{list(argv)!r}]; "
            "exec(compile(open('setup.py').read(), 'setup.py', 'exec'), {'__file__': 'setup.py', '__name__': '__main__'})")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_building_without_torch_says_what_to_run():
    proc = _setup_py("bdist_wheel")
    assert proc.returncode != 0
    message = proc.stderr.strip()
    assert message.startswith("pyembed-kernels:") and "pip install --no-build-isolation" in message, message
    assert "Traceback" not in message


def test_metadata_needs_no_torch():
    proc = _setup_py("--version")
    assert proc.returncode == 0 and proc.stdout.strip().endswith(pyembed.__version__), proc.stderr


def test_build_info_names_the_torch_built_against():
    info = pyembed.build_info()
    if not info["cpu_built"]:
        pytest.skip("the extension is not built here")
    assert info["torch_built_against"] == torch.__version__ == info["torch"]
