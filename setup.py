"""Build for pyembed-kernels (import name ``pyembed``).

Metadata lives in pyproject.toml; this file adds what needs code: the package layout
(top-level ``kernels/`` installed as ``pyembed.kernels``) and the ``pyembed._C``
extension -- C++ CPU kernels always, CUDA kernels when a CUDA build of torch and a CUDA
toolkit are found (a GPU is *not* needed to build them; DESIGN §5).

Knobs: PYEMBED_BUILD_CUDA=0/1 (force off / on), TORCH_CUDA_ARCH_LIST (default
"8.0;9.0+PTX" when no GPU is visible), MAX_JOBS (parallel compile jobs).
"""

import glob
import importlib.util
import os

from setuptools import setup


def find_cuda_home():
    # pyembed/_cuda_home.py, loaded by path: the package itself is not built yet.
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pyembed", "_cuda_home.py")
    spec = importlib.util.spec_from_file_location("_pyembed_cuda_home", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.find_cuda_home()


def want_cuda(torch, cuda_home):
    forced = os.environ.get("PYEMBED_BUILD_CUDA")
    if forced is not None:
        if forced == "1" and not (torch.version.cuda and cuda_home):
            raise RuntimeError("PYEMBED_BUILD_CUDA=1 but no CUDA build of torch or no CUDA toolkit was found")
        return forced == "1"
    return bool(torch.version.cuda and cuda_home)


def extension_kwargs():
    cuda_home = find_cuda_home()
    if cuda_home:
        os.environ["CUDA_HOME"] = cuda_home  # read when cpp_extension is imported
    import torch
    from torch.utils import cpp_extension

    with_cuda = want_cuda(torch, cuda_home)
    # -fopenmp: at::parallel_for runs serially in a translation unit built without it.
    cxx = ["-O3", "-fopenmp"]  # the C++ standard is cpp_extension's (C++20 for torch 2.14)
    # Link order matters: the AVX2 object comes last so inline functions shared with the
    # portable objects resolve to the portable copies (csrc/cpu/kernels_avx2.cpp).
    sources = ["csrc/pyembed.cpp", "csrc/cpu/embedding_cpu.cpp", "csrc/cpu/kernels_base.cpp",
               "csrc/cpu/kernels_avx2.cpp"]
    if not with_cuda:
        ext = cpp_extension.CppExtension("pyembed._C", sources, extra_compile_args={"cxx": cxx},
                                         extra_link_args=["-fopenmp"])
        return ext, cpp_extension

    if not os.environ.get("TORCH_CUDA_ARCH_LIST") and not torch.cuda.is_available():
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0;9.0+PTX"
    arch_list = os.environ.get("TORCH_CUDA_ARCH_LIST", "detected")
    defines = ["-DPYEMBED_WITH_CUDA", f'-DPYEMBED_CUDA_ARCH_LIST="{arch_list}"',
               f'-DPYEMBED_CUDA_VERSION="{torch.version.cuda}"']
    nvcc = ["-O3", "-lineinfo", "-Xptxas", "-v"]  # -v: registers and spills in the build log
    ext = cpp_extension.CUDAExtension(
        "pyembed._C",
        sources + sorted(glob.glob("csrc/cuda/*.cu")),
        extra_compile_args={"cxx": cxx + defines, "nvcc": nvcc + defines},
        extra_link_args=["-fopenmp"],
    )
    return ext, cpp_extension


ext, cpp_extension = extension_kwargs()
setup(
    packages=["pyembed", "pyembed.kernels"],
    package_dir={"pyembed": "pyembed", "pyembed.kernels": "kernels"},
    ext_modules=[ext],
    cmdclass={"build_ext": cpp_extension.BuildExtension},
)
