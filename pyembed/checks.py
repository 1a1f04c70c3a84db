"""Data checks of DESIGN §3: id and position ranges, for every backend.

They read the data (a device->host sync on a GPU), so they live in one op of their own,
``pyembed::check_ranges``, tagged ``torch.Tag.cudagraph_unsafe``; the kernels' ops then
never sync and can be captured in a CUDA graph (``torch.compile(mode="reduce-overhead")``)
when ``validate=False``. All extremes come back to the host in one transfer.
"""

from __future__ import annotations

from typing import Optional

import torch

# Ops that synchronise with the host carry this tag (torch >= 2.8 knows it), so Inductor
# keeps them out of CUDA graphs instead of crashing at capture.
CUDAGRAPH_UNSAFE = (torch.Tag.cudagraph_unsafe,) if hasattr(torch.Tag, "cudagraph_unsafe") else ()

NO_VALUE = -(2**62)  # the extreme of an empty tensor: below every real -min / max


# Code written for nn.Embedding catches RuntimeError for bad arguments (PyTorch's class for
# a wrong dtype, shape or device); pyembed's errors are also of the specific kind.
class InputTypeError(TypeError, RuntimeError):
    """A wrong dtype or type (PyTorch raises RuntimeError for the same input)."""


class InputValueError(ValueError, RuntimeError):
    """A wrong shape, device or value (PyTorch raises RuntimeError for the same input)."""


def range_extremes(ids: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
    """(4,) int64 on the ids' device: [-min id, max id, -min position, max position],
    NO_VALUE for an empty or absent tensor. Maxima only, so that ranks can combine them
    with one all-reduce(MAX) (pyembed.parallel)."""
    parts = []
    for t in (ids, position_ids):
        if t is None or t.numel() == 0:
            parts.append(torch.full((2,), NO_VALUE, dtype=torch.long, device=ids.device))
        else:
            lo, hi = torch.aminmax(t)
            parts.append(torch.stack((-lo.long(), hi.long())))
    return torch.cat(parts)


def raise_for_extremes(extremes: list[int], num_embeddings: int, max_seq_len: Optional[int]) -> None:
    """IndexError for an id outside [0, V); ValueError for a negative position or one past
    a learned table's max_seq_len (None: no upper bound). Messages name the offenders."""
    neg_lo_id, hi_id, neg_lo_pos, hi_pos = extremes
    if hi_id != NO_VALUE and (-neg_lo_id < 0 or hi_id >= num_embeddings):
        raise IndexError(
            f"pyembed: ids out of range: min id {-neg_lo_id}, max id {hi_id}, but the embedding "
            f"table has V={num_embeddings} rows (valid ids are 0..{num_embeddings - 1})"
        )
    if hi_pos == NO_VALUE:
        return
    if -neg_lo_pos < 0:
        raise InputValueError(f"pyembed: position_ids must be >= 0, got min position {-neg_lo_pos}")
    if max_seq_len is not None and hi_pos >= max_seq_len:
        raise InputValueError(
            f"pyembed: position {hi_pos} is out of range for the learned positional table "
            f"with max_seq_len={max_seq_len}"
        )


# Values per tensor copied to the host as they are rather than reduced on the device first
# (as csrc/checks.h): on a GPU each launch costs the waiting host microseconds.
_COPIED_AS_IS = 64


def transferred_bounds(tensors: list[Optional[torch.Tensor]]) -> list[Optional[list[int]]]:
    """[min, max] of each tensor (None for None) with one device->host transfer and few
    launches: on a GPU the host waits for these values anyway (the sync validate=False
    skips), and each launch costs it microseconds. Small tensors travel as they are,
    larger ones as their device-side aminmax."""
    parts = [None if t is None else
             (t.reshape(-1) if t.numel() <= _COPIED_AS_IS else torch.stack(torch.aminmax(t))).long()
             for t in tensors]
    present = [part for part in parts if part is not None]
    values = (present[0] if len(present) == 1 else torch.cat(present)).tolist() if present else []
    bounds = []
    for part in parts:
        if part is None:
            bounds.append(None)
        else:
            taken, values = values[:part.numel()], values[part.numel():]
            bounds.append([min(taken), max(taken)])
    return bounds


def check_ranges_eager(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                       max_seq_len: Optional[int]) -> None:
    """Every range check with one device->host transfer."""
    if position_ids is None and ids.numel() == 1 and 0 <= ids.item() < num_embeddings:
        return  # one token (decoding): one item() is ~0.3 us of a ~10 us lookup; aminmax + int() ~3 us
    tensors = [t if t is not None and t.numel() else None for t in (ids, position_ids)]
    if ids.device.type == "cpu":  # nothing is transferred: the fewest ops win (a one-token lookup is ~10 us)
        bounds = [None if t is None else [int(v) for v in torch.aminmax(t)] for t in tensors]
    else:
        bounds = transferred_bounds(tensors)
    extremes = []
    for bound in bounds:
        extremes += [NO_VALUE, NO_VALUE] if bound is None else [-bound[0], bound[1]]
    raise_for_extremes(extremes, num_embeddings, max_seq_len)


@torch.library.custom_op("pyembed::check_ranges", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def check_ranges_op(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                    max_seq_len: int) -> torch.Tensor:
    """The range checks as an op a compiled graph keeps: returns a copy of ids (a custom
    op may not return an input), which the lookup then reads, so it is never dropped or
    reordered. max_seq_len < 0: positions are only checked for being >= 0."""
    check_ranges_eager(ids, num_embeddings, position_ids, max_seq_len if max_seq_len >= 0 else None)
    return ids.clone()


@check_ranges_op.register_fake
def _(ids, num_embeddings, position_ids, max_seq_len):
    return torch.empty_like(ids)


@check_ranges_op.register_vmap
def _(info, in_dims, ids, num_embeddings, position_ids, max_seq_len):
    # The checks hold for every sample at once: check the whole batched tensors.
    check_ranges_eager(ids, num_embeddings, position_ids, max_seq_len if max_seq_len >= 0 else None)
    return ids.clone(), in_dims[0]


def checked_ids(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                max_seq_len: Optional[int]) -> torch.Tensor:
    """ids, after the range checks. Eagerly the checks run in place (no copy); under
    torch.compile, and on torch.func's wrapped tensors (vmap cannot read values back),
    through the op, which the graph holds and which has a vmap rule."""
    if torch.compiler.is_compiling() or torch._C._functorch.is_functorch_wrapped_tensor(ids):
        return torch.ops.pyembed.check_ranges(ids, num_embeddings, position_ids,
                                              -1 if max_seq_len is None else max_seq_len)
    check_ranges_eager(ids, num_embeddings, position_ids, max_seq_len)
    return ids


def check_ids_in_range(ids: torch.Tensor, num_embeddings: int) -> None:
    """IndexError naming the offending min/max and V (e.g. before max_norm's renorm)."""
    check_ranges_eager(ids, num_embeddings, None, None)
