"""Independent results the tests compare against: eager PyTorch (``nn.Embedding`` +
mul + add, the way models do it today) and the float64 reference."""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import pyembed
from pyembed import dispatch
from pyembed.reference import sinusoid, token_positions

CPU_BACKENDS = dispatch.backends_for("cpu")
# What the parity tests run: "name" on CPU tensors and, with a GPU, "name@cuda" on CUDA
# tensors (inputs moved there, results brought back), so one suite checks every device.
BACKENDS = CPU_BACKENDS + ([f"{name}@cuda" for name in dispatch.backends_for("cuda")]
                           if torch.cuda.is_available() else [])
WEIGHT_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
ID_DTYPES = [torch.int32, torch.int64]
FLOAT_EPS = {torch.float32: 2.0**-24, torch.float64: 2.0**-53}


def eager_embedding(ids, weight, pos_weight=None, *, pos_encoding=None, scale=1.0, position_ids=None,
                    offset=0, padding_idx=None, scale_grad_by_freq=False, sparse=False):
    """The unfused way: nn.Embedding lookups, a multiply and an add, each rounded."""
    out = F.embedding(ids, weight, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq, sparse=sparse)
    if scale != 1.0:
        out = out * scale
    if pos_encoding is None and pos_weight is not None:
        pos_encoding = "learned"
    if pos_encoding in (None, "none"):
        return out
    if position_ids is not None:  # (T,) or (1, T) broadcast over the batch, as fused_embedding takes them
        position_ids = position_ids.expand(ids.shape)
    positions = token_positions(ids, position_ids, offset).reshape(ids.shape)
    if pos_encoding == "learned":
        return out + F.embedding(positions, pos_weight)
    pe = sinusoid(positions.reshape(-1), weight.shape[1]).to(weight.dtype)
    return out + pe.reshape(*ids.shape, weight.shape[1])


def sinusoid_atol(ids, position_ids=None, offset=0, embed_dim=None) -> torch.Tensor:
    """DESIGN §7: a float32 sinusoid may be off by 8 * 2**-24 * (p + 1) per element,
    since the angle p * w_i itself is rounded to float32. Broadcastable to the output."""
    positions = token_positions(ids, position_ids, offset).reshape(*ids.shape, 1)
    return 8 * 2.0**-24 * (positions.double() + 1)


def max_abs_err(actual: torch.Tensor, exact: torch.Tensor) -> float:
    return (actual.double() - exact.double()).abs().max().item() if actual.numel() else 0.0


def assert_within(actual: torch.Tensor, expected: torch.Tensor, atol, rtol: float = 0.0, what: str = "") -> None:
    """|actual - expected| <= atol + rtol * |expected| elementwise (atol may be a tensor);
    on failure report the worst element, its index and the count of bad elements."""
    diff = (actual.double() - expected.double()).abs()
    bound = torch.as_tensor(atol, dtype=torch.float64) + rtol * expected.double().abs()
    bad = diff > bound
    if bad.any():
        worst = torch.argmax((diff - bound).reshape(-1)).item()
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), diff.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements out of tolerance; worst at {idx}: "
            f"actual {actual[idx].item()!r}, expected {expected[idx].item()!r}, "
            f"allowed {bound.broadcast_to(diff.shape)[idx].item():.3g}"
        )


def make_inputs(batch, seq_len, vocab, dim, dtype, id_dtype=torch.int64, pos_rows=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g).to(id_dtype)
    weight = torch.randn(vocab, dim, generator=g, dtype=torch.float64).to(dtype)
    pos_weight = None
    if pos_rows is not None:
        pos_weight = (0.5 * torch.randn(pos_rows, dim, generator=g, dtype=torch.float64)).to(dtype)
    dout = torch.randn(batch, seq_len, dim, generator=g, dtype=torch.float64).to(dtype)
    return ids, weight, pos_weight, dout


