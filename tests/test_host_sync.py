"""The GPU backends' dense backward and forward never wait for the device, shown on CPU.

A CUDA graph (``torch.compile(mode="reduce-overhead")``) cannot hold an op that reads
device data back to the host. The host code around the CUDA kernels (run here through
host emulation) and around the Triton kernels (under the interpreter) is run under a
dispatch mode that records every ATen op it calls: none may read a value back
(``_local_scalar_dense``: ``.item()``, ``int(t)``) or have a data-dependent output size
(``unique``, ``nonzero``, boolean masks). The sparse backward must read one size back,
which shows the recorder sees syncs. The ops that still sync are tagged
``cudagraph_unsafe`` (tests/test_dispatch.py).
"""

import importlib.util
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import pyembed
from helpers import SOLO_VOCAB, accumulation_bound, assert_within, exact_row_sums, make_inputs, solo_rows_ids_and_grad

_SYNCING = {"aten::_local_scalar_dense", "aten::item", "aten::unique_consecutive", "aten::_unique", "aten::_unique2",
            "aten::unique_dim", "aten::nonzero", "aten::masked_select", "aten::repeat_interleave"}


class HostSyncRecorder(TorchDispatchMode):
    """Records the ATen ops that would make the host wait for a GPU, and every ATen op as
    (name, dtype and numel of its first tensor argument)."""

    def __init__(self):
        super().__init__()
        self.syncs = []
        self.calls = []

    @property
    def ops(self) -> int:
        return len(self.calls)

    @property
    def names(self) -> list:
        return [call[0] for call in self.calls]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.calls.append((name, None if first is None else first.dtype, 0 if first is None else first.numel()))
        bool_index = name == "aten::index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if name in _SYNCING or bool_index:
            self.syncs.append(name)
        return func(*args, **(kwargs or {}))


def _inputs():
    ids, weight, pos_weight, dout = make_inputs(4, 100, 50, 16, torch.float32, pos_rows=120, seed=3)
    ids[:, :70] = 7  # a hot row: 280 uses, summed in per-chunk pieces
    ids[0, 0], ids[1, 1] = 3, 5  # the padding row (5) and ordinary rows
    return ids, weight, pos_weight, dout, torch.randint(0, 120, ids.shape)


