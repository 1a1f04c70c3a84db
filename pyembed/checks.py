"""Data checks of DESIGN §3: id and position ranges, two ways.

- In the call (CPU tensors by default, ``validate="sync"`` anywhere): they read the data
  (a device->host sync on a GPU), so under torch.compile they are one op of their own,
  ``pyembed::check_ranges``, tagged ``torch.Tag.cudagraph_unsafe``. All extremes come back
  to the host in one transfer.
- Inside the forward kernel (``validate=True`` on CUDA tensors, the cuda and triton
  backends): no sync; the kernel records a bad id into an error record in host memory and
  the next call raises it (the second half of this file). The kernels' ops then never sync
  and can be captured in a CUDA graph (``torch.compile(mode="reduce-overhead")``).
"""

from __future__ import annotations

import ctypes
import sys
from typing import NamedTuple, Optional

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
    if ids.device.type == "meta":
        return  # no values to check, none to read or write: shapes only, as F.embedding on meta
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


# pyembed::check_ranges: the range checks as an op a compiled graph keeps. It returns a copy
# of ids (an op may not return an input), which the lookup then reads, so it is never
# dropped or reordered. max_seq_len < 0: positions are only checked for being >= 0.
# Defined here with the body below for every device (so it runs without the compiled
# extension); csrc/pyembed.cpp registers its CPU and CUDA kernels, which a compiled graph
# calls without entering Python: through torch.library.custom_op the op cost ~16 us a call
# on the development VM (a Python autograd layer, then this body's ~4 us).
_LIB = torch.library.Library("pyembed", "FRAGMENT")
_LIB.define("check_ranges(Tensor ids, int num_embeddings, Tensor? position_ids, int max_seq_len) -> Tensor",
            tags=CUDAGRAPH_UNSAFE)


def _check_ranges_body(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                       max_seq_len: int) -> torch.Tensor:
    check_ranges_eager(ids, num_embeddings, position_ids, max_seq_len if max_seq_len >= 0 else None)
    return ids.clone()


_LIB.impl("check_ranges", _check_ranges_body, "CompositeExplicitAutograd")


@torch.library.register_fake("pyembed::check_ranges", lib=_LIB)
def _(ids, num_embeddings, position_ids, max_seq_len):
    return torch.empty_like(ids)


@torch.library.register_vmap("pyembed::check_ranges", lib=_LIB)
def _(info, in_dims, ids, num_embeddings, position_ids, max_seq_len):
    # The checks hold for every sample at once: check the whole batched tensors.
    return _check_ranges_body(ids, num_embeddings, position_ids, max_seq_len), in_dims[0]


# pyembed::checked_by_extremes: raise_for_extremes as an op a compiled graph keeps (the
# extremes read on the host: data a graph cannot branch on), for extremes agreed across
# ranks (pyembed.parallel). Returns a copy of ids, which the lookup reads, as check_ranges.
_LIB.define("checked_by_extremes(Tensor ids, Tensor extremes, int num_embeddings, int max_seq_len) -> Tensor",
            tags=CUDAGRAPH_UNSAFE)


def _checked_by_extremes_body(ids: torch.Tensor, extremes: torch.Tensor, num_embeddings: int,
                              max_seq_len: int) -> torch.Tensor:
    raise_for_extremes(extremes.tolist(), num_embeddings, max_seq_len if max_seq_len >= 0 else None)
    return ids.clone()


_LIB.impl("checked_by_extremes", _checked_by_extremes_body, "CompositeExplicitAutograd")


@torch.library.register_fake("pyembed::checked_by_extremes", lib=_LIB)
def _(ids, extremes, num_embeddings, max_seq_len):
    return torch.empty_like(ids)


def traced_or_fake() -> bool:
    """Whether this call runs on tensors without values outside torch.compile: make_fx's
    proxy tensors recording a graph (torch.func.linearize traces so, as do direct make_fx
    users), or FakeTensorMode propagating shapes (memory and runtime estimators, as
    torch.distributed._tools' MemTracker; nn.Embedding's calls work there). The
    dispatcher's ops alone see such a call: a check run in Python or in a C++ autograd node
    reads values fake tensors lack (or happens at trace time only), and a kernel launched
    around the dispatcher is missing from a graph. ~0.06 us where no dispatch mode is active."""
    return torch._C._len_torch_dispatch_stack() > 0 and (
        torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
        or torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None)


