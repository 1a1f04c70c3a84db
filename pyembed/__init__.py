"""pyembed: the transformer input layer (token lookup, scaling, positional addition)
as one fused op, forward and backward, with a backward that touches only used rows.

    out = fused_embedding(ids, weight, pos_weight, scale=math.sqrt(d))
    layer = EmbeddingLayer(vocab_size, d, max_seq_len, pos_encoding="sinusoidal")
    emb = FusedEmbedding(vocab_size, d)          # a drop-in nn.Embedding
    pyembed.parallel.VocabParallelEmbeddingLayer  # the token table split over ranks
"""

__version__ = "0.1.0"

import importlib as _importlib
import importlib.util as _importlib_util

from ._decompositions import decompositions
from ._extension import build_info
from .checks import check_errors
from .dispatch import available_backends
from .functional import fused_embedding
from .modules import EmbeddingLayer, FusedEmbedding, replace_embeddings
from .optim import apply_optimizer_in_backward
from .reference import sinusoidal_table

if _importlib_util.find_spec("triton") is not None:
    from . import _triton  # noqa: F401  (registers the triton backend)
else:
    from .dispatch import mark_missing as _mark_missing

    _mark_missing("triton", "the triton package is not installed")

from . import parallel  # noqa: E402  (pyembed.parallel.*)


def __getattr__(name: str):
    # pyembed.analysis, imported when first used: imported here, `python -m pyembed.analysis`
    # found it in sys.modules before running it and warned (RuntimeWarning) at every command.
    if name == "analysis":
        return _importlib.import_module(f"{__name__}.analysis")
    raise AttributeError(f"module 'pyembed' has no attribute {name!r}")

__all__ = [
    "EmbeddingLayer",
    "FusedEmbedding",
    "apply_optimizer_in_backward",
    "available_backends",
    "build_info",
    "check_errors",
    "decompositions",
    "fused_embedding",
    "replace_embeddings",
    "sinusoidal_table",
]