def run_with_grads(fn, ids, weight, pos_weight, dout, **kwargs):
    """Run fn(ids, weight, pos_weight, **kwargs) on fresh leaf copies of the tables and
    backpropagate dout; return (out, dW, dP)."""
    w = weight.detach().clone().requires_grad_()
    p = None if pos_weight is None else pos_weight.detach().clone().requires_grad_()
    out = fn(ids, w, p, **kwargs)
    out.backward(dout)
    return out.detach(), w.grad, None if p is None else p.grad


class _ToDevice(torch.autograd.Function):
    """t.to(device), whose backward moves the gradient back by device alone: autograd's
    own ToCopyBackward calls grad.to(t's options), which torch 2.11 (the H100 machine's)
    refuses for a sparse gradient ("doesn't support converting to a different layout")."""

    @staticmethod
    def forward(ctx, t, device):
        ctx.device = t.device
        return t.to(device)

    @staticmethod
    def backward(ctx, grad):
        return grad.to(ctx.device), None


def to_device(t, device):
    """t on ``device`` for a test, differentiably (sparse gradients come back too); None
    and non-tensors pass through."""
    return _ToDevice.apply(t, device) if isinstance(t, torch.Tensor) else t


def fused(backend):
    """fused_embedding with a BACKENDS entry: for "name@cuda" the tensors go to the GPU
    (differentiably: gradients come back to the CPU leaves) and the output comes back."""
    name, _, device = backend.partition("@")

    def run(ids, weight, pos_weight=None, **kwargs):
        if not device:
            return pyembed.fused_embedding(ids, weight, pos_weight, backend=name, **kwargs)
        kwargs = {k: to_device(v, device) for k, v in kwargs.items()}
        return pyembed.fused_embedding(to_device(ids, device), to_device(weight, device), to_device(pos_weight, device),
                                       backend=name, **kwargs).cpu()
    return run


def exact_row_sums(keys, dout, num_rows, skip=None):
    """The exact gradient of a lookup, float64 (num_rows, d): row r sums the dout rows
    whose key is r, the tokens keyed ``skip`` (a padding row) left out."""
    if skip is not None:
        keep = keys != skip
        keys, dout = keys[keep], dout[keep]
    keys = keys.reshape(-1).long()
    return torch.zeros(num_rows, dout.shape[-1], dtype=torch.float64).index_add_(
        0, keys, dout.reshape(keys.numel(), -1).double())


def accumulation_bound(keys, dout, num_rows, scale, dtype):
    """A rule-based bound on a gradient row sum_k scale * dout_k computed by fp32 (fp64)
    accumulation and rounded once to dtype: rounding u(dtype) * |exact| plus the
    summation error eps * (count + 2) * scale * sum |dout_k| (Higham's bound).
    Returns (exact float64 (num_rows, d), bound (num_rows, d))."""
    acc_eps = FLOAT_EPS[torch.float64 if dtype == torch.float64 else torch.float32]
    keys = keys.reshape(-1).long()
    terms = dout.reshape(keys.numel(), -1).double()
    exact = exact_row_sums(keys, terms, num_rows) * scale
    abs_sum = torch.zeros_like(exact).index_add_(0, keys, terms.abs()) * abs(scale)
    counts = torch.bincount(keys, minlength=num_rows).double()[:, None]
    bound = UNIT_ROUNDOFF[dtype] * exact.abs() + acc_eps * (counts + 2) * abs_sum
    return exact, bound


# Relative error of one round-to-nearest into each dtype.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


# Segment lengths (ids 0..12 in order) placed so that, once sorted, segments start on a
# 128-position chunk boundary, just after one and just before one, and end likewise --
# the GPU backends sum a segment of more than 128 tokens in per-chunk pieces. Id 11 is
# the padding row when a test asks for one; ids 13..19 are untouched.
BOUNDARY_LENGTHS = [128, 128, 129, 127, 1, 300, 2, 257, 383, 1, 129, 50, 1]
BOUNDARY_VOCAB = 20