def checked_ids(ids: torch.Tensor, num_embeddings: int, position_ids: Optional[torch.Tensor],
                max_seq_len: Optional[int]) -> torch.Tensor:
    """ids, after the range checks. Eagerly the checks run in place (no copy); under
    torch.compile, torch.jit.trace, make_fx and FakeTensorMode (traced_or_fake), and on
    torch.func's wrapped tensors (vmap cannot read values back), through the op, which the
    graph or trace holds and which has a vmap rule and a fake implementation."""
    if (torch.compiler.is_compiling() or torch.jit.is_tracing() or traced_or_fake()
            or torch._C._functorch.is_functorch_wrapped_tensor(ids)):
        return torch.ops.pyembed.check_ranges(ids, num_embeddings, position_ids,
                                              -1 if max_seq_len is None else max_seq_len)
    check_ranges_eager(ids, num_embeddings, position_ids, max_seq_len)
    return ids


# ----------------------------------------------------------------- checks inside the kernels
# On a GPU the default check (validate=True) runs inside the forward kernel: waiting for the
# device to say whether the ids were in range would cost a device->host sync per call, more
# than the lookup itself. A kernel that meets an out-of-range id or position gives it a zero
# row (no out-of-bounds access) and writes what it saw into a small error record in pinned
# host memory, which the GPU writes directly (mapped, unified addressing): no copy, no extra
# launch. The next forward on that device reads the record -- a host memory read, no sync --
# and raises the IndexError / ValueError there; check_errors() synchronises and raises it at
# once. The CUDA context stays usable (a device-side assert, PyTorch's way, would poison it).
# The kernels take the record as an integer address: a graph-constant int under
# torch.compile, and a pointer whose stores no functionalisation pass mistakes for a write
# to one of the op's tensors.
#
# Layout (int64): [0] 1 when an id was out of range, [1] one such id, [2] that table's V,
# [3] 1 when a position was, [4] one such position, [5] that learned table's max_seq_len
# (-1: sinusoidal, where only a negative position is wrong). Threads store without atomics:
# any offending value serves the message. csrc/checks.h reads the same layout.
ERROR_RECORD_SLOTS = 8
KERNEL_CHECKED_DEVICES = ("cuda",)  # where validate=True means the in-kernel check
class ErrorRecord(NamedTuple):
    memory: torch.Tensor  # (ERROR_RECORD_SLOTS,) int64, owned here for the process's life
    view: "ctypes.Array"  # the same memory, read without a tensor op (~0.1 us)
    address: int  # what the kernels take


_error_records: dict[torch.device, ErrorRecord] = {}


def error_record_address(device: torch.device) -> int:
    """The address of ``device``'s error record (made on first use), which the forward
    kernels of the cuda and triton backends take as ``error_record``."""
    record = _error_records.get(device)
    if record is None:
        # Host memory the device writes through its own address: pinned memory is mapped
        # for every GPU under unified addressing. A CPU device (kernels run by the Triton
        # interpreter or the CUDA host emulation, in the tests) gets plain memory.
        memory = torch.zeros(ERROR_RECORD_SLOTS, dtype=torch.long, pin_memory=device.type == "cuda")
        address = memory.data_ptr()
        record = ErrorRecord(memory, (ctypes.c_int64 * ERROR_RECORD_SLOTS).from_address(address), address)
        _error_records[device] = record
    return record.address


# Under torch.compile the address is a constant of the graph, taken when it is traced (the
# record is made then, eagerly, never as a graph op). This is the mark that
# torch.compiler.assume_constant_result sets; setting it directly keeps Dynamo's import
# (about a second) out of `import pyembed`.
error_record_address._dynamo_marked_constant = True


def raise_pending_error(device: torch.device) -> None:
    """Raise (and clear) what a kernel on ``device`` recorded since the last call: an
    IndexError for an id, a ValueError for a position. Reads host memory only (~0.1 us)."""
    record = _error_records.get(device)
    if record is None:
        return
    view = record.view
    if view[0] or view[3]:
        found = list(view)
        ctypes.memset(view, 0, ctypes.sizeof(view))
        raise deferred_error(device, found)


