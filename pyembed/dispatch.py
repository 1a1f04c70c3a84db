"""Backend choice: the ``backend=`` argument, ``PYEMBED_BACKEND``, and availability.

A backend is three ops with the schemas of ``reference.embedding_forward``,
``reference.embedding_backward`` (dense) and ``reference.embedding_sparse_backward``,
plus a function saying why it cannot run on a device (``None`` when it can) and its
rank for "auto" per device type. Adding a backend is one ``register_backend`` call: the
registry holds no list of names (a loader that fails says why with ``mark_missing``).

Auto (DESIGN §2), by the registered ranks: CUDA tensors -> cuda, else triton, else
reference; CPU tensors -> cpu, else reference. Auto never raises for availability; an
explicitly requested backend that cannot run raises RuntimeError saying why.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import _ops, reference
from ._ops import Backend
from .checks import CUDAGRAPH_UNSAFE

ENV_VAR = "PYEMBED_BACKEND"


_registry: dict[str, Backend] = {}
# resolve()'s answers: availability does not change within a process (a device appears or
# a backend registers only at start-up), and finding it costs a one-token lookup ~2 us
# (torch.cuda.is_available and friends) of its ~10. An answer is used only while the
# registry still holds that very backend (a test may swap one in and out).
_resolved: dict[tuple[str, torch.device], Backend] = {}
# Why a backend could not be loaded (set by the code that tried: pyembed/_extension.py,
# pyembed/__init__.py), shown when it is asked for.
_missing_reason: dict[str, str] = {}


def __getattr__(name: str):
    if name == "BACKEND_NAMES":  # every backend this process knows of, registered or missing
        return tuple(_registry) + tuple(n for n in _missing_reason if n not in _registry)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_backend(backend: Backend) -> None:
    _registry[backend.name] = backend
    _missing_reason.pop(backend.name, None)
    _resolved.clear()  # "auto" may now pick it
    _ops.register_vmap_rules(backend.forward, backend.backward)


def mark_missing(name: str, reason: str) -> None:
    """Record why a known backend could not be loaded (shown when it is requested)."""
    if name not in _registry:
        _missing_reason[name] = reason


def _why_unavailable(name: str, device: torch.device) -> Optional[str]:
    if name not in _registry:
        return _missing_reason.get(name, "it is not registered")
    return _registry[name].why_unavailable(device)


def get(name: str) -> Backend:
    """The registered backend ``name`` (already resolved by ``resolve``)."""
    return _registry[name]


def backends_for(device) -> list[str]:
    """Backends that can run on tensors of ``device``."""
    device = torch.device(device)
    return [n for n in _registry if _why_unavailable(n, device) is None]


def available_backends() -> list[str]:
    """Backends that can run on at least one device present on this machine."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return [n for n in _registry if any(_why_unavailable(n, d) is None for d in devices)]


def why_unavailable(name: str) -> Optional[str]:
    """Why backend ``name`` runs on no device of this machine (None: it runs on one),
    asked on the device types it is meant for (its auto_rank's), where "it takes CUDA
    tensors, not cpu" would say nothing: `python -m pyembed.info` prints it."""
    if name in available_backends():
        return None
    device_types = [t for t in (_registry[name].auto_rank if name in _registry else ()) if t != "*"] or ["cpu"]
    return "; ".join(_why_unavailable(name, torch.device(t)) for t in device_types)


# os.environ's own mapping and its encoding of our key: os.environ.get encodes the key and
# decodes the value on every call, 0.5 us of a ~3 us one-token CPU lookup; a lookup in
# the mapping that os.environ updates on every assignment sees the same value for ~0.03 us.
_ENVIRON = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON is not None else None


def _requested_by_env() -> str:
    """PYEMBED_BACKEND as os.environ holds it now ("" when unset)."""
    if _ENVIRON is None:  # pragma: no cover - another Python's os.environ
        return os.environ.get(ENV_VAR, "")
    raw = _ENVIRON.get(_ENV_KEY)
    return "" if raw is None else os.environ.decodevalue(raw)