def boundary_ids_and_grad(dtype, dim=8, seed=0):
    """(ids (4, 409) shuffled, dout with small integer values: every sum is exact in fp32)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.repeat_interleave(torch.arange(len(BOUNDARY_LENGTHS)), torch.tensor(BOUNDARY_LENGTHS))
    ids = ids[torch.randperm(ids.numel(), generator=gen)].reshape(4, -1)
    return ids, torch.randint(-8, 9, (*ids.shape, dim), generator=gen).to(dtype)


# The learned positions' blocks write the rows used by one token (PositionSums in
# csrc/cuda, _position_sums in kernels/): ids over a table of SOLO_VOCAB rows.
SOLO_VOCAB = 600


def solo_rows_ids_and_grad(dtype, dim):
    """(ids (4, 100), dout with small integer values: every sum exact in any order) and the
    mask of the ids that name a used row: most rows used once, some twice or more, row 2
    160 times (past a chunk of 128: summed in pieces), the padding row 5, and one id below
    and one past the table (validate=False: no gradient)."""
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, SOLO_VOCAB, (4, 100), generator=gen)
    ids[:, :40] = 2
    ids[0, 50], ids[1, 60], ids[2, 70] = -1, SOLO_VOCAB, 5
    dout = torch.randint(-3, 4, (4, 100, dim), generator=gen).to(dtype)
    return ids, dout, (ids >= 0) & (ids < SOLO_VOCAB) & (ids != 5)


# Tables at the edges of the sort keys' widths (kernels/embedding.py sort_key_dtype, the
# bits CUB sorts on cuda): the last int16 table (2^16 - 1 rows: the unused mark 2^16 - 1
# still fits), the first int32 one, and one where 2^15 splits the biased int16 keys' sign.
KEY_WIDTH_VOCABS = [2**15 + 2, 2**16 - 1, 2**16]


def key_width_ids_and_grad(vocab, dim=2, seed=0):
    """(ids (1, n) of the rows at the key-width edges with 1-3 uses each, shuffled, padding
    row vocab - 3 among them; dout with small integer values: every sum is exact)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.tensor([0, 1, 2**15 - 1, 2**15, 2**15 + 1, vocab - 3, vocab - 2, vocab - 1])
    ids = torch.repeat_interleave(rows, torch.randint(1, 4, (rows.numel(),), generator=gen))
    ids = ids[torch.randperm(ids.numel(), generator=gen)][None]
    return ids, torch.randint(-8, 9, (*ids.shape, dim), generator=gen).float()


