"""The sparse weight gradient stays flagged coalesced in ``.grad``.

pyembed's sparse gradient is built coalesced (sorted unique rows, flag set), but autograd's
AccumulateGrad rebuilds it from its indices and values without the flag when it stores it
as a parameter's ``.grad`` (pytorch/pytorch#105916, open). The optimizers that take a
sparse gradient then coalesce it again: ``SparseAdam`` and ``Adagrad`` call
``grad.coalesce()``, a sort and a copy of every value (on the 2-core dev VM, GPT-2 8x512:
SparseAdam's step takes 16.8 ms on the unflagged gradient, 14.7 ms on the flagged one; on a
GPU, coalescing also reads the new row count back to the host).

So a table with a sparse gradient gets two hooks, once: a tensor hook that remembers the
storage of each coalesced sparse gradient arriving at the table (what autograd hands
AccumulateGrad: the sum of all the table's uses in the graph), and a post-accumulate-grad
hook that sets the flag back when ``.grad`` holds exactly those values and indices. A
gradient summed into an earlier ``.grad`` (accumulation over micro-batches) has new storage
and is left as autograd made it. The hooks see the gradient whoever built it -- pyembed's C++
node, its Python Function, or a torch.compile'd backward (which runs no Python of pyembed's
that could record it) -- so a compiled model's ``.grad`` keeps the flag too.

Storages, not tensors, are remembered: ``_values()`` returns a fresh alias every call,
while a storage's Python object lives exactly as long as the storage (so a dead gradient's
memory reused by another tensor never matches).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

# values storage of a coalesced sparse gradient that reached a hooked table -> (weak
# reference to its indices' storage, its nnz)
_arrived: WeakIdKeyDictionary = WeakIdKeyDictionary()
# tables with the hooks registered (once per table, however many calls)
_hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_flag(weight: torch.Tensor) -> None:
    """Register (once per table) the hooks that keep the coalesced flag of ``weight.grad``.
    Only leaves get a ``.grad``; hooks are registered by code that runs eagerly: the call
    (eager routes) or the op a compiled call runs (pyembed::sparse_grad_embedding)."""
    if _transformed() or not (weight.is_leaf and weight.requires_grad) or weight in _hooked:
        return
    _hooked[weight] = (weight.register_hook(_remember_arrival),
                       weight.register_post_accumulate_grad_hook(_restore_flag))


def _transformed() -> bool:
    """torch.compile is tracing, or a torch.func transform (grad, vmap) is active."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _remember_arrival(grad: Optional[torch.Tensor]) -> None:
    # None: a table whose optimizer ran in the backward (pyembed.optim) gets no gradient.
    if grad is not None and grad.is_sparse and grad.is_coalesced():
        values, indices = grad._values(), grad._indices()
        if type(values) is torch.Tensor and type(indices) is torch.Tensor:  # not a torch.func wrapper
            _arrived[values.untyped_storage()] = (weakref.ref(indices.untyped_storage()), grad._nnz())


def _restore_flag(weight: torch.Tensor) -> None:
    grad = weight.grad
    if grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    arrived = _arrived.get(grad._values().untyped_storage())
    if arrived is not None and arrived[0]() is grad._indices().untyped_storage() and arrived[1] == grad._nnz():
        grad._coalesced_(True)