def resolve(requested: str, device: torch.device) -> Backend:
    """The backend to run for tensors on ``device``. ``requested`` is "auto" or a name;
    under "auto", a set PYEMBED_BACKEND counts as an explicit request (read every eager call;
    under torch.compile where the graph is traced: _compiled_choice)."""
    if torch.compiler.is_compiling():
        chosen = _compiled_choice(requested, device)
        if chosen is not None:
            return _registry[chosen]
        # (a request that cannot run: raised from traced code below, Dynamo breaks the graph
        # there and the call raises it eagerly, as it did before this choice was a constant)
    if requested == "auto":
        requested = _requested_by_env() or "auto"
    known = _resolved.get((requested, device))
    if known is not None and _registry.get(known.name) is known:
        return known
    chosen = _resolve(requested, device)
    _resolved[(requested, device)] = chosen
    return chosen


def _compiled_choice(requested: str, device: torch.device) -> Optional[str]:
    """resolve()'s answer under torch.compile, by name: Dynamo calls this once while tracing
    and keeps the name as a constant of the graph (torch.compiler.assume_constant_result's
    mark), guarding only on the registry entry it names. Traced, the environment read and
    the registry walk were ~40 of a compiled call's guards, one of them on os.environ's
    length: setting any environment variable recompiled every graph holding a pyembed call.
    PYEMBED_BACKEND is read when a graph is traced, as Dynamo reads os.environ itself."""
    if requested == "auto":
        requested = _requested_by_env() or "auto"
    try:
        return _resolve(requested, device).name
    except (RuntimeError, ValueError):
        return None


_compiled_choice._dynamo_marked_constant = True


def _resolve(requested: str, device: torch.device) -> Backend:
    if requested == "auto":
        ranked = []
        for backend in _registry.values():
            rank = backend.auto_rank.get(device.type, backend.auto_rank.get("*"))
            if rank is not None:
                ranked.append((rank, backend.name))
        for _, name in sorted(ranked):
            if _why_unavailable(name, device) is None:
                return _registry[name]
        raise AssertionError("the reference backend runs everywhere")  # unreachable
    if requested not in _registry and requested not in _missing_reason:
        known = list(__getattr__("BACKEND_NAMES"))
        raise ValueError(f"pyembed: unknown backend {requested!r}; expected 'auto' or one of {known}")
    if device.type == "meta" and requested in _registry:
        # Shapes only (a model built on the meta device): every backend's ops have the
        # reference's shapes, and the reference's torch ops run on meta tensors.
        return _registry["reference"]
    reason = _why_unavailable(requested, device)
    if reason is not None:
        raise RuntimeError(f"pyembed: backend {requested!r} cannot run on {device}: {reason}")
    return _registry[requested]


# The spec's three functions as opaque custom ops (torch.compile sees ops, not their bodies).
reference_forward = torch.library.custom_op(
    "pyembed::reference_forward", mutates_args=())(reference.embedding_forward)
reference_backward = torch.library.custom_op(
    "pyembed::reference_backward", mutates_args=())(reference.embedding_backward)
reference_sparse_backward = torch.library.custom_op(
    "pyembed::reference_sparse_backward", mutates_args=(), tags=CUDAGRAPH_UNSAFE)(reference.embedding_sparse_backward)
_ops.register_fakes("pyembed::reference_forward", "pyembed::reference_backward", "pyembed::reference_sparse_backward")


@torch.library.custom_op("pyembed::reference_lookup", mutates_args=())
def reference_lookup(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
                     position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int,
                     padding_idx: Optional[int], scale_grad_by_freq: bool, validate: bool,
                     error_record: int) -> torch.Tensor:
    """The plain call as torch.compile and torch.export record it (pyembed::embedding's
    schema; the Backend's compiled_op, pyembed.functional._compiled_lookup), as triton's
    pyembed::triton_lookup: one op with a backward (pyembed._autograd registers it), which an
    exported program keeps -- the general route's Function it inlines, its forward op
    without a backward. The caller checked the ranges: validate is False here."""
    return reference.embedding_forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, None, 0.0,
                                       0, 0, error_record)


# Functionalised (torch.compile's graphs) it is reference_forward, the op those graphs ran
# before it had this lookup op.
_ops.register_lookup_forms(reference_lookup, reference_forward)

register_backend(
    Backend(
        name="reference",
        forward=reference_forward,
        backward=reference_backward,
        sparse_backward=reference_sparse_backward,
        why_unavailable=lambda device: None,
        auto_rank={"*": 2},  # the spec: anywhere, when nothing faster can run
        compiled_op=torch.ops.pyembed.reference_lookup.default,
    )
)