def token_order_ids_and_grad(num_tokens, vocab, dim=4, seed=0):
    """(ids (num_tokens,), dout float32, the float32 gradient summed in token order, the
    padding row): ids over ~num_tokens / 40 rows of a `vocab` table, each used at most 100
    times (no segment is split into chunks of 128), shuffled, then one id below the table,
    one past it (validate=False: no gradient) and a row's uses as the padding row (none);
    dout of mixed magnitudes (2^-20 to 2^20), so a row's float32 sum depends on its tokens'
    order -- the sorted paths sum in token order when their sort is stable. The expected
    sums are float32 additions done here, one token at a time per row (CPU arithmetic is
    IEEE, order as written)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.randperm(vocab, generator=gen)[: max(2, num_tokens // 40)]
    uses = torch.randint(1, 101, (rows.numel(),), generator=gen)
    ids = rows.repeat_interleave(uses).repeat(num_tokens // int(uses.sum()) + 1)[:num_tokens]
    ids = ids[torch.randperm(num_tokens, generator=gen)]
    padding_idx = int(ids[2])
    ids[0], ids[1] = -1, vocab
    dout = torch.randn(num_tokens, dim, generator=gen) * torch.exp2(torch.randint(-20, 21, (num_tokens, 1),
                                                                                  generator=gen).float())
    used = (ids >= 0) & (ids < vocab) & (ids != padding_idx)
    order = torch.nonzero(used).reshape(-1)
    order = order[torch.sort(ids[order], stable=True).indices]  # each row's tokens together, in token order
    sorted_ids, sorted_dout = ids[order], dout[order]
    start = torch.ones(order.numel(), dtype=torch.bool)
    start[1:] = sorted_ids[1:] != sorted_ids[:-1]
    segment = torch.cumsum(start.long(), 0) - 1
    first = torch.nonzero(start).reshape(-1)
    rank = torch.arange(order.numel()) - first[segment]  # position within its row
    count = torch.bincount(segment)
    assert int(count.max()) <= 100, "a row past a chunk (128) would be summed in pieces"

    def sums_in(steps):
        sums = torch.zeros(count.numel(), dim)
        for k in range(int(count.max())):  # step k adds every row's k-th token
            at = steps == k
            sums[segment[at]] = sums[segment[at]] + sorted_dout[at]
        return sums

    sums = sums_in(rank)
    # The case tells orders apart: summed last token first, most rows used twice or more differ.
    reverse = sums_in(count[segment] - 1 - rank)
    assert (reverse != sums).any(1).sum() > (count > 1).sum() // 2
    expected = torch.zeros(vocab, dim)
    expected[sorted_ids[start]] = sums
    return ids, dout, expected, padding_idx


def long_segment_ids_and_grad(dim, chunk=128, seed=0):
    """(ids (1000,), dout float32, the float32 dense gradient as the GPU backends sum it):
    a row used 600 times among rows used 1-90 times, so its segment of sorted positions
    spans five chunks of `chunk`; dout of mixed magnitudes, so every order of addition
    gives other bits. The contract of the chunked sum (csrc/cuda/embedding_kernels.cuh,
    kernels/embedding.py): each piece of a long segment -- its positions within one chunk
    of the sorted positions -- summed from zero in token order, then the row the pieces'
    sums added in order, the first as the start; a short segment summed from zero in token
    order. The expected sums are float32 additions done here one at a time."""
    gen = torch.Generator().manual_seed(seed)
    vocab, hot = 50, 17
    others = torch.randint(0, vocab - 1, (400,), generator=gen)
    ids = torch.cat([torch.full((600,), hot), others + (others >= hot).long()])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    dout = torch.randn(ids.numel(), dim, generator=gen) * torch.exp2(
        torch.randint(-20, 21, (ids.numel(), 1), generator=gen).float())
    order = torch.sort(ids, stable=True).indices
    sorted_ids = ids[order]
    expected = torch.zeros(vocab, dim)

    def in_order(positions):  # float32, from zero, one token at a time
        total = torch.zeros(dim)
        for position in positions:
            total = total + dout[order[position]]
        return total

    direct = {}
    for row in sorted_ids.unique().tolist():
        positions = torch.nonzero(sorted_ids == row).reshape(-1).tolist()
        direct[row] = expected[row] = in_order(positions)
        if len(positions) > chunk:  # in pieces: its positions within each chunk, then the pieces
            pieces = {}
            for position in positions:
                pieces.setdefault(position // chunk, []).append(position)
            sums = [in_order(piece) for piece in pieces.values()]
            expected[row] = sums[0]
            for piece_sum in sums[1:]:
                expected[row] = expected[row] + piece_sum
    assert not torch.equal(direct[hot], expected[hot]), "the case must tell the chunked sum from one pass"
    return ids, dout, expected


RANKS_TIMEOUT_S = 120


@contextlib.contextmanager
def process_group(rank: int, world_size: int, store_dir: str, backend: str = "gloo"):
    """One rank's process group (gloo over loopback, or NCCL) for a worker's checks. On
    success every rank meets at a barrier before any tears it down, and the process ends
    there (a rank's exception propagates as usual)."""
    faulthandler.enable()  # a rank that aborts (SIGABRT) prints where its threads were
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    dist.init_process_group(backend, init_method=f"file://{store_dir}/rendezvous", rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=60))
    try:
        yield
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Passed: leave without interpreter finalization. Objects still holding the group
    # (device meshes, DTensor parameters) would be destroyed there, and gloo sometimes
    # aborts then (std::terminate with no Python frame; ~1 run in 10 here).
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