def from_cpp(error: Exception) -> Exception:
    """A C++ op's error as pyembed raises it: bad input (a message of pyembed's own, from
    csrc/checks.h) as pyembed's exception classes, which are also the RuntimeError PyTorch
    raises; anything else (out of memory, a CUDA error, a NotImplementedError) as it is."""
    message = str(error)
    if not message.startswith("pyembed:") or isinstance(
            error, (IndexError, InputTypeError, InputValueError, NotImplementedError)):
        return error
    if isinstance(error, TypeError):
        return InputTypeError(message)
    return InputValueError(message)


DEFERRED_MARK = "in an earlier call on"  # in the message of every deferred error (csrc/checks.h too)


def deferred_error(device, found: list[int]) -> Exception:
    """The exception for a filled error record (the message csrc/checks.h writes too)."""
    hint = ("; nothing was read out of bounds (such an id got a zero row, such a learned position no positional "
            "term). The check ran inside the kernel, so the host did not wait for it: validate='sync' raises in the "
            "call itself, pyembed.check_errors() after a synchronize")
    if found[0]:
        return IndexError(f"pyembed: ids out of range {DEFERRED_MARK} {device}: id {found[1]}, but the "
                          f"embedding table has V={found[2]} rows (valid ids are 0..{found[2] - 1}){hint}")
    wanted = ">= 0" if found[5] < 0 else f"in 0..{found[5] - 1} (the learned table's max_seq_len={found[5]})"
    return InputValueError(f"pyembed: position out of range {DEFERRED_MARK} {device}: position {found[4]}, "
                           f"positions must be {wanted}{hint}")


def check_errors(device=None, *, wait: bool = True) -> None:
    """Wait for ``device`` (default: every device a pyembed kernel has checked ids on) and
    raise what the kernels' range checks recorded: validate=True on a GPU checks inside the
    kernels and reports at the next call; this reports now. IndexError for an id,
    ValueError for a position. ``wait=False``: no synchronisation, only what the kernels
    that have already run recorded (a host memory read, ~0.1 us) -- cheap enough for every
    step of a loop whose forwards never raise themselves (a `triton` layer under
    torch.compile, whose kernels the graph launches directly; a replayed CUDA graph)."""
    if device is None:
        devices = list(_error_records)
    else:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        devices = [device]
    for each in devices:
        if wait and each.type == "cuda":
            torch.cuda.synchronize(each)
        raise_pending_error(each)


def is_foreign_subclass(table) -> bool:
    """A table that is a tensor subclass with a dispatch of its own which pyembed's ops do not
    know: torchao's quantized tensors (``quantize_`` swaps a FusedEmbedding's weight as it
    does nn.Embedding's, both being nn.Embeddings), or any wrapper that implements ATen's
    embedding (pyembed.functional._foreign_table_lookup). DTensor has pyembed's sharding
    rules, and the fake and functional tensors of torch's tracers run every op registered
    with a fake."""
    if table is None or type(table) in (torch.Tensor, torch.nn.Parameter):
        return False
    if getattr(type(table), "__torch_dispatch__", None) is torch.Tensor.__torch_dispatch__:
        return False  # a subclass that dispatches as a plain tensor (a Parameter's subclass)
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return not (is_dtensor(table) or isinstance(table, (FakeTensor, FunctionalTensor)))


def is_dtensor(t) -> bool:
    """True for a DTensor (cheap: a plain tensor or Parameter is answered without importing
    torch.distributed.tensor; no DTensor exists before that module is imported)."""
    if type(t) in (torch.Tensor, torch.nn.Parameter) or t is None:
        return False
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


# --------------------------------------------------------------------------- metadata checks
# What fused_embedding checks before anything runs (DESIGN §3); the C++ lookup checks the
# same with the same messages (csrc/checks.h). Metadata only: nothing here reads a tensor's data.
# The positional encodings, by name and by the code the kernels take (csrc/common.h,
# PosEncoding, mirrors it; a test checks they agree).
POS_CODES = {"none": 0, "learned": 1, "sinusoidal": 2}
# Frozen sets: a compiled graph guards a set by its value, two guards on every call, a
# tuple by each element (Dynamo re-checks module constants a traced function read).
ID_DTYPES = frozenset((torch.int32, torch.int64))
WEIGHT_DTYPES = frozenset((torch.float32, torch.float16, torch.bfloat16, torch.float64))


def check_dropout_p(p) -> None:
    """A probability: a real number in [0, 1] (ValueError otherwise, as nn.Dropout)."""
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0.0 <= p <= 1.0:
        raise InputValueError(f"pyembed: dropout probability has to be between 0 and 1, but got {p!r}")