def test_emulated_cuda_forward_and_dense_backward_never_sync(emulated):
    ids, weight, pos_weight, dout, position_ids = _inputs()
    with HostSyncRecorder() as rec:
        emulated.embedding_forward(ids, weight, pos_weight, position_ids, "learned", 2.0, 0, None, 0.0, 0, 0)
        emulated.embedding_forward(ids, weight, None, None, "sinusoidal", 2.0, 5, None, 0.0, 0, 0)
        dw, dp = emulated.embedding_backward(dout, ids, position_ids, 0, 50, 120, 1.0, 5, True, True, True)
        emulated.embedding_backward(dout, ids, None, 3, 50, 120, 1.0, None, False, True, True)
    assert rec.syncs == []
    counts = torch.bincount(ids.reshape(-1), minlength=50).double().clamp(min=1)[:, None]
    torch.testing.assert_close(dw.double(), exact_row_sums(ids, dout, 50, skip=5) / counts, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dp.double(), exact_row_sums(position_ids, dout, 120), rtol=1e-5, atol=1e-5)
    with HostSyncRecorder() as rec:
        emulated.embedding_sparse_backward(dout, ids, 50, 1.0, 5, False)
    assert rec.syncs == ["aten::_local_scalar_dense"]  # the number of touched rows, once


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
def test_triton_forward_and_dense_backward_never_sync():
    pytest.importorskip("triton", reason="triton is not installed")
    from pyembed.kernels import embedding as k

    ids, weight, pos_weight, dout, position_ids = _inputs()
    out = torch.empty(*ids.shape, 16)
    with HostSyncRecorder() as rec:
        k.embedding_forward(ids, weight, pos_weight, position_ids, k.POS_LEARNED, 2.0, 0, None, 0, 1.0, 0, 16, out)
        dw = k.dense_gradient(dout.reshape(-1, 16), ids, 50, 5, 1.0, True,
                              positions=k.PositionSums(torch.empty(120, 16), 4, 100, 100, 3))
        dp = k.dense_gradient(dout.reshape(-1, 16), position_ids, 120, -1, 1.0, False)
        k.batch_sum(dout.reshape(-1, 16), k.PositionSums(torch.empty(120, 16), 4, 100, 100, 3))
    assert rec.syncs == []
    counts = torch.bincount(ids.reshape(-1), minlength=50).double().clamp(min=1)[:, None]
    torch.testing.assert_close(dw.double(), exact_row_sums(ids, dout, 50, skip=5) / counts, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dp.double(), exact_row_sums(position_ids, dout, 120), rtol=1e-5, atol=1e-5)
    from pyembed._triton import triton_sparse_backward

    with HostSyncRecorder() as rec:
        triton_sparse_backward._init_fn(dout, ids, 50, 1.0, 5, False)  # the op's Python body
    assert rec.syncs == ["aten::_local_scalar_dense"]


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_jagged_ids_positions_come_from_the_offsets_without_a_sync(backend):
    """Jagged ids with a positional encoding: each token's position (its index in the
    packed values less its sequence's start) is found on the device -- a search of the
    offsets --, not from lengths read back (the default range check, inside the kernel on a
    GPU, is left out here: on the CPU it reads the extremes by design)."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (no GPU here)")
    ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 0]), torch.tensor([9])],
                                     layout=torch.jagged)
    layer = pyembed.EmbeddingLayer(10, 8, 16, backend=backend)
    with HostSyncRecorder() as rec:
        out = pyembed.fused_embedding(ids, layer.token_embedding.weight, layer.pos_embedding, offset=2,
                                      validate=False, backend=backend)
        out.values().sum().backward()
    assert rec.syncs == [] and "aten::searchsorted" in rec.names
    expected = layer.pos_embedding.detach()[[2, 3, 4, 2, 3, 2]] + layer.token_embedding.weight.detach()[ids.values()]
    torch.testing.assert_close(out.values(), expected, rtol=1e-6, atol=1e-6)


# A GPU backward is a few microseconds of arithmetic behind one host-side launch per op:
# the ATen ops it issues are its fixed cost (on an H100, ~95 of them made a GPT-2 8x2048
# backward 1.6 ms against eager's 0.5). The segment bookkeeping is in kernels, so a
# dense backward issues a handful of ATen ops (allocations and views, the sort), whatever
# the token count or the hot rows; 30 leaves room, a chain of tensor ops per level of a
# reduction tree does not (it was ~95).
MAX_ATEN_OPS = 30
VOCAB = 1000


def _backward_inputs():
    ids = torch.randint(0, VOCAB, (4, 1024), generator=torch.Generator().manual_seed(4))
    ids[:, :500] = 7  # a hot row: every tree level does work
    return ids, torch.randn(4, 1024, 8)


def test_emulated_cuda_dense_backward_is_a_few_ops(emulated):
    ids, dout = _backward_inputs()
    with HostSyncRecorder() as rec:
        dw, _ = emulated.embedding_backward(dout, ids, None, 0, VOCAB, 0, 1.0, None, False, True, False)
    assert rec.ops <= MAX_ATEN_OPS, rec.ops
    torch.testing.assert_close(dw.double(), exact_row_sums(ids, dout, VOCAB), rtol=1e-5, atol=1e-4)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
def test_triton_dense_backward_is_a_few_ops(interpreted_launches):
    from pyembed.kernels import embedding as k

    ids, dout = _backward_inputs()
    with HostSyncRecorder() as rec:
        dw = k.dense_gradient(dout.reshape(-1, 8), ids, VOCAB, -1, 1.0, False)
    assert rec.ops <= MAX_ATEN_OPS, rec.ops
    torch.testing.assert_close(dw.double(), exact_row_sums(ids, dout, VOCAB), rtol=1e-5, atol=1e-4)


# Launches per dense backward, the contract of issue #30 (at most four at GPT-2's 8x2048
# tokens, hot rows included): the sort, one pass over the sorted positions (segment bounds,
# the long segments' pieces), one over the table's rows; the learned positions' batch sums
# are extra blocks of the last one. Both backends sort in two launches (their tile sorts,
# the first setting the sort's inputs), or around a library sort (PYEMBED_CUDA_SORT=cub,
# PYEMBED_TRITON_TILE_SORT=0, and past 2^14 tokens or 2^18 rows). Each launch costs the
# host microseconds and the GPU a ramp; the reduction tree, scans and fills this replaced
# were ~25 launches at this size.
def _gpt2_backward_inputs():
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 50257, (8, 2048), generator=gen)
    ids[:, :1500] = 13  # a row used 12000 times, as tests/gpu's determinism check
    return ids, torch.randn(8, 2048, 8, generator=gen)


@pytest.mark.parametrize("sort, launches", [("tile", (4, 0)), ("cub", (3, 1))])
def test_emulated_cuda_dense_backward_is_four_kernels_or_three_around_a_sort(emulated, monkeypatch, sort, launches):
    monkeypatch.setenv("PYEMBED_CUDA_SORT", sort)
    ids, dout = _gpt2_backward_inputs()
    emulated.take_launch_counts()
    dw, dp = emulated.embedding_backward(dout, ids, None, 0, 50257, 2048, 1.0, None, False, True, True)
    assert emulated.take_launch_counts() == launches  # (kernels, sorts), learned positions included
    torch.testing.assert_close(dw[13].double(), dout[:, :1500].double().sum((0, 1)), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(dp.double(), dout.double().sum(0), rtol=1e-5, atol=1e-4)


# The host's share of a dense backward beside its launches: ATen ops, each a dispatcher
# call (an allocation also the caching allocator's lookup), ~1-2 us apiece on the GPU
# machines' hosts (the H200's took ~49 us for the `cuda` op at GPT-2 8x2048 at 26f0ba6,
# ~21 of them its four launches). With its tile sort (up to 2^14 tokens over keys of at most
# 18 bits: GPT-2 to Llama-3 at 8x2048) the `cuda` backward allocates its two gradients
# (an empty (0, d) one where not asked for) and one scratch buffer for the sort and the
# segments, and issues nothing else: no views, no fills. It was 12 ops (six allocations).
@pytest.mark.parametrize("need_pos_grad", [True, False], ids=["positions", "no positions"])
def test_emulated_cuda_dense_backward_allocates_its_gradients_and_one_scratch(emulated, need_pos_grad):
    ids, dout = _gpt2_backward_inputs()
    with HostSyncRecorder() as rec:
        dw, dp = emulated.embedding_backward(dout, ids, None, 0, 50257, 2048, 1.0, None, False, True, need_pos_grad)
    assert rec.names == ["aten::empty"] * 3, rec.calls
    torch.testing.assert_close(dw[13].double(), dout[:, :1500].double().sum((0, 1)), rtol=1e-5, atol=1e-3)
    other = ids[0, 1600].item()
    torch.testing.assert_close(dw[other].double(), dout[ids == other].double().sum(0), rtol=1e-5, atol=1e-5)
    if need_pos_grad:
        torch.testing.assert_close(dp.double(), dout.double().sum(0), rtol=1e-5, atol=1e-4)
    else:
        assert dp.shape == (0, 8)


@pytest.mark.parametrize("by_freq", [False, True])
def test_emulated_cuda_scratch_arrays_apart_give_the_same_bits(emulated, monkeypatch, by_freq):
    # PYEMBED_CUDA_SCRATCH=separate (gpu-check's compute-sanitizer runs): each scratch array
    # its own allocation -- bounds, order, the sort's keys and words, the partial sums --
    # so that memcheck sees an access past one; the same sums, bit for bit.
    ids, dout = _gpt2_backward_inputs()
    together = emulated.embedding_backward(dout, ids, None, 0, 50257, 2048, 1.0, 5, by_freq, True, True)
    monkeypatch.setenv("PYEMBED_CUDA_SCRATCH", "separate")
    with HostSyncRecorder() as rec:
        apart = emulated.embedding_backward(dout, ids, None, 0, 50257, 2048, 1.0, 5, by_freq, True, True)
    assert rec.names == ["aten::empty"] * 6, rec.calls  # the two gradients and four arrays
    assert all(torch.equal(a, b) for a, b in zip(together, apart))
    sparse_apart = emulated.embedding_sparse_backward(dout, ids, 50257, 1.0, 5, by_freq)
    monkeypatch.delenv("PYEMBED_CUDA_SCRATCH")
    sparse_together = emulated.embedding_sparse_backward(dout, ids, 50257, 1.0, 5, by_freq)
    assert all(torch.equal(a, b) for a, b in zip(sparse_together, sparse_apart))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
@pytest.mark.parametrize("tile_sort", [True, False], ids=["tile sort", "torch's sort"])
def test_triton_dense_backward_is_four_kernels_or_three_around_torchs_sort(interpreted_launches, monkeypatch,
                                                                           tile_sort):
    from pyembed import _triton

    if not tile_sort:
        monkeypatch.setenv("PYEMBED_TRITON_TILE_SORT", "0")
    ids, dout = _gpt2_backward_inputs()
    with HostSyncRecorder() as rec:
        dw, dp = _triton.backward(dout, ids, None, 0, 50257, 2048, 1.0, None, False, True, True)
    sort = ["_tile_rank_kernel", "_merge_tiles_kernel"] if tile_sort else ["_sort_inputs_kernel"]
    assert interpreted_launches == sort + ["_chunk_kernel", "_finish_segments_kernel"]
    assert rec.names.count("aten::sort") == (0 if tile_sort else 1) and not rec.syncs
    torch.testing.assert_close(dw[13].double(), dout[:, :1500].double().sum((0, 1)), rtol=1e-5, atol=1e-3)
    torch.testing.assert_close(dp.double(), dout.double().sum(0), rtol=1e-5, atol=1e-4)


def _forward_token_order(request, backend: str, num_tokens: int, seq_len: int, pos_mode: int,
                         position_ids: bool = False) -> torch.Tensor:
    """The token each slot (thread row / tile row, in launch order) of a forward kernel
    handles: csrc/cuda's token_of_slot (emulated), kernels.embedding's _token_of_slot
    (interpreted)."""
    if backend == "cuda":
        return request.getfixturevalue("emulated").forward_token_order(num_tokens, seq_len, pos_mode, position_ids)
    order, t = torch.full((num_tokens,), -1, dtype=torch.long), torch.full((num_tokens,), -1, dtype=torch.long)
    _order_kernel[(-(-num_tokens // 1024),)](order, t, num_tokens, seq_len, POS_MODE=pos_mode,
                                              HAS_POSITION_IDS=position_ids, BLOCK=1024)
    assert torch.equal(t, order % seq_len)  # each slot's token's index in its sequence, as it returns it
    return order


if importlib.util.find_spec("triton") is not None:
    import triton
    import triton.language as tl

    from pyembed.kernels.embedding import _token_of_slot

    @triton.jit
    def _order_kernel(out_ptr, t_ptr, num_tokens, seq_len, POS_MODE: tl.constexpr, HAS_POSITION_IDS: tl.constexpr,
                      BLOCK: tl.constexpr):
        slot = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # 32-bit slots, as the forward's below 2^31
        token, t = _token_of_slot(slot, num_tokens, seq_len, POS_MODE, HAS_POSITION_IDS)
        tl.store(out_ptr + slot, token, mask=slot < num_tokens)
        tl.store(t_ptr + slot, t, mask=slot < num_tokens)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("batch, seq_len", [(8, 2048), (3, 7), (1, 5), (5, 1)])
def test_forward_reads_a_positional_row_for_the_whole_batch_at_once(request, backend, batch, seq_len):
    # With learned positions offset + t the forward takes the batch's tokens at position t
    # one after another: the B reads of positional row t then meet in L2. In token order a
    # row came back only after seq_len tokens of rows (96 MB at Llama's d = 4096 fp32 in the
    # cuda kernel -- past an H100's L2, so it was read from DRAM B times). Every token once;
    # given position_ids (packed sequences restart them within a row, where token order
    # keeps a repeat close) and in the other modes: token order.
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (no GPU here)")
    n = batch * seq_len
    learned = _forward_token_order(request, backend, n, seq_len, 1)
    t, b = torch.arange(seq_len)[:, None], torch.arange(batch)[None, :]
    assert torch.equal(learned, (b * seq_len + t).reshape(-1))  # slot = t * batch + b
    assert torch.equal(learned.sort().values, torch.arange(n))
    for mode in (0, 2):  # none, sinusoidal: one row per token
        assert torch.equal(_forward_token_order(request, backend, n, seq_len, mode), torch.arange(n))
    for mode in (1, 2):
        assert torch.equal(_forward_token_order(request, backend, n, seq_len, mode, position_ids=True), torch.arange(n))


# A batch of at most 32 tokens (a one-token step, a short batch; csrc/cuda's kFewTokens,
# kernels.embedding.FEW_TOKENS) is one kernel per gradient, no sort: on a GPU the sorted
# path's launches and CUB's operations are all host cost at that size. Same sums, bit for
# bit: shown against the sorted path on the same tokens behind 40 unused ones (id -1).
SHORT_VOCAB, SHORT_POSITIONS = 40, 12


def _short_batch(num_tokens, dim, dtype):
    gen = torch.Generator().manual_seed(num_tokens * 1000 + dim)
    ids = torch.randint(0, SHORT_VOCAB, (num_tokens,), generator=gen)
    ids[: num_tokens // 3] = 6  # a repeated row
    ids[1:4] = torch.tensor([3, -1, SHORT_VOCAB])[: max(num_tokens - 1, 0)]  # the padding row (3), out-of-range ids
    positions = torch.randint(0, SHORT_POSITIONS, (num_tokens,), generator=gen)
    return ids, positions, torch.randn(num_tokens, dim, generator=gen).to(dtype)


def _short_batch_backward(backend, emulated, dout, ids, positions, by_freq):
    """(dW, dP, kernels launched, sorts) of the dense backward on backend "cuda" (emulated) or "triton"."""
    if backend == "cuda":
        emulated.take_launch_counts()
        dw, dp = emulated.embedding_backward(dout, ids, positions, 0, SHORT_VOCAB, SHORT_POSITIONS, 1.5, 3, by_freq,
                                             True, True)
        return (dw, dp, *emulated.take_launch_counts())
    from pyembed import _triton

    with HostSyncRecorder() as rec:
        dw, dp = _triton.backward(dout, ids, positions, 0, SHORT_VOCAB, SHORT_POSITIONS, 1.5, 3, by_freq, True, True)
    return dw, dp, None, rec.names.count("aten::sort")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("dim", [8, 60, 97])
@pytest.mark.parametrize("num_tokens", [1, 7, 32])
def test_short_batch_gradient_is_one_kernel_with_the_sorted_paths_sums(request, backend, dtype, dim, num_tokens):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (no GPU here)")
    emulated = request.getfixturevalue("emulated") if backend == "cuda" else None
    interpreted_launches = request.getfixturevalue("interpreted_launches") if backend == "triton" else []
    ids, positions, dout = _short_batch(num_tokens, dim, dtype)
    for by_freq in (False, True):
        interpreted_launches.clear()
        dw, dp, kernels, sorts = _short_batch_backward(backend, emulated, dout, ids, positions, by_freq)
        assert sorts == 0 and kernels in (2, None), (kernels, sorts)  # one per gradient
        if backend == "triton":
            assert interpreted_launches == ["_few_tokens_gradient_kernel"] * 2
        keep = (ids >= 0) & (ids < SHORT_VOCAB) & (ids != 3)
        terms = dout.double()
        if by_freq:
            terms = terms / torch.bincount(ids[keep], minlength=SHORT_VOCAB).double()[ids.clamp(0, SHORT_VOCAB - 1),
                                                                                        None]
        exact, bound = accumulation_bound(ids[keep], terms[keep], SHORT_VOCAB, 1.5, dtype)
        assert_within(dw, exact, bound, what="dW")
        exact, bound = accumulation_bound(positions, dout, SHORT_POSITIONS, 1.0, dtype)
        assert_within(dp, exact, bound, what="dP")
        untouched = torch.ones(SHORT_VOCAB, dtype=torch.bool)
        untouched[ids[keep]] = False
        assert not dw[untouched].signbit().any() and not dw[untouched].any()  # +0.0, as a zero fill

        unused = torch.randn(40, dim, dtype=torch.float64).to(dtype)
        dw_sorted, dp_sorted, kernels, sorts = _short_batch_backward(
            backend, emulated, torch.cat([unused, dout]), torch.cat([torch.full((40,), -1), ids]),
            torch.cat([torch.full((40,), -1), positions]), by_freq)
        # Per gradient: the tile sort (one tile here: one launch), chunks, finish; no library sort
        assert (sorts, kernels) == (0, 6) if backend == "cuda" else (
            sorts == 0 and interpreted_launches.count("_tile_rank_kernel") == 2), (kernels, sorts)
        assert torch.equal(dw, dw_sorted) and torch.equal(dp, dp_sorted)


def _short_batch_rows(backend, emulated, dout, ids, by_freq):
    """(touched rows, their values, the sparse backward's rows and values, kernels launched
    or None, sorts) on backend "cuda" (emulated) or "triton"; scale 1.5, padding row 3."""
    args = (dout, ids, SHORT_VOCAB, 1.5, 3, by_freq)
    if backend == "cuda":
        emulated.take_launch_counts()
        rows, values = emulated.embedding_touched_rows(*args)
        kernels, sorts = emulated.take_launch_counts()
        return (rows, values, *emulated.embedding_sparse_backward(*args), kernels, sorts)
    from pyembed import _triton

    with HostSyncRecorder() as rec:
        rows, values = _triton.touched_rows(*args)
    return (rows, values, *torch.ops.pyembed.triton_sparse_backward(*args), None, rec.names.count("aten::sort"))


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("dim", [8, 97])
@pytest.mark.parametrize("num_tokens", [1, 7, 32])
def test_short_batch_touched_rows_are_one_kernel_with_the_sorted_paths_sums(request, backend, dtype, dim,
                                                                             num_tokens):
    # What the optimizer in the backward (a one-token fused step) and the sparse backward
    # take: the used rows ascending, slot by slot, with their sums -- one kernel without
    # the sort, bit for bit the sorted path's (shown behind 40 unused ids, as above).
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (no GPU here)")
    emulated = request.getfixturevalue("emulated") if backend == "cuda" else None
    interpreted_launches = request.getfixturevalue("interpreted_launches") if backend == "triton" else []
    ids, _, dout = _short_batch(num_tokens, dim, dtype)
    keep = (ids >= 0) & (ids < SHORT_VOCAB) & (ids != 3)
    used = torch.unique(ids[keep])  # sorted
    for by_freq in (False, True):
        interpreted_launches.clear()
        rows, values, sparse_rows, sparse_values, kernels, sorts = _short_batch_rows(backend, emulated, dout, ids,
                                                                                     by_freq)
        assert sorts == 0 and kernels in (1, None), (kernels, sorts)
        if backend == "triton":
            assert interpreted_launches[0] == "_few_tokens_slots_kernel" and len(set(interpreted_launches)) == 1
        assert rows.tolist() == used.tolist() + [-1] * (num_tokens - used.numel())
        terms = dout.double()
        if by_freq:
            terms = terms / torch.bincount(ids[keep], minlength=SHORT_VOCAB).double()[ids.clamp(0, SHORT_VOCAB - 1),
                                                                                        None]
        exact, bound = accumulation_bound(ids[keep], terms[keep], SHORT_VOCAB, 1.5, dtype)
        assert_within(values[:used.numel()], exact[used], bound[used], what="touched rows' values")
        assert torch.equal(sparse_rows, used) and torch.equal(sparse_values, values[:used.numel()])

        sorted_rows, sorted_values, _, _, kernels, sorts = _short_batch_rows(
            backend, emulated, torch.cat([torch.randn(40, dim, dtype=torch.float64).to(dtype), dout]),
            torch.cat([torch.full((40,), -1), ids]), by_freq)
        # Per call: the tile sort (one launch), starts, chunks, finish; no library sort
        assert (sorts, kernels) == (0, 4) if backend == "cuda" else (
            sorts == 0 and interpreted_launches.count("_tile_rank_kernel") == 2), (kernels, sorts)
        # min(tokens, V) slots, those past the used rows marked -1 (as the sort's inputs start them)
        assert sorted_rows.tolist() == used.tolist() + [-1] * (sorted_rows.numel() - used.numel())
        assert torch.equal(sorted_values[:used.numel()], values[:used.numel()])


# Learned positions by p = offset + t: their gradient is written by extra blocks of the
# token table's last kernel -- no launch of its own -- with the sums the kernel that
# writes it alone (a frozen token table) makes, bit for bit: on the short-batch path and
# the sorted one, with an offset that leaves rows unreached and a sequence that runs past
# the table of positions.
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("batch, seq_len", [(1, 1), (3, 7), (4, 50)], ids=["1x1", "3x7", "4x50"])
@pytest.mark.parametrize("offset, num_positions", [(0, 60), (5, 30)], ids=["from-0", "offset-5"])
def test_learned_positions_gradient_rides_in_the_tables_last_kernel(request, backend, dtype, batch, seq_len, offset,
                                                                    num_positions):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (no GPU here)")
    gen = torch.Generator().manual_seed(batch * seq_len + offset)
    ids = torch.randint(0, 40, (batch, seq_len), generator=gen)
    dout = torch.randn(batch, seq_len, 24, generator=gen).to(dtype)
    if backend == "cuda":
        emulated = request.getfixturevalue("emulated")

        def run(need_weight_grad):
            emulated.take_launch_counts()
            _, dp = emulated.embedding_backward(dout, ids, None, offset, 40, num_positions, 1.0, None, False,
                                                need_weight_grad, True)
            return dp, emulated.take_launch_counts()[0]
    else:
        from pyembed import _triton

        launched = request.getfixturevalue("interpreted_launches")

        def run(need_weight_grad):
            launched.clear()
            _, dp = _triton.backward(dout, ids, None, offset, 40, num_positions, 1.0, None, False, need_weight_grad,
                                     True)
            return dp, len(launched)
    table_launches = 1 if ids.numel() <= 32 else 3
    dp, launches = run(True)
    dp_alone, launches_alone = run(False)
    assert (launches, launches_alone) == (table_launches, 1)
    assert torch.equal(dp, dp_alone)
    keys = (offset + torch.arange(seq_len)).expand(batch, seq_len)
    reached = keys < num_positions
    exact, bound = accumulation_bound(keys[reached], dout[reached], num_positions, 1.0, dtype)
    assert_within(dp, exact, bound, what="dP")


# ----------------------------------------------------------------- the default check on a GPU
# validate=True on CUDA tensors checks the ranges inside the forward kernel (pyembed.checks):
# no sync; the next forward on the device raises what the kernel recorded. Shown here on the
# CPU by letting the CPU count as such a device, with the Triton interpreter and the CUDA
# kernels under host emulation writing the same record.
def _bad_inputs():
    weight, pos_weight = torch.randn(10, 8, dtype=torch.float64), torch.randn(6, 8, dtype=torch.float64)
    return torch.tensor([[1, 2, 12, 3], [-5, 4, 9, 0]]), weight, pos_weight


def test_check_errors_waits_for_a_gpu_only_when_asked(monkeypatch):
    from pyembed import checks

    waited = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waited.append(device))
    checks.check_errors("cuda:0", wait=False)  # a host memory read: never waits
    assert waited == []
    checks.check_errors("cuda:0")
    assert waited == [torch.device("cuda", 0)]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
def test_triton_default_check_never_syncs_and_the_next_call_raises(monkeypatch):
    pytest.importorskip("triton", reason="triton is not installed")
    import pyembed
    from pyembed import checks

    monkeypatch.setattr(checks, "KERNEL_CHECKED_DEVICES", ("cuda", "cpu"))
    checks.check_errors("cpu")  # nothing left over
    ids, weight, pos_weight = _bad_inputs()
    with HostSyncRecorder() as rec:
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton")
    assert rec.syncs == []
    bad = (ids < 0) | (ids >= 10)
    assert not out[bad].any()  # zero rows, positional term included
    expected = pyembed.fused_embedding(ids.clamp(0, 9), weight, pos_weight, scale=2.0, backend="reference")
    torch.testing.assert_close(out[~bad], expected[~bad], rtol=1e-12, atol=1e-12)
    with pytest.raises(IndexError, match=r"earlier call on cpu: id (12|-5), but the embedding table has V=10 rows"):
        pyembed.fused_embedding(ids[:, :2].clamp(0, 9), weight, backend="triton")
    pyembed.fused_embedding(ids.clamp(0, 9), weight, backend="triton")  # raised once, then cleared
    checks.check_errors("cpu")

    positions = torch.tensor([[0, 1, 7, 2]])  # 7 >= max_seq_len = 6
    out = pyembed.fused_embedding(ids[:1].clamp(0, 9), weight, pos_weight, position_ids=positions, backend="triton")
    assert torch.equal(out[0, 2], weight[ids[0, 2].clamp(0, 9)])  # a bad position adds nothing
    with pytest.raises(ValueError, match=r"position 7, positions must be in 0..5 \(.*max_seq_len=6\)") as raised:
        pyembed.check_errors()  # every device with a record
    assert isinstance(raised.value, RuntimeError)  # as every pyembed ValueError (DESIGN §3)
    pyembed.fused_embedding(ids[:1].clamp(0, 9), weight, pos_encoding="sinusoidal", position_ids=-positions,
                            backend="triton")
    with pytest.raises(ValueError, match="position -(1|7|2), positions must be >= 0"):
        pyembed.fused_embedding(ids[:1].clamp(0, 9), weight, backend="triton")
    # validate="sync" raises in the call itself; False records nothing.
    with pytest.raises(IndexError, match="min id -5, max id 12"):
        pyembed.fused_embedding(ids, weight, validate="sync", backend="triton")
    pyembed.fused_embedding(ids, weight, validate=False, backend="triton")
    checks.check_errors("cpu")


@pytest.mark.parametrize("ids", [[[1, 12, 4, 1], [-5, 4, 7, 0]], [[12, -5]], [[3, 3, 9]]],
                         ids=["some out of range", "all out of range", "all in range"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_max_norm_where_the_kernel_checks_renormalises_without_a_sync(monkeypatch, ids, dtype):
    """On a GPU, where the default check runs inside the lookup's kernel, a FusedEmbedding's
    max_norm renormalises the rows its ids look up without reading the ids back (torch's
    CUDA renorm does not sync either, but indexes the table with them unchecked; pyembed
    checked them first, a sync per call): an id out of range touches no row and is
    reported by the next call, as any bad id. Shown on CPU tensors taken as a kernel-checked
    device, with the triton backend: the rows as nn.Embedding(max_norm) leaves them for the
    ids in range, every other row bit for bit as it was."""
    pytest.importorskip("triton", reason="triton is not installed")
    from pyembed import checks

    monkeypatch.setattr(checks, "KERNEL_CHECKED_DEVICES", ("cuda", "cpu"))
    checks.check_errors("cpu")  # nothing left over
    table = torch.randn(10, 6, dtype=dtype, generator=torch.Generator().manual_seed(4)) * 2  # rows past max_norm
    ours = pyembed.FusedEmbedding.from_pretrained(table.clone(), freeze=False, max_norm=1.0, norm_type=1.5,
                                                  backend="triton")
    theirs = torch.nn.Embedding.from_pretrained(table.clone(), freeze=False, max_norm=1.0, norm_type=1.5)
    ids = torch.tensor(ids)
    in_range = (ids >= 0) & (ids < 10)
    with HostSyncRecorder() as rec:
        out = ours(ids)
    assert rec.syncs == []
    want = theirs(ids[in_range])  # renormalises the same rows, then looks them up
    assert not out[~in_range].any()
    torch.testing.assert_close(out[in_range], want, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-6, atol=1e-7)
    untouched = ~torch.isin(torch.arange(10), ids[in_range])
    assert torch.equal(ours.weight[untouched], table[untouched])
    changed = not torch.equal(ours.weight, table)
    assert changed == bool(in_range.any())  # (so the renorm was exercised)
    if in_range.all():
        checks.check_errors("cpu")  # nothing recorded
    else:
        with pytest.raises(IndexError, match=r"earlier call on cpu: id (12|-5), but the embedding table has V=10"):
            ours(ids.clamp(0, 9))


def test_emulated_cuda_kernel_records_bad_ranges_and_the_next_call_raises(emulated):
    from pyembed import checks

    checks.check_errors("cpu")
    record = checks.error_record_address(torch.device("cpu"))
    ids, weight, pos_weight = _bad_inputs()
    with HostSyncRecorder() as rec:
        out = emulated.embedding_forward(ids, weight, pos_weight, None, "learned", 2.0, 0, None, 0.0, 0, 0, record)
    assert rec.syncs == []
    bad = (ids < 0) | (ids >= 10)
    assert not out[bad].any()
    found = list(checks._error_records[torch.device("cpu")].view)
    assert found[0] == 1 and found[1] in (12, -5) and found[2] == 10 and found[3] == 0
    with pytest.raises(IndexError) as raised:  # the C++ op reads the record before its launch
        emulated.embedding_forward(ids.clamp(0, 9), weight, None, None, "none", 1.0, 0, None, 0.0, 0, 0, record)
    assert str(raised.value) == str(checks.deferred_error(torch.device("cpu"), found))  # one message, two languages
    checks.check_errors("cpu")  # the op cleared it
    emulated.embedding_forward(ids, weight, pos_weight, None, "learned", 2.0, 0, None, 0.0, 0, 0, record)
    with pytest.raises(IndexError, match="id (12|-5), but the embedding table has V=10"):
        checks.check_errors("cpu", wait=False)  # what has run so far, without a synchronisation
    checks.check_errors("cpu")

    positions = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 2]])  # 6 >= max_seq_len
    emulated.embedding_forward(ids.clamp(0, 9), weight, pos_weight, positions, "learned", 1.0, 0, None, 0.0, 0, 0,
                               record)
    found = list(checks._error_records[torch.device("cpu")].view)
    assert found[:6] == [0, 0, 0, 1, 6, 6]
    with pytest.raises(ValueError) as raised:
        emulated.embedding_forward(ids.clamp(0, 9), weight, None, None, "none", 1.0, 0, None, 0.0, 0, 0, record)
    assert str(raised.value) == str(checks.deferred_error(torch.device("cpu"), found))
    emulated.embedding_forward(ids.clamp(0, 9), weight, None, -positions, "sinusoidal", 1.0, 0, None, 0.0, 0, 0,
                               record)
    found = list(checks._error_records[torch.device("cpu")].view)
    assert found[3] == 1 and found[4] < 0 and found[5] == -1
    checks._error_records[torch.device("cpu")].memory.zero_()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
def test_eager_triton_calls_skip_the_dispatcher_and_issue_few_aten_ops(interpreted_launches):
    """On a GPU the host pays for every Python layer around a launch (an H100 measured
    ~188 us per one-token triton forward, of which ~50 us the custom op's dispatch). Eager
    calls run the ops' bodies directly; torch.compile and torch.func still get the ops
    (fakes, vmap rules: the other tests). Per eager forward + dense backward, the ATen
    ops issued around the kernels are counted (kernel launches not included)."""
    import pyembed

    ids = torch.randint(0, 50, (2, 8))
    weight, pos_weight = torch.randn(50, 16, requires_grad=True), torch.randn(8, 16, requires_grad=True)
    with HostSyncRecorder() as rec:
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, validate=False, backend="triton")
    forward_ops = list(rec.names)
    assert not [n for n in forward_ops if n.startswith("pyembed::")], forward_ops
    assert len(forward_ops) <= 3, forward_ops  # the output's allocation (and room for a view)
    with HostSyncRecorder() as rec:
        out.backward(torch.ones_like(out))
    assert not [n for n in rec.names if n.startswith("pyembed::")], rec.names
    expected = torch.zeros(50, 16).index_add_(0, ids.reshape(-1), torch.full((16, 16), 2.0))
    torch.testing.assert_close(weight.grad, expected)
    torch.testing.assert_close(pos_weight.grad, torch.full((8, 16), 2.0))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_calls_that_need_no_gradient_skip_the_autograd_function(monkeypatch, backend):
    """Inference (torch.no_grad, frozen tables) asks no gradient of a call: the backends
    whose kernels are Python run the forward op alone, without an autograd.Function (its
    apply and saved context were ~8 us of a one-token triton lookup's host time, launch
    stubbed). With a gradient: the reference backend's Function, triton's C++ node."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter (no GPU here)")
    import pyembed
    from pyembed import _autograd

    def refuse(*args):
        raise AssertionError("an autograd.Function was applied")

    ids = torch.randint(0, 50, (2, 8))
    weight, pos_weight = torch.randn(50, 16), torch.randn(8, 16)
    expected = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend=backend)
    for cls in (_autograd.FusedEmbeddingFunction, _autograd.FusedEmbeddingFunctionWithJvp):
        monkeypatch.setattr(cls, "apply", refuse)
    monkeypatch.setattr(_autograd, "eager_apply", refuse)  # before torch 2.14: the C apply beneath .apply
    frozen = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend=backend)
    with torch.no_grad():
        trainable = pyembed.fused_embedding(ids, weight.requires_grad_(), pos_weight, scale=2.0, backend=backend)
    exact = weight.detach().double()[ids] * 2.0 + pos_weight.double()[:8]
    torch.testing.assert_close(frozen.double(), exact)
    assert torch.equal(frozen, expected) and torch.equal(trainable, expected)
    if backend == "triton":  # a gradient is wanted here: the node of pyembed::embedding's call
        out = pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend=backend)
        assert "EmbeddingFunction" in out.grad_fn.name() and torch.equal(out.detach(), expected)
        return
    with pytest.raises(AssertionError, match="autograd.Function was applied"):  # a gradient is wanted here
        pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend=backend)