def launch_ranks(run, world_size: int, store_dir: str, backends: list[str]) -> None:
    """run(rank, world_size, store_dir, backends) on world_size spawned processes. A rank's
    exception fails the test with its traceback; a hang fails it after RANKS_TIMEOUT_S; no
    process outlives it."""
    context = mp.start_processes(run, args=(world_size, store_dir, backends), nprocs=world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + RANKS_TIMEOUT_S
    try:
        while not context.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the {world_size} ranks did not finish within {RANKS_TIMEOUT_S} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()


def lookup_results(lookup, ids, weight, pos_weight, **options):
    """A lookup's output and gradients (weight, positions) -- a plain backward, the kernels'
    -- and the same gradients recorded (create_graph=True) and differentiated again with
    respect to the output gradient."""
    weight, pos_weight = weight.detach().requires_grad_(), pos_weight.detach().requires_grad_()
    results = []
    for create_graph in (False, True):
        torch.manual_seed(3)  # the dropout key
        out = lookup(ids, weight, pos_weight, **options)
        dout = torch.linspace(-1.0, 1.0, out.numel(), dtype=out.dtype, device=out.device)
        dout = dout.reshape(out.shape).requires_grad_()
        grads = torch.autograd.grad(out, (weight, pos_weight), dout, create_graph=create_graph)
        results += [out.detach(), *(g.to_dense() if g.is_sparse else g.detach() for g in grads)]
        if create_graph:
            results.append(torch.autograd.grad(sum((g.to_dense() * g.to_dense()).sum() for g in grads), dout)[0])
    return results


# Calls whose node's forward, backward and double backward differ (dropout, sparse, padding +
# scale_grad_by_freq, positions, no range check), for 2x3 ids as tests/test_dispatch.py's.
NODE_OPTIONS = [{}, {"dropout_p": 0.25}, {"sparse": True}, {"sparse": True, "dropout_p": 0.25},
                {"padding_idx": 2, "scale_grad_by_freq": True}, {"position_ids": torch.tensor([[3, 1, 0]])},
                {"validate": False}]


class RowQuantized(torch.Tensor):
    """An int8 table with a float scale per row, as torchao's weight-only quantized tables
    (``quantize_(model, IntxWeightOnlyConfig(...), filter_fn=<nn.Embedding>)`` puts them in
    a FusedEmbedding as in an nn.Embedding): a wrapper subclass that implements ATen's
    embedding -- dequantizing the rows it gathers -- and no pyembed op."""

    @staticmethod
    def __new__(cls, codes, row_scales, dtype):
        return torch.Tensor._make_wrapper_subclass(cls, codes.shape, dtype=dtype, device=codes.device)

    def __init__(self, codes, row_scales, dtype):
        self.codes, self.row_scales = codes, row_scales

    @classmethod
    def quantize(cls, table: torch.Tensor) -> "RowQuantized":
        row_scales = table.abs().amax(dim=1).clamp_min(1e-8) / 127
        return cls(torch.round(table / row_scales[:, None]).to(torch.int8), row_scales, table.dtype)

    def dequantized(self) -> torch.Tensor:
        return (self.codes.float() * self.row_scales[:, None]).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.embedding.default:
            return torch.ops.aten.embedding.default(args[0].dequantized(), *args[1:])
        if func is torch.ops.aten.detach.default:
            return cls(args[0].codes, args[0].row_scales, args[0].dtype)
        raise NotImplementedError(f"RowQuantized has no {func}")
