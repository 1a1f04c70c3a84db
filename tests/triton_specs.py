"""Every Triton specialisation the test suite launches, compiled by another Triton.

    python tests/triton_specs.py record OUT.json [pytest args]   # under the interpreter
    python tests/triton_specs.py compile IN.json                 # the real JIT, for sm_90

``record`` runs the triton tests under the interpreter and writes down each launch: the
kernel, each argument as Triton specialises it (a tensor's dtype and 16-byte alignment,
an int or float as given) and the constexprs. ``compile`` builds each distinct one with
the Triton it runs under -- `make test-compat` runs it with the GPU machine's (3.6) --
through its real JIT for sm_90 with a stand-in driver (bench/stand_in_driver.py), and
fails listing any that do not compile. Triton 3.6 once failed to compile the dense
backward at d = 16-64, which no test here could see: the interpreter does not compile.
"""

import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TESTS = ["tests/test_parity.py", "tests/test_dropout.py", "tests/test_optim.py", "tests/test_host_sync.py",
                 "tests/test_modules.py", "tests/test_dropin.py", "-k", "triton or auto"]


def _as_specialised(value):
    import torch

    if isinstance(value, torch.Tensor):
        return ["tensor", str(value.dtype).removeprefix("torch."), value.data_ptr() % 16 == 0]
    return getattr(value, "value", value)  # a constexpr's value, or the int / float / bool / None itself


def record(out: str, pytest_args: list) -> int:
    os.environ["TRITON_INTERPRET"] = "1"
    import pytest
    import triton.runtime.interpreter as interpreter

    launched = {}
    launch = interpreter.GridExecutor.__call__

    def recording_launch(self, *args, **kwargs):
        # pyembed's kernels only (a test may launch a kernel of its own around one of their helpers)
        if getattr(self.fn, "__module__", None) == "pyembed.kernels.embedding":
            entry = [self.fn.__name__, [_as_specialised(a) for a in args],
                     {name: _as_specialised(v) for name, v in kwargs.items()}]
            launched[json.dumps(entry)] = entry
        return launch(self, *args, **kwargs)

    interpreter.GridExecutor.__call__ = recording_launch
    os.chdir(ROOT)  # the default test paths are the repository's
    code = pytest.main(["-q", "-p", "no:cacheprovider", *(pytest_args or DEFAULT_TESTS)])
    pathlib.Path(out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(out).write_text(json.dumps(list(launched.values())))
    print(f"{len(launched)} launches recorded in {out}")
    return int(code)


def compile_all(path: str) -> int:
    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, str(ROOT / "bench"))
    import stand_in_driver

    stand_in_driver.install()
    import torch
    import triton

    from pyembed.kernels import embedding as kernels
    from pyembed.kernels.launch import _launch_key

    def argument(value):
        if isinstance(value, list) and value[:1] == ["tensor"]:
            base = torch.zeros(64, dtype=getattr(torch, value[1]))
            return base if value[2] else base[1:]  # one element in: not 16-byte aligned
        return value

    entries = {}  # one launch per distinct specialisation, by the cached launcher's key
    for name, recorded, constexprs in json.loads(pathlib.Path(path).read_text()):
        args = tuple(map(argument, recorded))
        entries.setdefault((name, _launch_key((), args, constexprs)), (name, args, constexprs))
    failed = []
    for name, args, constexprs in entries.values():
        try:
            getattr(kernels, name).warmup(*args, grid=(1,), **constexprs)
        except Exception as error:  # noqa: BLE001 - every failure is reported, then the exit code says it
            failed.append(f"{name} {constexprs}: {str(error).splitlines()[0][:200]}")
    print(f"Triton {triton.__version__}: {len(entries) - len(failed)} of {len(entries)} specialisations compiled "
          "for sm_90", *failed, sep="\n")
    return 1 if failed else 0


if __name__ == "__main__":
    command, path, *rest = sys.argv[1:]
    sys.exit(record(path, rest) if command == "record" else compile_all(path))
