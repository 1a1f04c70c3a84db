"""Build for pyembed-kernels (import name ``pyembed``).

Metadata lives in pyproject.toml; this file adds what needs code: the package layout
(top-level ``kernels/`` installed as ``pyembed.kernels``) and the ``pyembed._C``
extension -- C++ CPU kernels always, CUDA kernels when a CUDA build of torch and a CUDA
toolkit are found (a GPU is *not* needed to build them; DESIGN §5).

Knobs: PYEMBED_BUILD_CUDA=0/1 (force off / on), TORCH_CUDA_ARCH_LIST (default
"8.0;9.0+PTX" when no GPU is visible), MAX_JOBS (parallel compile jobs).

The extension is built against the torch of the environment it is installed into, so
pip must not isolate the build (``pip install --no-build-isolation``): without torch
importable here, the build stops with that one instruction instead of a C++ error wall
or a silent reference-only install. Making an sdist needs no torch.
"""

import glob
import importlib.util
import os
import re
import subprocess
import sys

import setuptools
from setuptools import setup

MIN_TORCH = (2, 13)  # keep in step with pyproject.toml's dependency "torch>=2.13": the oldest torch tested
# (make test-compat). PYEMBED_ALLOW_OLD_TORCH=1 builds against an older one anyway, to test it
# (make gpu-check does, for the GPU machine's torch 2.11).
MIN_SETUPTOOLS = 77  # pyproject's SPDX `license = "..."` needs it (pip does not enforce it without isolation)
INSTALL_HINT = "pip install --no-build-isolation .   (in the pyembed checkout; pyembed-kernels is not on PyPI)"


def fail(message: str) -> None:
    sys.exit(f"pyembed-kernels: {message}")


def import_torch():
    """The environment's torch, or one clear message saying what to run."""
    if int(setuptools.__version__.split(".")[0]) < MIN_SETUPTOOLS:
        fail(f"building needs setuptools>={MIN_SETUPTOOLS} (found {setuptools.__version__}): "
             f"pip install 'setuptools>={MIN_SETUPTOOLS}', then {INSTALL_HINT}")
    try:
        import torch
    except ImportError:
        fail("the C++/CUDA kernels are compiled against the torch installed in your environment, and none is "
             f"importable here. Install torch>={'.'.join(map(str, MIN_TORCH))} first, then build without pip's "
             f"build isolation (an isolated build would compile against a different torch):\n    {INSTALL_HINT}")
    version = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    if version < MIN_TORCH and os.environ.get("PYEMBED_ALLOW_OLD_TORCH") != "1":
        fail(f"torch {torch.__version__} is older than the supported torch>={'.'.join(map(str, MIN_TORCH))}")
    return torch


def nvcc_major(cuda_home: str):
    out = subprocess.run([os.path.join(cuda_home, "bin", "nvcc"), "--version"], capture_output=True, text=True).stdout
    m = re.search(r"release (\d+)\.", out)
    return int(m.group(1)) if m else None


