"""pyembed's forward ops written with ATen ops, for runtimes that run no custom op.

An exported program (``torch.export``) keeps pyembed's ops: AOTInductor and Python call
them. ONNX (``torch.onnx.export``), ExecuTorch or TensorRT know only ATen's, so decompose
them first::

    program = torch.export.export(model.eval(), (ids,))
    program = program.run_decompositions(pyembed.decompositions())
    onnx_program = torch.onnx.export(program)

Each op becomes what ``nn.Embedding`` exports to -- a row gather (``index_select``) --
times the scale, plus the positional term (a gather of the learned table, or the sinusoid
computed in the compute dtype), rounded once into the table's dtype, as DESIGN §1 says.
The range check (``pyembed::check_ranges``) becomes a copy of the ids: the gathers check
the ranges themselves, as the runtime checks ``nn.Embedding``'s (PyTorch's ``index_select``
raises an IndexError, ONNX Runtime's Gather an error; negative ids are wrapped by ONNX's
Gather, as for an exported ``nn.Embedding``). Inference graphs only: dropout (training)
is refused.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from . import reference


def decompositions() -> dict[torch._ops.OpOverload, Callable]:
    """{pyembed op: its ATen form} for every forward op this process registered (the C++
    backends' with the extension, triton's with triton), for
    ``ExportedProgram.run_decompositions``; merge it into
    ``torch.export.default_decompositions()`` to decompose ATen's own ops as well."""
    forms = {"embedding": _lookup_op, "embedding_forward": _forward_op, "reference_forward": _forward_op,
             "reference_lookup": _lookup_op, "triton_forward": _forward_op, "triton_lookup": _lookup_op,
             "sparse_grad_embedding": _sparse_grad_op, "check_ranges": _checked_ranges}
    return {getattr(torch.ops.pyembed, name).default: form for name, form in forms.items()
            if hasattr(torch.ops.pyembed, name)}


def _lookup(ids: torch.Tensor, weight: torch.Tensor, pos_weight: Optional[torch.Tensor],
            position_ids: Optional[torch.Tensor], pos_encoding: str, scale: float, offset: int, dropout_p: float,
            sinusoid_column_offset: int = 0, sinusoid_dim: int = 0) -> torch.Tensor:
    if dropout_p:
        raise NotImplementedError("pyembed: decompositions() are for inference graphs; export the model in eval "
                                  "mode (no dropout)")
    embed_dim = weight.shape[1]
    acc = reference.compute_dtype(weight.dtype)
    out = weight.index_select(0, ids.reshape(-1)).to(acc) * scale
    if pos_encoding != "none":
        positions = reference.token_positions(ids, position_ids, offset)
        if pos_encoding == "learned":
            out = out + pos_weight.index_select(0, positions).to(acc)
        else:
            out = out + reference.sinusoid(positions, sinusoid_dim or embed_dim, sinusoid_column_offset, embed_dim,
                                           dtype=acc)
    return out.to(weight.dtype).reshape(*ids.shape, embed_dim)


def _lookup_op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx, scale_grad_by_freq,
               validate=True, error_record=0, dropout_p=0.0, generator=None, sparse=False):
    # pyembed::embedding, triton_lookup, reference_lookup (padding_idx, scale_grad_by_freq and
    # sparse shape only the gradient; validate: the gathers check).
    return _lookup(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_p)


def _forward_op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p,
                sinusoid_column_offset=0, sinusoid_dim=0, error_record=0):
    # Every backend's forward op (reference.embedding_forward's schema).
    return _lookup(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset,
                   dropout_p if dropout_key is not None else 0.0, sinusoid_column_offset, sinusoid_dim)


def _sparse_grad_op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, padding_idx,
                    scale_grad_by_freq, backend, dropout_key, dropout_p, sinusoid_column_offset=0, sinusoid_dim=0,
                    error_record=0):
    # pyembed::sparse_grad_embedding (a compiled or exported call with sparse=True).
    return _forward_op(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, dropout_key, dropout_p,
                       sinusoid_column_offset, sinusoid_dim)


def _checked_ranges(ids, num_embeddings, position_ids, max_seq_len):
    return ids.clone()