def normalize_padding_idx(padding_idx: Optional[int], num_embeddings: int) -> Optional[int]:
    """nn.Embedding's rule: padding_idx in [-V, V), negative counting from the end;
    returned in [0, V) (or None)."""
    if padding_idx is None:
        return None
    if not -num_embeddings <= padding_idx < num_embeddings:
        raise InputValueError(f"pyembed: padding_idx={padding_idx} is out of range for V={num_embeddings}")
    return padding_idx % num_embeddings


def check_integer_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dtype not in ID_DTYPES:
        got = t.dtype if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputTypeError(f"pyembed: {name} must be an int32 or int64 tensor, got {got}")


def check_inputs(ids, weight, pos_weight, pos_encoding, position_ids, offset):
    """Every metadata check of DESIGN §3. Returns the normalised pos_encoding and
    position_ids shaped like ids ((T,) / (1, T) ones expanded over the batch)."""
    check_integer_tensor("ids", ids)
    if not isinstance(weight, torch.Tensor) or weight.dtype not in WEIGHT_DTYPES:
        got = weight.dtype if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise InputTypeError(f"pyembed: weight must be a float32/float16/bfloat16/float64 tensor, got {got}")
    if weight.dim() != 2:
        raise InputValueError(f"pyembed: weight must be 2-D (V, d), got shape {tuple(weight.shape)}")
    embed_dim = weight.shape[1]

    if pos_encoding is None or pos_encoding == "none":
        pos_encoding = "learned" if pos_weight is not None else "none"
    if pos_encoding not in POS_CODES:
        raise InputValueError(f"pyembed: pos_encoding must be None, 'learned' or 'sinusoidal', got {pos_encoding!r}")
    if pos_encoding == "learned":
        if pos_weight is None:
            raise InputValueError("pyembed: pos_encoding='learned' needs pos_weight (max_seq_len, d)")
        if pos_weight.dim() != 2 or pos_weight.shape[1] != embed_dim:
            raise InputValueError(
                f"pyembed: embedding dimension mismatch: weight is {tuple(weight.shape)} "
                f"but pos_weight is {tuple(pos_weight.shape)}"
            )
        if pos_weight.dtype != weight.dtype:
            raise InputTypeError(f"pyembed: pos_weight dtype {pos_weight.dtype} != weight dtype {weight.dtype}")
    elif pos_weight is not None:
        raise InputValueError(f"pyembed: pos_weight was given but pos_encoding={pos_encoding!r}")
    if pos_encoding == "sinusoidal" and embed_dim % 2:
        raise InputValueError(f"pyembed: sinusoidal encoding requires an even embedding dim, got d={embed_dim}")
    if pos_encoding != "none" and ids.dim() not in (1, 2):
        raise InputValueError(
            f"pyembed: with a positional encoding ids must be (B, T) or (T,), got shape {tuple(ids.shape)}"
        )

    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise InputValueError(f"pyembed: offset must be an int >= 0, got {offset!r}")
    if position_ids is not None:
        if pos_encoding == "none":
            raise InputValueError("pyembed: position_ids given but there is no positional encoding")
        check_integer_tensor("position_ids", position_ids)
        broadcasts = ids.dim() == 2 and position_ids.shape in ((ids.shape[1],), (1, ids.shape[1]))
        if position_ids.shape != ids.shape and not broadcasts:
            raise InputValueError(
                f"pyembed: position_ids shape {tuple(position_ids.shape)} != ids shape {tuple(ids.shape)} "
                f"(nor (T,) / (1, T) for the batch)"
            )
        position_ids = position_ids.expand(ids.shape)
        if offset != 0:
            raise InputValueError("pyembed: pass position_ids or offset, not both")
    elif pos_encoding == "learned" and ids.numel() > 0:
        seq_len, max_seq_len = ids.shape[-1], pos_weight.shape[0]
        if offset + seq_len > max_seq_len:
            raise InputValueError(
                f"pyembed: positions {offset}..{offset + seq_len - 1} (sequence length {seq_len}, "
                f"offset {offset}) exceed the learned table's max_seq_len={max_seq_len}"
            )

    device = weight.device
    for name, t in (("pos_weight", pos_weight), ("position_ids", position_ids), ("ids", ids)):
        if t is not None and t.device != device:
            raise InputValueError(f"pyembed: {name} is on {t.device} but weight is on {device}")
    return pos_encoding, position_ids
