"""How the package installs (DESIGN §9): the README's Python runs as written, setup.py
refuses a build without torch with one instruction (and needs no torch for metadata),
and the extension records the torch it was built against."""

import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
import torch

import pyembed

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)))
def test_readme_python_blocks_run_as_written(index, tmp_path):
    # From an empty folder, as a user's script: inside the checkout, Python would import
    # the source folder rather than the installed copy (make test-compat installs the sdist).
    proc = subprocess.run([sys.executable, "-c", PYTHON_BLOCKS[index]], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=ENV)
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


@pytest.mark.skipif(pyembed.build_info()["torch_built_against"] is None, reason="the C++ extension is not built")
@pytest.mark.skipif(shutil.which("nm") is None, reason="binutils' nm is not installed")
def test_extensions_use_the_process_cpp_runtime(emulated):
    # A private copy of libstdc++ inside an extension numbers std::locale's facets apart
    # from torch's libstdc++.so.6: on the H100 machine (g++ 13 finding only libstdc++.a)
    # the first error message formatting an int64 segfaulted. No extension we build may
    # carry the runtime's stream code (std::ostream::_M_insert<long> stands for it).
    for path in (pyembed._C.__file__, emulated.__file__):
        defined = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True,
                                 check=True).stdout
        assert "_ZNSo9_M_insertIlEERSoT_" not in defined, f"{path} links a private libstdc++"


def _fake_compiler(path, output: str):
    """A "compiler" that writes ``output`` to the file after -o (the last argument)."""
    path.write_text(f'#!/bin/sh\nfor last; do :; done\nprintf "%s" "{output}" > "$last"\n')
    path.chmod(0o755)
    return str(path)


def test_link_args_name_the_shared_runtime_only_when_a_probe_links_without_it(tmp_path):
    from pyembed._libstdcxx import link_args

    if not sys.platform.startswith("linux"):
        assert link_args() == []
        return
    # The probe's bytes decide: a DT_NEEDED libstdc++.so.6 (or libc++) means shared.
    assert link_args(_fake_compiler(tmp_path / "static", "ELF ... probe code, no runtime named")) == [
        "-l:libstdc++.so.6"]
    assert link_args(_fake_compiler(tmp_path / "shared", "ELF ... libstdc++.so.6 ...")) == []
    assert link_args(_fake_compiler(tmp_path / "libcxx", "ELF ... libc++.so.1 ...")) == []
    assert link_args(str(tmp_path / "no-such-compiler")) == []


def test_import_from_a_source_folder_without_a_build_says_so(tmp_path):
    """Python run inside a clone imports its source folder, not the installed copy: with no
    extension built there, the warning says that (not a 'circular import')."""
    checkout = tmp_path / "clone"
    shutil.copytree(ROOT / "pyembed", checkout / "pyembed", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    (checkout / "csrc").mkdir()
    (checkout / "setup.py").write_text("# the checkout's build script\n")
    # -S: no .pth files, so no editable-install finder (which would map pyembed._C to this
    # build whatever folder pyembed came from); site-packages stays importable for torch.
    site_packages = os.pathsep.join(p for p in sys.path if p.endswith("site-packages"))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": site_packages}
    proc = subprocess.run([sys.executable, "-S", "-c", "import pyembed; print(pyembed.available_backends())"],
                          capture_output=True, text=True, cwd=checkout, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['reference']"
    assert f"imported from the source checkout {checkout / 'pyembed'}" in proc.stderr, proc.stderr
    assert "pip install --no-build-isolation -e ." in proc.stderr and "circular" not in proc.stderr, proc.stderr
