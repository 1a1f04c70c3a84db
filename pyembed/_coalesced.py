"""The sparse weight gradient stays flagged coalesced in ``.grad``.

pyembed's sparse gradient is built coalesced (sorted unique rows, flag set), but autograd's
AccumulateGrad rebuilds it from its indices and values without the flag when it stores it
as a parameter's ``.grad`` (pytorch/pytorch#105916, open). The optimizers that take a
sparse gradient then coalesce it again: ``SparseAdam`` and ``Adagrad`` call
``grad.coalesce()``, a sort and a copy of every value (on the 2-core dev VM, GPT-2 8x512:
SparseAdam's step takes 16.8 ms on the unflagged gradient, 14.7 ms on the flagged one; on a
GPU, coalescing also reads the new row count back to the host).

So a table with a sparse gradient gets two hooks, once, around AccumulateGrad: a tensor
hook that notes the coalesced sparse gradient arriving (what autograd hands AccumulateGrad:
the sum of all the table's uses in the graph), whoever built it, and a post-accumulate-grad
hook that sets the flag back when ``.grad`` holds exactly its values and indices. Both run in
the same AccumulateGrad call, while the arriving gradient is alive, so their addresses say
it: a ``.grad`` summed with an earlier one (accumulation over micro-batches) or copied has
memory of its own, and is left as autograd made it. The hooks see the gradient whoever
built it -- pyembed's C++ node, its Python Function, or a torch.compile'd backward (which
runs no Python of pyembed's that could record it) -- so a compiled model's ``.grad`` keeps
the flag too. (Both hooks: ~4 us a sparse backward on the development VM.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils.weak import WeakIdKeyDictionary

# tables with the hooks registered (once per table, however many calls)
_hooked: WeakIdKeyDictionary = WeakIdKeyDictionary()


def keep_flag(weight: torch.Tensor) -> None:
    """Register (once per table) the hooks that keep the coalesced flag of ``weight.grad``.
    Only leaves get a ``.grad``; hooks are registered by code that runs eagerly: the call
    (eager routes) or the op a compiled call runs (pyembed::sparse_grad_embedding). Not on a
    fake table (FakeTensorMode): its gradient has no addresses to compare, perhaps no size."""
    if (_transformed() or isinstance(weight, FakeTensor) or not (weight.is_leaf and weight.requires_grad)
            or weight in _hooked):
        return
    arrived: list = []  # (values address, indices address, nnz) of the coalesced gradient arriving now

    def note_arrival(grad: Optional[torch.Tensor]) -> None:
        # None: a table whose optimizer ran in the backward (pyembed.optim) gets no gradient.
        arrived.clear()
        if grad is not None and grad.is_sparse and grad.is_coalesced():
            arrived.append((grad._values().data_ptr(), grad._indices().data_ptr(), grad._nnz()))

    def restore_flag(table: torch.Tensor) -> None:
        grad = table.grad
        if (arrived and grad is not None and grad.is_sparse and not grad.is_coalesced()
                and arrived[0] == (grad._values().data_ptr(), grad._indices().data_ptr(), grad._nnz())):
            grad._coalesced_(True)
        arrived.clear()

    _hooked[weight] = (weight.register_hook(note_arrival), weight.register_post_accumulate_grad_hook(restore_flag))


def _transformed() -> bool:
    """torch.compile is tracing, or a torch.func transform (grad, vmap) is active."""
    return torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
