"""Loads the compiled ``pyembed._C`` extension and registers its backends.

``import pyembed`` never fails because the extension is missing or broken: it warns
once, says why, and the reference backend serves (DESIGN §5).
"""

from __future__ import annotations

import functools
import pathlib
import warnings

import torch

from . import _autograd, _ops, _sources, dispatch

# pyembed is installed from a checkout of its sources (it is not on PyPI).
REBUILD = "in the pyembed checkout: pip install --no-build-isolation --no-deps --force-reinstall ."
_PACKAGE_DIR = pathlib.Path(__file__).resolve().parent


def _checkout_root():
    """The checkout this pyembed is the source folder of (setup.py and csrc/ beside it), or
    None for an installed copy."""
    root = _PACKAGE_DIR.parent
    return root if (root / "setup.py").is_file() and (root / "csrc").is_dir() else None


def _stale_build(extension):
    """Why ``extension`` is not what the checkout's csrc/ builds now, or None: an extension
    built in place (pip install -e .) goes stale when a git pull or checkout changes the C++
    sources and nothing rebuilds it, and then its functions and ops may take other arguments
    than this Python passes -- an import that failed with a TypeError, or worse, a call
    that misread one. An installed copy was built from the sources it shipped with."""
    root = _checkout_root()
    if root is None or getattr(extension, "source_digest", None) == _sources.csrc_digest(root):
        return None
    return f"it was built from other C++ sources than {root / 'csrc'} holds now"


try:
    from . import _C
except Exception as exc:  # noqa: BLE001 - any load failure (missing .so, ABI, symbols)
    _C = None
    _load_error = f"{type(exc).__name__}: {exc}"
    if _checkout_root() is not None and not any(_PACKAGE_DIR.glob("_C*.so")):
        # Typically Python started inside the clone after a non-editable install, so the
        # folder shadows the installed copy.
        _load_error = f"{_PACKAGE_DIR} is the source folder of a checkout, with no extension built in it"
        warnings.warn(
            f"pyembed: imported from the source checkout {_PACKAGE_DIR} (Python looks in the current directory "
            "first), which has no compiled extension, so only the slow reference backend is available. An "
            "installed pyembed, if any, is hidden by it. Run from another directory, or build in place: "
            "pip install --no-build-isolation -e .",
            RuntimeWarning,
            stacklevel=2,
        )
    else:
        warnings.warn(
            f"pyembed: the compiled extension pyembed._C could not be loaded ({_load_error}); only the reference "
            f"backend is available (torch {torch.__version__} is installed; an 'undefined symbol' means _C was "
            f"built against another torch). Rebuild it against this torch: {REBUILD}",
            RuntimeWarning,
            stacklevel=2,
        )
else:
    _load_error = _stale_build(_C)
    if _load_error is not None:
        # Its ops stay registered (loading did that), but no backend calls them; only
        # pyembed::check_ranges, defined in Python, keeps its C++ kernel.
        _C = None
        warnings.warn(
            f"pyembed: pyembed._C is out of date ({_load_error}: a git pull or checkout since the build?), so it is "
            "not used: the cpu and cuda backends are unavailable (the reference backend serves) until it is "
            "rebuilt in place, in the checkout: pip install --no-build-isolation --no-deps -e .",
            RuntimeWarning,
            stacklevel=2,
        )
if _C is None:
    dispatch.mark_missing("cpu", f"pyembed._C could not be loaded ({_load_error})")
    dispatch.mark_missing("cuda", f"pyembed._C could not be loaded ({_load_error})")


def build_info() -> dict:
    """What this installation was built with, and the torch it runs with."""
    return {
        "torch": torch.__version__,
        "torch_built_against": (_C.torch_version or None) if _C is not None else None,
        "cpu_built": _C is not None,
        "cpu_isa": _C.cpu_isa() if _C is not None else None,
        "cuda_built": bool(_C is not None and _C.cuda_built),
        "cuda_version": (_C.cuda_version or None) if _C is not None else None,
        "cuda_arch_list": (_C.cuda_arch_list or None) if _C is not None else None,
    }


def _why_cpu_unavailable(device: torch.device):
    return None if device.type == "cpu" else f"the cpu backend takes CPU tensors, not {device.type}"


def _why_cuda_unavailable(device: torch.device):
    if device.type != "cuda":
        return f"the cuda backend takes CUDA tensors, not {device.type}"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    return None


if _C is not None and _C.torch_version and _C.torch_version != torch.__version__:
    # It loaded, so the symbols it uses exist; but torch's C++ ABI is only promised within
    # one build, so say which torch to rebuild against.
    warnings.warn(
        f"pyembed: pyembed._C was built against torch {_C.torch_version} but torch {torch.__version__} is "
        f"installed; if anything misbehaves, rebuild it against this torch: {REBUILD}",
        RuntimeWarning,
        stacklevel=2,
    )

if _C is not None:
    _ops.register_fakes("pyembed::embedding_forward", "pyembed::embedding_backward",
                        "pyembed::embedding_sparse_backward")
    torch.library.register_fake("pyembed::embedding")(_ops.lookup_fake)
    _backend_ops = (torch.ops.pyembed.embedding_forward, torch.ops.pyembed.embedding_backward,
                    torch.ops.pyembed.embedding_sparse_backward)
    # Eager callers take the ops through typed calls (_C's, csrc/pyembed.cpp): the dispatcher
    # without the boxed call's host time (the lookup, the general route's forward and dense
    # backward, the optimizer's ops, which run eagerly only); torch.compile traces the ops.
    _C.set_fused_step(_autograd.fused_step)  # what embedding_fused's node runs in its backward
    _lookup = dict(autograd_op=_C.embedding, fused_autograd_op=functools.partial(_C.embedding_fused, False),
                   compiled_op=torch.ops.pyembed.embedding.default, compiled_dropout=True,
                   eager_forward=_C.embedding_forward, eager_backward=_C.embedding_backward)
    _optimizer_ops = dict(touched_rows=_C.embedding_touched_rows, optimizer_update=_C.optimizer_update)
    dispatch.register_backend(dispatch.Backend("cpu", *_backend_ops, _why_cpu_unavailable, **_lookup, **_optimizer_ops,
                                               auto_rank={"cpu": 0}))
    if _C.cuda_built:
        dispatch.register_backend(dispatch.Backend("cuda", *_backend_ops, _why_cuda_unavailable, **_lookup,
                                                   checks_in_kernel=True, masks_as_it_reads=True, **_optimizer_ops,
                                                   optimizer_backward=_C.optimizer_backward,
                                                   position_update=_C.position_update,
                                                   auto_rank={"cuda": 0}))
    else:
        dispatch.mark_missing("cuda", "pyembed._C was built without CUDA kernels (at build time a CPU-only torch, no "
                                      "CUDA toolkit of torch's CUDA major version, or PYEMBED_BUILD_CUDA=0)")
