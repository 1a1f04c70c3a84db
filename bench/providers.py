"""The implementations being compared. Adding one is one entry in ``providers()``.

- eager: the way models do it today -- nn.Embedding lookups, a multiply, an add (and a
  sinusoid read from a precomputed table buffer), then dropout when the case has one.
- compile: ``torch.compile`` of that same eager code.
- liger: Liger-Kernel's experimental Triton embedding (a lookup, with an atomic-add
  backward) in place of ``F.embedding``, the rest as eager; on a GPU, where
  ``liger_kernel`` is installed.
- pyembed-<backend>: ``pyembed.fused_embedding`` on each backend available here, default
  arguments (on a GPU the range check runs inside the kernel: no device->host sync); on a
  GPU also compile(pyembed-<backend>), the same layer under ``torch.compile`` -- how GPU
  users train -- beside ``compile`` of the nn ops.
- pyembed-<backend>-fused: the same layer, its tables trained by
  ``pyembed.apply_optimizer_in_backward`` (the optimizer runs inside the backward; no
  gradient is materialised): ``step`` cases only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

import pyembed
from pyembed import dispatch

from .cases import Case


@dataclass
class Tables:
    weight: torch.Tensor  # (V, d), requires_grad
    pos_weight: Optional[torch.Tensor]  # (max_seq_len, d) for learned positions
    sinusoid: Optional[torch.Tensor]  # (seq_len, d) buffer, for the unfused providers only
    positions: torch.Tensor  # (seq_len,) = arange


def eager_input_layer(ids, tables: Tables, scale: float, sparse: bool, dropout: float = 0.0, lookup=None):
    out = (F.embedding(ids, tables.weight, sparse=sparse) if lookup is None else lookup(ids, tables.weight)) * scale
    if tables.pos_weight is not None:
        out = out + F.embedding(tables.positions, tables.pos_weight)
    if tables.sinusoid is not None:
        out = out + tables.sinusoid
    return F.dropout(out, dropout) if dropout else out


class CompiledInputLayer:
    """torch.compile of a layer (the eager code by default), compiled afresh for every case
    (``reset``): one compiled function across cases would reach Dynamo's recompile limit
    after a few dtypes and shapes and then silently run eagerly for the rest."""

    def __init__(self, layer: Callable = eager_input_layer):
        self.layer = layer
        self.reset()

    def reset(self) -> None:
        torch._dynamo.reset()
        self.fn = torch.compile(self.layer)

    def __call__(self, ids, tables: Tables, scale: float, sparse: bool, dropout: float = 0.0):
        return self.fn(ids, tables, scale, sparse, dropout)


def fused_input_layer(backend: str, validate: bool = True):
    def run(ids, tables: Tables, scale: float, sparse: bool, dropout: float = 0.0):
        pos = "sinusoidal" if tables.sinusoid is not None else None
        return pyembed.fused_embedding(ids, tables.weight, tables.pos_weight, pos_encoding=pos, scale=scale,
                                       sparse=sparse, dropout_p=dropout, validate=validate, backend=backend)
    return run


@dataclass
class Provider:
    name: str
    fn: Callable  # fn(ids, tables, scale, sparse, dropout) -> (B, T, d)
    why_not: Callable[[Case], Optional[str]] = lambda case: None  # reason it cannot run a case
    reset: Optional[Callable[[], None]] = None  # called before every case (fresh compiled state)
    # Its tables' optimizer runs inside pyembed's backward (pyembed.apply_optimizer_in_backward).
    optimizer_in_backward: bool = False


def compiled_provider() -> Provider:
    compiled = CompiledInputLayer()
    return Provider("compile", compiled, reset=compiled.reset)


def liger_provider() -> Optional[Provider]:
    try:
        from liger_kernel.ops.experimental.embedding import LigerEmbeddingFunction
    except ImportError:
        return None

    def lookup(ids, weight):
        return LigerEmbeddingFunction.apply(weight, ids)

    def run(ids, tables: Tables, scale: float, sparse: bool, dropout: float = 0.0):
        return eager_input_layer(ids, tables, scale, sparse, dropout, lookup=lookup)
    return Provider("liger", run, lambda case: "no sparse gradient" if case.grad == "sparse" else None)


def providers(device: torch.device, include_reference: bool = False) -> list[Provider]:
    found = [
        Provider("eager", eager_input_layer),
        compiled_provider(),
    ]
    liger = liger_provider() if torch.device(device).type == "cuda" else None
    found += [liger] if liger is not None else []
    for backend in dispatch.backends_for(device):
        if backend == "reference" and not include_reference:
            continue  # the spec in code: slow by design, measured only on request
        found.append(Provider(f"pyembed-{backend}", fused_input_layer(backend)))
        found.append(Provider(f"pyembed-{backend}-fused", fused_input_layer(backend),
                              lambda case: None if case.mode == "step" else "the optimizer in the backward: step only",
                              optimizer_in_backward=True))
        if torch.device(device).type == "cuda":
            # GPU users compile their models: pyembed inside torch.compile, against `compile`.
            compiled = CompiledInputLayer(fused_input_layer(backend))
            found.append(Provider(f"compile(pyembed-{backend})", compiled, reset=compiled.reset))
    return found