def load_helper(name: str):
    """pyembed/<name>.py, loaded by path: the package itself is not built yet."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyembed", f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_pyembed{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find_cuda_home():
    return load_helper("_cuda_home").find_cuda_home()


def want_cuda(torch, cuda_home):
    forced = os.environ.get("PYEMBED_BUILD_CUDA")
    if forced is not None:
        if forced == "1" and not (torch.version.cuda and cuda_home):
            fail("PYEMBED_BUILD_CUDA=1 but no CUDA build of torch or no CUDA toolkit was found")
        return forced == "1"
    if not (torch.version.cuda and cuda_home):
        return False
    # torch refuses to build with a toolkit of another major version than its own CUDA;
    # build the CPU kernels then, and say why (PYEMBED_BUILD_CUDA=1 still forces CUDA).
    toolkit, torch_major = nvcc_major(cuda_home), int(torch.version.cuda.split(".")[0])
    if toolkit != torch_major:
        print(f"pyembed-kernels: building the CPU kernels only: the CUDA toolkit at {cuda_home} is CUDA {toolkit}, "
              f"torch was built with CUDA {torch.version.cuda} (set PYEMBED_BUILD_CUDA=1 to try anyway)",
              file=sys.stderr)
        return False
    return True


def source_digest_file() -> str:
    """build/generated/source_digest.cpp: the digest of csrc/ as _C.source_digest, which
    import compares with a checkout's csrc/ (pyembed/_sources.py). Rewritten only when it
    changes, so a rebuild of an unchanged tree compiles nothing."""
    digest = load_helper("_sources").csrc_digest(os.path.dirname(os.path.abspath(__file__)))
    path = os.path.join("build", "generated", "source_digest.cpp")
    text = f'extern const char pyembed_source_digest[] = "{digest}";\n'
    if os.path.exists(path):
        with open(path) as f:
            if f.read() == text:
                return path
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
    return path


def extension_kwargs():
    cuda_home = find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # read when cpp_extension is imported
    torch = import_torch()
    from torch.utils import cpp_extension

    with_cuda = want_cuda(torch, cuda_home)
    # -fopenmp: at::parallel_for runs serially in a translation unit built without it.
    # The torch this is built against, recorded in _C (pyembed.build_info() shows it).
    cxx = ["-O3", "-fopenmp", f'-DPYEMBED_TORCH_VERSION="{torch.__version__}"']
    # The shared C++ runtime even where g++ would link its archive (pyembed/_libstdcxx.py).
    link = ["-fopenmp"] + load_helper("_libstdcxx").link_args()
    # Link order matters: the AVX2 and AVX-512 objects come last so inline functions shared
    # with the portable objects resolve to the portable copies (csrc/cpu/kernels_avx2.cpp).
    sources = [source_digest_file(), "csrc/pyembed.cpp", "csrc/autograd.cpp", "csrc/cpu/embedding_cpu.cpp",
               "csrc/cpu/kernels_base.cpp", "csrc/cpu/kernels_avx2.cpp", "csrc/cpu/kernels_avx512.cpp"]
    if not with_cuda:
        print(f"pyembed-kernels: building pyembed._C: {len(sources)} C++ files (CPU kernels: portable, AVX2, "
              "AVX-512); about 2 minutes on 2 cores", file=sys.stderr)
        ext = cpp_extension.CppExtension("pyembed._C", sources, extra_compile_args={"cxx": cxx},
                                         extra_link_args=link)
        return ext, cpp_extension

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "detected")
    print(f"pyembed-kernels: building pyembed._C: {len(sources)} C++ files and the CUDA kernels for "
          f"TORCH_CUDA_ARCH_LIST={arch_list}; about 4 minutes on 2 cores (PYEMBED_BUILD_CUDA=0: CPU kernels only, "
          "about 2). pip install -v shows each compile step.", file=sys.stderr)
    defines = ["-DPYEMBED_WITH_CUDA", f'-DPYEMBED_CUDA_ARCH_LIST="{arch_list}"',
               f'-DPYEMBED_CUDA_VERSION="{torch.version.cuda}"']
    nvcc = ["-O3", "-lineinfo", "-Xptxas", "-v"]  # -v: registers and spills in the build log
    ext = cpp_extension.CUDAExtension(
        "pyembed._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc + defines},
        extra_link_args=link,
    )
    return ext, cpp_extension


# Metadata-only commands (an sdist, egg_info / dist_info for pip) need no torch.
METADATA_ONLY = {"sdist", "egg_info", "dist_info", "--name", "--version"}
if METADATA_ONLY & set(sys.argv[1:]):
    ext_modules, cmdclass = [], {}
else:
    ext, cpp_extension = extension_kwargs()
    ext_modules, cmdclass = [ext], {"build_ext": cpp_extension.BuildExtension}
setup(
    packages=["pyembed", "pyembed.kernels"],
    package_dir={"pyembed": "pyembed", "pyembed.kernels": "kernels"},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
)
