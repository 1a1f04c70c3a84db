"""Drop-in modules: ``FusedEmbedding`` (an ``nn.Embedding``) and ``EmbeddingLayer``
(token table + positional encoding + scaling in one fused op)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from .functional import embedding_renorm_, fused_embedding

_INIT_POS_STD = 0.02  # learned positions start small, as in GPT-2 / BERT


class FusedEmbedding(nn.Embedding):
    """``nn.Embedding`` served by pyembed's fused op. Same constructor, attributes,
    ``from_pretrained``, state_dict (key ``weight``) and ``isinstance``; adds ``scale``
    (multiplies the looked-up rows, e.g. ``math.sqrt(d)``) and ``backend``."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        _weight: Optional[torch.Tensor] = None,
        _freeze: bool = False,
        device=None,
        dtype=None,
        *,
        scale: float = 1.0,
        backend: str = "auto",
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, padding_idx, max_norm, norm_type,
            scale_grad_by_freq, sparse, _weight, _freeze, device, dtype,
        )
        self.scale = scale
        self.backend = backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if self.max_norm is not None:
            embedding_renorm_(self.weight, input, self.max_norm, self.norm_type)
        return fused_embedding(
            input, self.weight, scale=self.scale, padding_idx=self.padding_idx,
            scale_grad_by_freq=self.scale_grad_by_freq, sparse=self.sparse, backend=self.backend,
        )

    @classmethod
    def from_pretrained(
        cls,
        embeddings: torch.Tensor,
        freeze: bool = True,
        padding_idx: Optional[int] = None,
        max_norm: Optional[float] = None,
        norm_type: float = 2.0,
        scale_grad_by_freq: bool = False,
        sparse: bool = False,
        *,
        scale: float = 1.0,
        backend: str = "auto",
    ) -> "FusedEmbedding":
        if embeddings.dim() != 2:
            raise ValueError(f"pyembed: embeddings must be 2-D, got shape {tuple(embeddings.shape)}")
        rows, cols = embeddings.shape
        return cls(
            rows, cols, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse,
            _weight=embeddings, _freeze=freeze, scale=scale, backend=backend,
        )

    def extra_repr(self) -> str:
        s = super().extra_repr()
        if self.scale != 1.0:
            s += f", scale={self.scale:g}"
        if self.backend != "auto":
            s += f", backend={self.backend!r}"
        return s


