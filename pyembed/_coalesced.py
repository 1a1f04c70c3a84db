"""The sparse weight gradient stays flagged coalesced in ``.grad``.

pyembed's sparse gradient is built coalesced (sorted unique rows, flag set), but autograd's
AccumulateGrad rebuilds it from its indices and values without the flag when it stores it
as a parameter's ``.grad`` (pytorch/pytorch#105916, open). The optimizers that take a
sparse gradient then coalesce it again: ``SparseAdam`` and ``Adagrad`` call
``grad.coalesce()``, a sort and a copy of every value (on the 2-core dev VM, GPT-2 8x512:
SparseAdam's step takes 16.8 ms on the unflagged gradient, 14.7 ms on the flagged one; on a
GPU, coalescing also reads the new row count back to the host).

So ``_gradients`` remembers the storage of each sparse gradient's values it builds, and a
post-accumulate-grad hook on the table sets the flag back when ``.grad`` holds exactly
those values and indices: a gradient that was summed with another one (accumulation over
micro-batches, a second use of the table) has new storage and is left as autograd made it.
Storages, not tensors, are remembered: ``_values()`` returns a fresh alias every call,
while a storage's Python object lives exactly as long as the storage (so a dead gradient's
memory reused by another tensor never matches).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils.weak import WeakIdKeyDictionary

# values storage of a sparse gradient built by pyembed -> (weak reference to its indices' storage, its nnz)
_built: WeakIdKeyDictionary = WeakIdKeyDictionary()
# tables with the hook registered (one hook per table, however many calls)
_hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The C++ autograd node (csrc/autograd.cpp) records the gradients it builds itself: each
# function here says whether a .grad still holds one (pyembed._extension adds _C's).
built_elsewhere: list = []


def remember(grad: torch.Tensor) -> None:
    """Record a coalesced sparse gradient pyembed built. Plain eager tensors only: under
    torch.compile's tracing they are fakes, under torch.func wrappers without a storage,
    and neither kind reaches a ``.grad``."""
    if _transformed():
        return
    values, indices = grad._values(), grad._indices()
    if type(values) is torch.Tensor and type(indices) is torch.Tensor:
        _built[values.untyped_storage()] = (weakref.ref(indices.untyped_storage()), grad._nnz())


def keep_flag(weight: torch.Tensor) -> None:
    """Register (once per table) the hook that restores the coalesced flag of ``weight.grad``;
    only leaves get a ``.grad``, and only eager code registers hooks."""
    if _transformed() or not (weight.is_leaf and weight.requires_grad) or weight in _hooked:
        return
    _hooked[weight] = weight.register_post_accumulate_grad_hook(_restore_flag)


def _transformed() -> bool:
    """torch.compile is tracing, or a torch.func transform (grad, vmap) is active."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()


def _restore_flag(weight: torch.Tensor) -> None:
    grad = weight.grad
    if grad is None or not grad.is_sparse or grad.is_coalesced():
        return
    built = _built.get(grad._values().untyped_storage())
    if ((built is not None and built[0]() is grad._indices().untyped_storage() and built[1] == grad._nnz())
            or any(holds(grad) for holds in built_elsewhere)):
        grad._coalesced_(True)
