"""``make gpu-prepare``: what gpu-check would spend its first minutes on, made here beforehand.

A session lent a GPU has 15 minutes of it. At 82eabd8 (H200) gpu-check's first call built
pyembed._C for sm_90 in 132 s, compiled Triton kernels beside it for 210 s, and its tests
then compiled what was still missing (the `triton` tests took most of the step's
worker-seconds). Neither needs the GPU: the same torch, CUDA and Python give the same
extension, the same Triton gives the same kernels (its cache keys are hashes of contents:
Triton's own files, the kernel's source, the options, the target). `.venv-gpu-stack` is
the GPU machine's stack (Makefile), so, with its python::

    python tests/gpu/gpu_prepare.py OUT [JOBS]

builds pyembed._C for sm_90 against that torch (debug info stripped) into OUT/pyembed/,
compiles every Triton specialisation of build/triton_specs.json for sm_90 (the stand-in
driver: no GPU) into a Triton cache packed as OUT/triton-cache.tar.xz, and writes what they
were made from to OUT/prepared.json. Carried to the GPU machine (the device tool's
``carry``), gpu-check copies the extension into its stage where torch, CUDA, the Python
minor version, the GPU's architecture and the extension's sources match (else it builds, as
it does without OUT), and unpacks the cache where the Triton is the same (its version and
cache key); summary.md says what was used, and how many kernels were still compiled there.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ARCH = "9.0"  # the H100 / H200 machines'
CACHE_TARBALL = "triton-cache.tar.xz"


def _load_sources_module():
    """This tree's pyembed/_sources.py, loaded by path as setup.py loads it: the python
    running this script may import another copy of pyembed (an editable install's), or none."""
    spec = importlib.util.spec_from_file_location("_pyembed_sources", ROOT / "pyembed" / "_sources.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def sources_digest(paths: list[Path], root: Path = ROOT) -> str:
    """sha256 over each file's path (from ``root``) and bytes, in path order."""
    return _load_sources_module().digest(paths, root)


def extension_sources() -> list[Path]:
    """What pyembed._C is built from: setup.py, the helpers it loads, csrc/."""
    return [ROOT / "setup.py", *(ROOT / "pyembed" / f"{name}.py" for name in ("_cuda_home", "_libstdcxx", "_sources")),
            *(p for p in (ROOT / "csrc").rglob("*") if p.is_file())]


def kernel_sources() -> list[Path]:
    return sorted((ROOT / "kernels").glob("*.py"))


def stack(python: str = sys.executable) -> dict:
    """What ``python`` runs: torch, CUDA, Python, Triton and Triton's own cache key (a hash
    of its files, which every kernel's key includes), and the first GPU where one is visible;
    {"torch": None, "error": ...} where it has no torch."""
    code = ("import json, torch, platform\n"
            "info = {'python': platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda}\n"
            "try:\n import triton; info['triton'] = triton.__version__\nexcept ImportError: info['triton'] = None\n"
            "try:\n from triton.runtime.cache import triton_key; info['triton_key'] = triton_key()[-16:]\n"
            "except Exception: pass\n"
            "if torch.cuda.is_available():\n"
            " p = torch.cuda.get_device_properties(0)\n"
            " info.update(device=p.name, capability=f'{p.major}.{p.minor}', sms=p.multi_processor_count,\n"
            "             memory_gib=round(p.total_memory / 2**30, 1), devices=torch.cuda.device_count())\n"
            "print(json.dumps(info))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:  # no torch at all
        return {"torch": None, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(proc.stdout)


def python_minor(info: dict) -> str:
    return ".".join(info["python"].split(".")[:2])


def stage_package(stage: Path, extension: Path | None = None) -> None:
    """pyembed/ + kernels/ as pyembed.kernels, as setup.py installs them, and ``extension``
    (a _C) beside them, if given; gpu_check builds or copies its own there. A stage without
    one imports another copy's -- an editable install's finder gives its _C to a package
    with none --, and gpu-prepare's warm-up failed on one older than this tree's Python
    (set_python_kernels' arguments)."""
    shutil.rmtree(stage, ignore_errors=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(ROOT / "pyembed", stage / "pyembed", ignore=ignore)
    shutil.copytree(ROOT / "kernels", stage / "pyembed" / "kernels", ignore=ignore)
    if extension is not None:
        shutil.copy2(extension, stage / "pyembed" / extension.name)


def prepare(out: Path, jobs: int) -> int:
    """Build, compile and pack into ``out`` (see the module's docstring)."""
    out.mkdir(parents=True, exist_ok=True)
    work = ROOT / "build" / "gpu-prepare-work"
    started, info = time.time(), stack()
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": ARCH, "PYEMBED_BUILD_CUDA": "1", "PYEMBED_ALLOW_OLD_TORCH": "1",
           "MAX_JOBS": str(jobs)}
    print(f"gpu-prepare: building pyembed._C for sm_{ARCH.replace('.', '')} against torch {info['torch']} ...",
          flush=True)
    with (out / "build.log").open("w") as log:
        subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", str(out), "--build-temp",
                        str(work / "temp")], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    (so,) = (out / "pyembed").glob("_C*.so")
    if shutil.which("strip"):  # debug info is most of its size (~40 MiB), and it travels
        subprocess.run(["strip", "--strip-debug", str(so)], check=True)

    # Triton's cache, kept here between runs: a kernel compiled before is a hit (its key
    # hashes its own source, so an edit elsewhere in kernels/ costs nothing), and emptied
    # when another Triton filled it. After the warm-up it keeps, and packs, only the kernels
    # of this tree's specialisations.
    cache, kernels = work / "triton-cache", sources_digest(kernel_sources())
    marker = cache / "pyembed-filled-by.json"
    filled_by = {"triton_key": info.get("triton_key")}
    if not marker.exists() or json.loads(marker.read_text()).get("triton_key") != filled_by["triton_key"]:
        shutil.rmtree(cache, ignore_errors=True)
    cache.mkdir(parents=True, exist_ok=True)
    used = work / "used-folders.json"
    used.unlink(missing_ok=True)
    # The kernels of this tree, whatever copy of pyembed this python has installed.
    stage_package(work / "stage", so)
    print(f"gpu-prepare: compiling the Triton specialisations for sm_90 into {cache} ({jobs} processes) ...",
          flush=True)
    warm = subprocess.run([sys.executable, str(ROOT / "tests" / "triton_specs.py"), "warm",
                           str(ROOT / "build" / "triton_specs.json"), str(jobs), "1e6", str(used)], cwd=work / "stage",
                          env={**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(work / "stage")},
                          capture_output=True, text=True)
    (out / "triton-warm.log").write_text(warm.stdout + warm.stderr)
    marker.write_text(json.dumps(filled_by))
    stale = prune_triton_cache(cache, set(json.loads(used.read_text())))
    entries = pack_triton_cache(cache, out / CACHE_TARBALL)

    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    prepared = {**info, "python": python_minor(info), "arch": ARCH, "commit": commit,
                "extension": sources_digest(extension_sources()), "so": str(so.relative_to(out)),
                "kernels": kernels, "triton_cache_entries": entries}
    (out / "prepared.json").write_text(json.dumps(prepared, indent=1) + "\n")
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file()) / 2**20
    summary = (warm.stdout.strip().splitlines() or ["the warm-up printed nothing"])[0]
    print(f"gpu-prepare: {out} ({size:.1f} MiB) in {time.time() - started:.0f} s: {so.name}; {summary}; "
          f"{stale} kernels of earlier sources dropped from the cache")
    return 0


def prune_triton_cache(cache: Path, used: set[str]) -> int:
    """Remove each kernel folder of ``cache`` not in ``used`` (the warm-up's: this tree's
    specialisations); how many. Nothing is removed, and it is an error, where ``used`` is
    empty (the warm-up compiled nothing) or names none of the folders (Triton names them
    otherwise than triton_specs.cache_folder thinks)."""
    folders = cache_entries(cache)
    if not used & folders:
        raise RuntimeError(f"none of the warm-up's {len(used)} kernel folders is in {cache} (its log: "
                           "triton-warm.log; has Triton's cache naming changed? tests/triton_specs.py cache_folder)")
    for name in folders - used:
        shutil.rmtree(cache / name)
    return len(folders - used)


def pack_triton_cache(cache: Path, tarball: Path) -> int:
    """Each compiled kernel's folder of ``cache`` into ``tarball`` (xz: Triton's text files
    pack ~20x); how many."""
    entries = sorted(cache_entries(cache))
    tarball.unlink(missing_ok=True)
    with tarfile.open(tarball, "w:xz") as tar:
        for name in entries:
            tar.add(cache / name, arcname=name)
    return len(entries)


# gpu-check's side: what of OUT it can use on the machine it runs on.

def load(prepared_dir: Path) -> dict | None:
    path = prepared_dir / "prepared.json"
    return json.loads(path.read_text()) if path.exists() else None


def extension_mismatch(prepared: dict, here: dict, arch: str) -> str | None:
    """Why the prepared extension cannot serve on this machine (``here``: stack()), or None."""
    wanted = {"torch": here["torch"], "cuda": here["cuda"], "python": python_minor(here), "arch": arch,
              "extension": sources_digest(extension_sources())}
    differing = [f"made for {key} {prepared.get(key)} (here {value})" if key != "extension" else
                 "the extension's sources changed since it was made" for key, value in wanted.items()
                 if prepared.get(key) != value]
    return "; ".join(differing) or None


def unpack_triton_cache(prepared_dir: Path, prepared: dict, here: dict, cache: Path) -> str:
    """Unpack the prepared kernels into ``cache`` (Triton's cache folder for every step) where
    this machine's Triton is the one they were compiled by; a line saying what was done."""
    if (prepared.get("triton"), prepared.get("triton_key")) != (here.get("triton"), here.get("triton_key")):
        return (f"Triton cache not used: compiled by Triton {prepared.get('triton')} "
                f"(key {prepared.get('triton_key')}), here {here.get('triton')} (key {here.get('triton_key')})")
    with tarfile.open(prepared_dir / CACHE_TARBALL) as tar:
        tar.extractall(cache, filter="data")
    # A group file names its members by absolute path, the folder they were compiled into.
    for group in cache.glob("*/__grp__*.json"):
        data = json.loads(group.read_text())
        data["child_paths"] = {name: str(group.parent / Path(path).name)
                               for name, path in data.get("child_paths", {}).items()}
        group.write_text(json.dumps(data))
    kernels = "the kernels as here" if prepared.get("kernels") == sources_digest(kernel_sources()) else \
        "kernels/ changed since: the changed ones compile here"
    return (f"Triton cache: {prepared.get('triton_cache_entries')} kernels compiled beforehand "
            f"(make gpu-prepare at {prepared.get('commit')}; {kernels})")


def cache_entries(cache: Path) -> set[str]:
    return {p.name for p in cache.iterdir() if p.is_dir()} if cache.exists() else set()


def compiled_since(cache: Path, before: set[str]) -> str:
    """A line naming the kernels compiled into ``cache`` since it held ``before``: by the
    name of their binary, pyembed's (``_..._kernel``) and the rest (Inductor's)."""
    names = {}
    for entry in sorted(cache_entries(cache) - before):
        for binary in (cache / entry).glob("*.cubin"):
            names[binary.stem] = names.get(binary.stem, 0) + 1
    ours = {name: n for name, n in names.items() if re.fullmatch(r"_\w+_kernel", name)}
    listed = ", ".join(f"{name} {n}" for name, n in sorted(ours.items(), key=lambda kv: -kv[1]))
    return (f"Triton kernels compiled in this run: {sum(ours.values())} of pyembed's"
            f"{f' ({listed})' if listed else ''}, {sum(names.values()) - sum(ours.values())} others (Inductor's)")


if __name__ == "__main__":
    sys.exit(prepare(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) > 2 else os.cpu_count() or 2))