class EmbeddingLayer(nn.Module):
    """The input layer of a transformer in one fused op:
    ``out = token_embedding.weight[ids] * (sqrt(d) if scale_embeddings else 1) + PE(positions)``,
    then dropout.

    pos_encoding: "learned" (a (max_seq_len, d) table, ``pos_embedding``), "sinusoidal"
    (computed on the fly, any length, nothing stored) or None. With ``sparse=True`` the
    token table's gradient is sparse; the positional table's stays dense (optimise it
    with a dense optimizer, as the rest of the model).
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        max_seq_len: int = 512,
        pos_encoding: Optional[str] = "learned",
        scale_embeddings: bool = False,
        *,
        padding_idx: Optional[int] = None,
        sparse: bool = False,
        dropout: float = 0.0,
        backend: str = "auto",
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        check_layer_pos_encoding(pos_encoding, embed_dim)
        self.vocab_size, self.embed_dim, self.max_seq_len = vocab_size, embed_dim, max_seq_len
        self.pos_encoding = pos_encoding
        self.scale_embeddings = scale_embeddings
        # sqrt(d) in float64; the kernels apply it as float32 (DESIGN §1).
        self.scale = math.sqrt(embed_dim) if scale_embeddings else 1.0
        self.backend = backend
        self.token_embedding = FusedEmbedding(
            vocab_size, embed_dim, padding_idx=padding_idx, sparse=sparse,
            device=device, dtype=dtype, backend=backend,
        )
        if pos_encoding == "learned":
            self.pos_embedding = nn.Parameter(torch.empty(max_seq_len, embed_dim, device=device, dtype=dtype))
            nn.init.normal_(self.pos_embedding, std=_INIT_POS_STD)
        else:
            self.register_parameter("pos_embedding", None)
        self.dropout = nn.Dropout(dropout)

    @classmethod
    def from_modules(cls, token: nn.Embedding, position: Optional[nn.Embedding] = None, *, scale: float = 1.0,
                     backend: str = "auto") -> "EmbeddingLayer":
        """One fused layer over a model's existing tables (GPT-2's ``wte`` / ``wpe``),
        sharing the *same* Parameters: ``token(ids) * scale + position(positions)``."""
        if position is not None and position.embedding_dim != token.embedding_dim:
            raise ValueError(f"pyembed: embedding dimension mismatch: token table has d={token.embedding_dim}, "
                             f"position table d={position.embedding_dim}")
        layer = cls(token.num_embeddings, token.embedding_dim,
                    position.num_embeddings if position is not None else 0,
                    "learned" if position is not None else None, device="meta", dtype=token.weight.dtype,
                    backend=backend)
        layer.token_embedding = _fused_from(token, backend)
        layer.pos_embedding = position.weight if position is not None else None
        layer.scale = scale
        return layer

    def forward(self, ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None, offset: int = 0) -> torch.Tensor:
        """ids: (B, T) or (T,) int32/int64 -> (B, T, d) / (T, d). position_ids: like ids;
        offset: first position when position_ids is None (incremental decoding)."""
        token = self.token_embedding
        out = fused_embedding(
            ids, token.weight, self.pos_embedding, pos_encoding=self.pos_encoding,
            scale=self.scale, position_ids=position_ids, offset=offset,
            padding_idx=token.padding_idx, scale_grad_by_freq=token.scale_grad_by_freq,
            sparse=token.sparse, backend=self.backend,
        )
        return self.dropout(out)

    def extra_repr(self) -> str:
        return (
            f"{self.vocab_size}, {self.embed_dim}, max_seq_len={self.max_seq_len}, "
            f"pos_encoding={self.pos_encoding!r}, scale_embeddings={self.scale_embeddings}, "
            f"backend={self.backend!r}"
        )


def check_layer_pos_encoding(pos_encoding: Optional[str], embed_dim: int) -> None:
    """The layers' constructor checks (the functional op checks the same per call)."""
    if pos_encoding not in (None, "learned", "sinusoidal"):
        raise ValueError(f"pyembed: pos_encoding must be None, 'learned' or 'sinusoidal', got {pos_encoding!r}")
    if pos_encoding == "sinusoidal" and embed_dim % 2:
        raise ValueError(f"pyembed: sinusoidal encoding requires an even embedding dim, got d={embed_dim}")


def replace_embeddings(model: nn.Module, *, backend: str = "auto") -> nn.Module:
    """Swap every ``nn.Embedding`` in ``model`` (in place) for a ``FusedEmbedding`` that
    shares the *same* Parameter object, so tied weights stay tied, optimizers already
    holding the Parameter keep working, and state_dict keys do not change. Returns model."""
    swapped: dict[int, FusedEmbedding] = {}  # a module reached by two paths is swapped once
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Embedding:
                continue
            if id(child) not in swapped:
                swapped[id(child)] = _fused_from(child, backend)
            setattr(parent, name, swapped[id(child)])
    return model


def _fused_from(old: nn.Embedding, backend: str) -> FusedEmbedding:
    # Built on the meta device so no (V, d) table is allocated, then given old's Parameter.
    new = FusedEmbedding(
        old.num_embeddings, old.embedding_dim, old.padding_idx, old.max_norm, old.norm_type,
        old.scale_grad_by_freq, old.sparse, device="meta", dtype=old.weight.dtype, backend=backend,
    )
    new.weight = old.weight
    new.train(old.training)
    return new
