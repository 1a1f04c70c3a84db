"""The ``triton`` backend: kernels in ``pyembed.kernels.embedding`` (top-level kernels/),
registered as ops so ``torch.compile`` sees them:

- ``pyembed::triton_forward``: a ``torch.library.triton_op`` launching the forward
  through ``wrap_triton``, so Inductor can trace the kernel itself (under the CPU
  interpreter, an opaque custom op: interpreted kernels cannot be traced);
- ``pyembed::triton_validate_ids``: the data checks (a host sync), an opaque custom op
  returning a copy of the ids, so validation never breaks a compiled graph;
- ``pyembed::triton_backward``: an opaque custom op (sorting gives data-dependent sizes).

Imported by pyembed/__init__.py only when the triton package exists; triton itself is
imported on first use, so ``import pyembed`` stays cheap. On CPU tensors
the backend runs only under ``TRITON_INTERPRET=1`` (how it is tested without a GPU).
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import dispatch, reference

_POS_MODES = {"none": 0, "learned": 1, "sinusoidal": 2}
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    from .kernels import embedding  # imports triton

    return embedding


def _why_unavailable(device: torch.device) -> Optional[str]:
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is visible"
    if device.type == "cpu":
        if _INTERPRETED:
            return None
        return "Triton runs on CPU tensors only under TRITON_INTERPRET=1 (set before triton is imported)"
    return f"the triton backend takes CUDA tensors, not {device.type}"


@torch.library.custom_op("pyembed::triton_validate_ids", mutates_args=())
def triton_validate_ids(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                        max_seq_len: int) -> torch.Tensor:
    """DESIGN §3 data checks; returns a copy of ids (custom ops may not return an input).
    max_seq_len < 0: positions are only checked for being >= 0 (sinusoidal)."""
    reference.check_ids_in_range(ids, num_embeddings)
    if position_ids is not None:
        reference.check_position_ids(position_ids, max_seq_len if max_seq_len >= 0 else None)
    return ids.clone()


@triton_validate_ids.register_fake
def _(ids, num_embeddings, position_ids, max_seq_len):
    return torch.empty_like(ids)


def _forward_impl(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
                  position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int) -> torch.Tensor:
    out = weight.new_empty(*ids.shape, weight.shape[1])
    mode = _POS_MODES[pos_encoding]
    _kernels().embedding_forward(
        ids.contiguous(), weight.contiguous(), pos_weight.contiguous() if mode == 1 else None,
        position_ids.long().contiguous() if (position_ids is not None and mode) else None,
        mode, scale, offset, out, launch=torch.library.wrap_triton,
    )
    return out


if _INTERPRETED:
    # Triton's interpreter runs kernels eagerly in Python on real data, so they cannot be
    # traced into a graph: there the forward is an opaque custom op (same name, schema).
    triton_forward = torch.library.custom_op("pyembed::triton_forward", mutates_args=())(_forward_impl)
    triton_forward.register_fake(
        lambda ids, weight, pos_weight, position_ids, pos_encoding, scale, offset: weight.new_empty(
            *ids.shape, weight.shape[1]))
else:
    triton_forward = torch.library.triton_op("pyembed::triton_forward", mutates_args=())(_forward_impl)


def forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, validate):
    """The backend's forward (schema of reference.embedding_forward)."""
    if validate:
        max_seq_len = pos_weight.shape[0] if pos_encoding == "learned" else -1
        ids = torch.ops.pyembed.triton_validate_ids(ids, weight.shape[0], position_ids, max_seq_len)
    return torch.ops.pyembed.triton_forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset)


@torch.library.custom_op("pyembed::triton_backward", mutates_args=())
def triton_backward(grad_out: torch.Tensor, ids: torch.Tensor, position_ids: Optional[torch.Tensor], offset: int,
                    num_embeddings: int, num_positions: int, scale: float, padding_idx: Optional[int],
                    scale_grad_by_freq: bool, sparse: bool, need_weight_grad: bool,
                    need_pos_grad: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    k = _kernels()
    dim = grad_out.shape[-1]
    dout = grad_out.contiguous().reshape(-1, dim)
    weight_rows = torch.empty(0, dtype=torch.long, device=grad_out.device)
    weight_values, pos_grad = grad_out.new_empty(0, dim), grad_out.new_empty(0, dim)
    if need_weight_grad:
        holder = {}

        def make_out(rows):
            holder["out"] = grad_out.new_empty(rows.numel(), dim) if sparse else grad_out.new_zeros(num_embeddings, dim)
            return holder["out"], not sparse

        rows = k.reduce_by_key(dout, ids, num_embeddings, -1 if padding_idx is None else padding_idx, scale,
                               scale_grad_by_freq, make_out)
        weight_values = holder["out"]
        if sparse:
            weight_rows = rows
    if need_pos_grad:
        pos_grad = grad_out.new_zeros(num_positions, dim)
        if position_ids is not None:
            k.reduce_by_key(dout, position_ids, num_positions, -1, 1.0, False, lambda rows: (pos_grad, True))
        elif ids.numel() > 0:
            seq_len = ids.shape[-1]
            k.batch_sum(dout, pos_grad, ids.numel() // seq_len, seq_len, min(max(num_positions - offset, 0), seq_len),
                        offset)
    return weight_rows, weight_values, pos_grad


triton_backward.register_fake(reference.backward_fake)

dispatch.register_backend(dispatch.Backend("triton", forward, torch.ops.pyembed.triton_backward, _why_unavailable))