@pytest.mark.parametrize("position_ids", [False, True])
@pytest.mark.parametrize("sort", ["tile", "cub"])
def test_emulated_cuda_dense_gradient_is_written_once_and_sorted_on_narrow_keys(emulated, monkeypatch, position_ids,
                                                                              sort):
    """The (V, d) gradient gets no zero fill before its kernels (a whole extra pass over
    the table: ~47 us of a GPT-2 backward on an H100): the last kernel runs over every row,
    writing sums or zeros. The tile sort orders 32-bit words (no torch op); CUB's sort
    (PYEMBED_CUDA_SORT=cub) sees 32-bit keys, of which it sorts the bits V needs (the
    emulation checks every key fits them). Memory that held NaNs before is reused, so a row
    the kernels missed would show."""
    monkeypatch.setenv("PYEMBED_CUDA_SORT", sort)
    ids, dout, positions = _written_once_inputs(position_ids)
    with HostSyncRecorder() as rec:
        dw, dp = emulated.embedding_backward(dout, ids, positions, 0, 300, 40, 1.5, 5, False, True, position_ids)
    _assert_written_once(rec, ids, dout, positions, dw, dp, key_dtype=torch.int32 if sort == "cub" else None)


def _written_once_inputs(position_ids: bool):
    """(ids, dout, positions or None) for a (300, 16) table with a hot row, out-of-range
    ids and the padding row 5; memory that held NaNs is freed first, so the allocator hands
    it to the gradient and a row the kernels missed would show."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 300, (4, 256), generator=gen)
    ids[:, :100] = 7  # a hot row, summed in per-chunk pieces
    ids[0, :3] = torch.tensor([-1, 300, 5])  # out of range, and the padding row
    dout = torch.randn(4, 256, 16, generator=gen)
    positions = torch.randint(0, 40, ids.shape, generator=gen)
    for _ in range(3):
        torch.full((300, 16), float("nan"))
    return ids, dout, positions if position_ids else None


def _assert_written_once(rec, ids, dout, positions, dw, dp, key_dtype):
    """No fill among the recorded ops, torch sorts of key_dtype keys (None: no torch sort),
    and (dW, dP) within the accumulation bound of the float64 index_add of the kept tokens
    (scale 1.5, padding row 5)."""
    fills = [c for c in rec.calls if c[0] in ("aten::zero_", "aten::fill_")]
    assert fills == [], fills  # (the segment bounds' zeros are written by the sort-inputs kernel)
    sorts = [c for c in rec.calls if c[0] == "aten::sort"]
    assert (sorts and all(c[1] == key_dtype for c in sorts)) if key_dtype else not sorts, sorts
    keep = (ids >= 0) & (ids < 300) & (ids != 5)
    exact, bound = accumulation_bound(ids[keep], dout[keep], 300, 1.5, torch.float32)  # DESIGN §7's rule
    assert_within(dw, exact, bound, what="dW")  # NaN (a row never written) fails any bound
    if positions is not None:
        exact, bound = accumulation_bound(positions, dout, 40, 1.0, torch.float32)
        assert_within(dp, exact, bound, what="dP")


# (backend, dtype, d): 16-byte accesses or one element, and GPT-2's row (three column
# tiles on triton: fp32 only there, each case takes the interpreter ~15 s).
SOLO_CASES = [(backend, dtype, dim) for backend in ("cuda", "triton")
              for dtype in (torch.float32, torch.bfloat16, torch.float64) for dim in (8, 60, 768)
              if backend == "cuda" or dim < 768 or dtype == torch.float32]


@pytest.mark.parametrize("backend, dtype, dim", SOLO_CASES, ids=str)
def test_learned_positions_write_the_one_token_rows_bit_for_bit(request, backend, dtype, dim):
    """With p = offset + t the token table's last kernel also sums the positions, reading
    every token's dout row; when every token's position is in the table, those
    blocks also write the table rows used by one token, and the table's blocks leave them
    (their dout rows were read twice). The table's gradient must not change by a bit,
    whether they do (offset 0, and 20: the last position is the table's last row) or not
    (offset 30: the last tokens' positions are past the table), and must be the exact sums
    (integer-valued dout); three kernels around the sort either way."""
    ids, dout, used = solo_rows_ids_and_grad(dtype, dim)
    if backend == "cuda":
        emulated = request.getfixturevalue("emulated")

        def backward(offset, need_pos_grad, by_freq):
            emulated.take_launch_counts()
            grads = emulated.embedding_backward(dout, ids, None, offset, SOLO_VOCAB, 120, -0.5, 5, by_freq, True,
                                                need_pos_grad)
            assert emulated.take_launch_counts() == (3, 0)  # the tile sort (one tile), chunks, finish
            return grads
    else:
        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter (no GPU here)")
        from pyembed import _triton
        from pyembed.kernels import embedding as k

        launched = request.getfixturevalue("interpreted_launches")
        segments = k.sorted_segments(dout.reshape(-1, dim), ids, SOLO_VOCAB, 5, by_row=True, with_solo=True)
        flat = ids.reshape(-1)
        counts = torch.bincount(flat[used.reshape(-1)], minlength=SOLO_VOCAB)
        alone = used.reshape(-1) & (counts[flat.clamp(0, SOLO_VOCAB - 1)] == 1)
        assert torch.equal(segments.solo, torch.where(alone, flat, -1))  # the tokens the position blocks write

        def backward(offset, need_pos_grad, by_freq):
            launched.clear()
            grads = _triton.backward(dout, ids, None, offset, SOLO_VOCAB, 120, -0.5, 5, by_freq, True, need_pos_grad)
            assert launched == ["_tile_rank_kernel", "_chunk_kernel", "_finish_segments_kernel"]  # one tile
            return grads
    for by_freq in (False, True):
        alone_dw, _ = backward(0, False, by_freq)
        if not by_freq:
            assert torch.equal(alone_dw, (exact_row_sums(ids[used], dout[used], SOLO_VOCAB) * -0.5).to(dtype))
        for offset in (0, 20, 30):
            dw, dp = backward(offset, True, by_freq)
            assert torch.equal(dw, alone_dw), (by_freq, offset)
            positions = (offset + torch.arange(100)).expand(4, 100)
            reached = positions < 120
            assert torch.equal(dp, exact_row_sums(positions[reached], dout[reached], 120).to(dtype))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
def test_triton_dense_backward_reads_dout_once_for_rows_used_once(interpreted_accesses):
    """Issue #30's bytes, counted from the kernels' own accesses: the learned positions'
    programs read every token's dout row they reach, and with every position in the table
    (offset 0) they also write the rows used by one token, so the table's programs read dout
    only for rows used more than once (the 160-use row's in the chunk pass, as pieces);
    otherwise (offset 30) the table's programs read every used token's row. The gradients
    are written once each, every element."""
    from pyembed import _triton

    dim = 60
    ids, dout, used = solo_rows_ids_and_grad(torch.float32, dim)
    counts = torch.bincount(ids[used], minlength=SOLO_VOCAB)
    shared = int((used & (counts[ids.clamp(0, SOLO_VOCAB - 1)] > 1)).sum())  # tokens of rows used twice or more
    for offset, reached, table_reads in ((0, 400, shared), (30, 360, int(used.sum()))):
        interpreted_accesses.clear()
        dw, dp = _triton.backward(dout, ids, None, offset, SOLO_VOCAB, 120, 1.0, 5, False, True, True)
        assert interpreted_accesses.loads(dout) == (reached + table_reads) * dim, offset
        for grad in (dw, dp):
            assert interpreted_accesses.stores(grad) == interpreted_accesses.unique_stores(grad) == grad.numel()
    assert int(used.sum()) - shared > 150  # the tokens whose row is theirs alone: read once, not twice


def test_emulated_cuda_dense_gradient_of_no_tokens_is_zeros(emulated):
    for _ in range(3):
        torch.full((30, 8), float("nan"))
    dw, dp = emulated.embedding_backward(torch.empty(0, 8), torch.empty(0, dtype=torch.long),
                                         torch.empty(0, dtype=torch.long), 0, 30, 12, 1.0, None, False, True, True)
    assert torch.equal(dw, torch.zeros(30, 8)) and torch.equal(dp, torch.zeros(12, 8))


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
@pytest.mark.parametrize("position_ids", [False, True])
@pytest.mark.parametrize("tile_sort", [True, False], ids=["tile sort", "torch's sort"])
def test_triton_dense_gradient_is_written_once_and_sorted_on_narrow_keys(interpreted_launches, monkeypatch,
                                                                        position_ids, tile_sort):
    """As the emulated CUDA test above, for the triton backend's dense backward: its tile
    sort orders 32-bit words of 18 key bits and 14 position bits (no torch op); torch's sort
    takes every bit of its keys, so a table under 2^16 rows sorts int16 keys: two radix
    passes, as CUB's bit-limited sort makes on the cuda backend."""
    from pyembed import _triton

    if not tile_sort:
        monkeypatch.setenv("PYEMBED_TRITON_TILE_SORT", "0")
    ids, dout, positions = _written_once_inputs(position_ids)
    with HostSyncRecorder() as rec:
        dw, dp = _triton.backward(dout, ids, positions, 0, 300, 40, 1.5, 5, False, True, position_ids)
    _assert_written_once(rec, ids, dout, positions, dw, dp, key_dtype=None if tile_sort else torch.int16)
    # 1024 tokens: two tiles for each table
    assert interpreted_launches.count("_merge_tiles_kernel") == (1 + position_ids if tile_sort else 0)


# Every route a compiled call can take (pyembed/functional.py, _autograd.apply_fused): the
# common call's op, the sparse gradient's op, the general route's Function.
COMPILED_ROUTES = {
    "common": dict(pos_encoding="sinusoidal"),
    "sparse": dict(pos_encoding="sinusoidal", sparse=True),
    "sparse learned dropout": dict(learned=True, sparse=True, dropout_p=0.2),
    "position_ids": dict(learned=True, position_ids=torch.tensor([[0, 5, 1]])),
    "by_freq padding": dict(scale_grad_by_freq=True, padding_idx=2),
}


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter (no GPU here)")
@pytest.mark.parametrize("route", COMPILED_ROUTES)
def test_compiled_default_check_is_one_graph_and_reports_at_the_next_call(monkeypatch, route):
    """Under torch.compile(fullgraph=True) the in-kernel check's record address is a
    constant of the graph (no graph break, no recompile), and the next compiled call
    raises what the kernel recorded -- on every route (the sparse gradient's, an op of its
    own, once ran its forward without the record: nothing was ever reported)."""
    pytest.importorskip("triton", reason="triton is not installed")
    import pyembed
    from pyembed import checks
    from torch._dynamo.testing import CompileCounterWithBackend

    monkeypatch.setattr(checks, "KERNEL_CHECKED_DEVICES", ("cuda", "cpu"))
    checks.check_errors("cpu")
    torch._dynamo.reset()
    kwargs = dict(COMPILED_ROUTES[route])
    sparse = kwargs.get("sparse", False)
    weight = torch.randn(10, 8, requires_grad=True)
    pos_weight = torch.randn(6, 8) if kwargs.pop("learned", False) else None
    counter = CompileCounterWithBackend("aot_eager")
    layer = torch.compile(lambda ids: pyembed.fused_embedding(ids, weight, pos_weight, scale=2.0, backend="triton",
                                                              **kwargs), backend=counter, fullgraph=True)
    out = layer(torch.tensor([[1, 12, 3]]))
    if not kwargs.get("dropout_p"):
        assert not out[0, 1].any()
    out.sum().backward()
    rows = weight.grad.coalesce()._indices()[0].tolist() if sparse else weight.grad.sum(1).nonzero()[:, 0].tolist()
    assert 12 not in rows and set(rows) <= {1, 3}  # the bad id adds to no row
    with pytest.raises(IndexError, match="id 12, but the embedding table has V=10"):
        layer(torch.tensor([[1, 4, 3]]))
    good = layer(torch.tensor([[1, 4, 3]]))
    if not kwargs.get("dropout_p"):
        expected = pyembed.fused_embedding(torch.tensor([[1, 4, 3]]), weight.detach(), pos_weight, scale=2.0,
                                           backend="reference", **kwargs)
        torch.testing.assert_close(good, expected)
    assert counter.frame_count == 1
    torch._dynamo.reset()
