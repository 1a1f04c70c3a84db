"""The CUDA backend's kernels and host code (csrc/cuda/embedding_kernels.cuh), compiled
by g++ with the host emulation header and run on CPU tensors, against independent
results: eager PyTorch in float64 and the accumulation bound (DESIGN §6), and for drawn
calls the reference ops (pyembed/reference.py, the spec in code)."""

import itertools
import math
import os
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from pyembed import reference

from helpers import (
    BOUNDARY_VOCAB, ID_DTYPES, KEY_WIDTH_VOCABS, WEIGHT_DTYPES, accumulation_bound, assert_within,
    boundary_ids_and_grad, eager_embedding, exact_row_sums, key_width_ids_and_grad, long_segment_ids_and_grad,
    UNIT_ROUNDOFF, make_inputs, max_abs_err, sinusoid_atol, token_order_ids_and_grad,
)


def forward(mod, ids, weight, pos_weight=None, *, pos_encoding="none", scale=1.0, position_ids=None, offset=0,
            sinusoid_column_offset=0, sinusoid_dim=0):
    return mod.embedding_forward(ids, weight, pos_weight, position_ids, pos_encoding, scale, offset, None, 0.0,
                                 sinusoid_column_offset, sinusoid_dim)


def backward(mod, dout, ids, *, position_ids=None, offset=0, num_embeddings, num_positions=0, scale=1.0,
             padding_idx=None, scale_grad_by_freq=False, need_pos_grad=False):
    """(dW, dP) of the dense backward."""
    return mod.embedding_backward(dout, ids, position_ids, offset, num_embeddings, num_positions, scale, padding_idx,
                                  scale_grad_by_freq, True, need_pos_grad)


# (B, T, V, d): single token; d=60 (vector path for fp32, scalar for fp16); d=97 (odd:
# scalar everywhere); tiny vocab (duplicates); a 16-byte-multiple row; GPT-2's d = 768
# (a row is 192 or 96 threads: whole warps, not a power of two).
SHAPES = [(1, 1, 1, 8), (2, 45, 50, 60), (3, 20, 7, 97), (2, 33, 300, 64), (2, 5, 40, 768)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("pos_encoding", ["none", "learned", "sinusoidal"])
@pytest.mark.parametrize("id_dtype", ID_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", WEIGHT_DTYPES, ids=str)
def test_emulated_cuda_forward_and_backward(emulated, dtype, id_dtype, pos_encoding, shape):
    batch, seq_len, vocab, dim = shape
    if pos_encoding == "sinusoidal" and dim % 2:
        dim += 1
    offset = 2 if pos_encoding != "none" else 0
    pos_rows = seq_len + offset + 1 if pos_encoding == "learned" else None
    ids, weight, pos_weight, dout = make_inputs(batch, seq_len, vocab, dim, dtype, id_dtype, pos_rows, seed=11)
    kwargs = dict(pos_encoding=pos_encoding, scale=math.sqrt(dim), offset=offset)

    out = forward(emulated, ids, weight, pos_weight, **kwargs)
    exact = eager_embedding(ids, weight.double(), None if pos_weight is None else pos_weight.double(), **kwargs)
    if dtype in (torch.float32, torch.float64):
        atol = 1e-6 if dtype == torch.float32 else 1e-12
        if pos_encoding == "sinusoidal" and dtype == torch.float32:
            atol = atol + sinusoid_atol(ids, offset=offset)
        assert_within(out, exact, atol, 1e-6, what="emulated forward")
    else:
        eager = eager_embedding(ids, weight, pos_weight, **kwargs)
        assert max_abs_err(out, exact) <= 2 * max_abs_err(eager, exact)

    dw, dp = backward(emulated, dout, ids, num_embeddings=vocab, num_positions=pos_rows or 0, offset=offset,
                      scale=kwargs["scale"], need_pos_grad=pos_encoding == "learned")
    assert dw.shape == weight.shape and dw.dtype == dtype
    scale = float(torch.tensor(kwargs["scale"], dtype=torch.float64 if dtype == torch.float64 else torch.float32))
    w_exact, w_bound = accumulation_bound(ids, dout, vocab, scale, dtype)
    assert_within(dw, w_exact, w_bound, what="emulated dW")
    if pos_encoding == "learned":
        positions = torch.arange(seq_len).expand_as(ids) + offset
        p_exact, p_bound = accumulation_bound(positions, dout, pos_rows, 1.0, dtype)
        assert_within(dp, p_exact, p_bound, what="emulated dP")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_emulated_sparse_padding_and_frequency_scaling(emulated, dtype):
    ids, weight, _, dout = make_inputs(4, 30, 12, 16, dtype, seed=12)
    ids[:, :3] = 5  # the padding row, used often
    rows, values = emulated.embedding_sparse_backward(dout, ids, 12, 0.5, 5, True)
    expected_rows = sorted(set(ids.reshape(-1).tolist()) - {5})
    assert rows.tolist() == expected_rows
    counts = torch.bincount(ids.reshape(-1), minlength=12).double()
    terms = dout.double() / counts[ids][..., None] * (ids != 5)[..., None]
    exact, bound = accumulation_bound(ids, terms, 12, 0.5, dtype)
    assert_within(values, exact[rows], bound[rows], what="emulated sparse dW")


def test_emulated_long_runs_are_summed_in_pieces(emulated):
    # One id 5000 times (40 chunks of 128 sorted positions) next to ids used once.
    ids = torch.cat([torch.full((5000,), 3), torch.arange(10, 20)])[None]
    dout = torch.randn(1, ids.shape[1], 24, dtype=torch.float32)
    dw, _ = backward(emulated, dout, ids, num_embeddings=20)
    exact, bound = accumulation_bound(ids, dout, 20, 1.0, torch.float32)
    assert_within(dw, exact, bound, what="hot row")
    dw_bf16, _ = backward(emulated, torch.ones(1, 4096, 8, dtype=torch.bfloat16), torch.full((1, 4096), 1),
                             num_embeddings=3)
    torch.testing.assert_close(dw_bf16[1].double(), torch.full((8,), 4096.0, dtype=torch.float64), rtol=0.01, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_emulated_segments_across_chunk_boundaries_sum_exactly(emulated, dtype):
    # Integer-valued gradients: every sum is exact in any order, so the dense gradient,
    # the sparse one and the touched rows must equal float64's index_add bit for bit.
    ids, dout = boundary_ids_and_grad(dtype)
    keep = ids != 11  # the padding row
    exact = exact_row_sums(ids, dout, BOUNDARY_VOCAB, skip=11)
    dw, _ = backward(emulated, dout, ids, num_embeddings=BOUNDARY_VOCAB, padding_idx=11)
    assert torch.equal(dw.double(), exact)
    used = sorted(set(ids[keep].tolist()))
    rows, values = emulated.embedding_sparse_backward(dout, ids, BOUNDARY_VOCAB, 1.0, 11, False)
    assert rows.tolist() == used and torch.equal(values.double(), exact[used])
    rows, values = emulated.embedding_touched_rows(dout, ids, BOUNDARY_VOCAB, 1.0, 11, False)
    assert rows.tolist() == used + [-1] * (BOUNDARY_VOCAB - len(used))
    assert torch.equal(values[:len(used)].double(), exact[used])


@pytest.mark.parametrize("dim", [8, 6], ids=str)
def test_emulated_long_segments_sum_by_chunk_pieces_in_token_order(emulated, dim):
    """chunk_kernel's pieces (several rows loaded ahead of their adds) and finish_segments'
    sum of them add in the documented order, bit for bit: dense and sparse."""
    ids, dout, expected = long_segment_ids_and_grad(dim)
    vocab = expected.shape[0]
    dw, _ = backward(emulated, dout, ids, num_embeddings=vocab)
    assert torch.equal(dw, expected)
    used = sorted(set(ids.tolist()))
    rows, values = emulated.embedding_sparse_backward(dout, ids, vocab, 1.0, None, False)
    assert rows.tolist() == used and torch.equal(values, expected[used])


@pytest.mark.parametrize("dim", [8, 60, 768], ids=str)  # 16-byte accesses or one element; GPT-2's row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_emulated_segment_groups_mix_every_kind_of_row(emulated, dtype, dim):
    # finish_segments_kernel takes four consecutive rows per thread group: the untouched and
    # once-used ones in one pass (their loads together), the others one by one after it.
    # Here every group mixes a row used 0, 1, 3 and 130 times (past a chunk of 128: summed
    # in pieces), in a different order each, and the table's last group is partial (23
    # rows). Integer-valued gradients: every sum is exact, so each path must give
    # float64's index_add rounded once, bit for bit.
    uses = [n for order in list(itertools.permutations([0, 1, 3, 130]))[::4] for n in order][:23]
    gen = torch.Generator().manual_seed(5)
    ids = torch.repeat_interleave(torch.arange(23), torch.tensor(uses))
    ids = ids[torch.randperm(ids.numel(), generator=gen)][None]
    dout = torch.randint(-2, 3, (1, ids.shape[1], dim), generator=gen).to(dtype)
    exact = exact_row_sums(ids, dout, 23)
    dw, _ = backward(emulated, dout, ids, num_embeddings=23, scale=-0.5)
    assert torch.equal(dw, (exact * -0.5).to(dtype))
    untouched = torch.tensor(uses) == 0
    assert not dw[untouched].signbit().any()  # +0 as a zero fill, not 0 * a negative scale
    used = torch.tensor(uses).nonzero().reshape(-1)
    rows, values = emulated.embedding_sparse_backward(dout, ids, 23, -0.5, None, False)
    assert torch.equal(rows, used) and torch.equal(values, (exact[used] * -0.5).to(dtype))
    by_freq, _ = backward(emulated, dout, ids, num_embeddings=23, scale_grad_by_freq=True)
    terms = dout.double() / torch.tensor(uses, dtype=torch.float64)[ids][..., None]
    want, bound = accumulation_bound(ids, terms, 23, 1.0, dtype)
    assert_within(by_freq, want, bound, what="scale_grad_by_freq")


@pytest.mark.parametrize("vocab", KEY_WIDTH_VOCABS)
def test_emulated_rows_at_the_sort_keys_width_edges_sum_exactly(emulated, vocab):
    # CUB sorts only the bits V needs (17 from 2^16 rows: the unused mark is V itself).
    ids, dout = key_width_ids_and_grad(vocab)
    keep = ids != vocab - 3
    exact = exact_row_sums(ids, dout, vocab, skip=vocab - 3)
    dw, _ = backward(emulated, dout, ids, num_embeddings=vocab, padding_idx=vocab - 3)
    assert torch.equal(dw.double(), exact)
    used = sorted(set(ids[keep].tolist()))
    rows, values = emulated.embedding_sparse_backward(dout, ids, vocab, 1.0, vocab - 3, False)
    assert rows.tolist() == used and torch.equal(values.double(), exact[used])


# (tokens, rows) of the word sorts (csrc/cuda/embedding_kernels.cuh: up to 2^14 tokens over
# keys of at most 18 bits): the tile sort's single tile and its edge (512, 513: a last tile
# of one), several tiles, all 32 of them, keys of 18 bits; CUB's sort past 2^14 tokens.
SORT_CASES = [(300, 1000), (512, 50257), (513, 50257), (4097, 50257), (16384, 2**18 - 1), (16385, 50257)]


@pytest.mark.parametrize("sort", ["tile", "cub"])
@pytest.mark.parametrize("num_tokens, vocab", SORT_CASES, ids=str)
def test_emulated_sorted_paths_sum_each_row_in_token_order(emulated, monkeypatch, sort, num_tokens, vocab):
    """A stable sort keeps each row's tokens in token order, and its sums follow it, in the
    dense and the sparse backward, whichever sort PYEMBED_CUDA_SORT asks for: the tile sort
    (the default: its real kernels) or CUB's (a stable sort here). Checked on the GPU by
    tests/gpu/test_gpu_parity.py."""
    monkeypatch.setenv("PYEMBED_CUDA_SORT", sort)
    ids, dout, expected, padding_idx = token_order_ids_and_grad(num_tokens, vocab)
    used = torch.unique(ids[(ids >= 0) & (ids < vocab) & (ids != padding_idx)])
    for id_dtype in ID_DTYPES:
        emulated.take_launch_counts()
        dw, _ = backward(emulated, dout, ids.to(id_dtype), num_embeddings=vocab, padding_idx=padding_idx)
        assert torch.equal(dw, expected)
        kernels, sorts = emulated.take_launch_counts()
        if sort == "tile" and num_tokens <= 2**14:  # every case's keys fit 18 bits
            # rank (and merge past one tile), chunk, finish: no library sort
            assert (kernels, sorts) == (3 + (num_tokens > 512), 0)
        else:  # sort_inputs and CUB's sort; chunk, finish
            assert (kernels, sorts) == (3, 1)
        rows, values = emulated.embedding_sparse_backward(dout, ids.to(id_dtype), vocab, 1.0, padding_idx, False)
        assert torch.equal(rows, used) and torch.equal(values, expected[used])


@pytest.mark.parametrize("batch", [2, 5, 8])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_emulated_position_blocks_write_the_batch_rows_in_any_grouping(emulated, batch, dtype):
    """16-byte rows: the learned positions' blocks load four (bf16) or two (fp32) batch rows
    before adding them (position_rows_in_flight), a group cut short when the batch is not a
    multiple of that, and write the table rows used by one token from them. The gradients
    are exact (integer-valued dout: every sum is exact in bf16)."""
    gen = torch.Generator().manual_seed(3)
    vocab, seq_len, dim = 500, 30, 16
    ids = torch.randint(0, vocab, (batch, seq_len), generator=gen)
    dout = torch.randint(-3, 4, (batch, seq_len, dim), generator=gen).to(dtype)
    dw, dp = backward(emulated, dout, ids, num_embeddings=vocab, num_positions=seq_len, need_pos_grad=True)
    assert torch.equal(dw, exact_row_sums(ids, dout, vocab).to(dtype))
    assert torch.equal(dp, dout.double().sum(0).to(dtype))


FINISH_VOCAB = 203  # no multiple of 16: a last group of rows partly past the table


def _neighbouring_hot_rows(gen):
    """(2, 400) ids over FINISH_VOCAB rows: rows 0-3 used 150, 60, 40 and 30 times (neighbouring
    hot rows, as a tokenizer numbers frequent tokens; the first longer than a chunk, summed in
    pieces), the others uniform from row 4: rows of one token and untouched rows among them."""
    ids = torch.randint(4, FINISH_VOCAB, (2, 400), generator=gen)
    flat = ids.view(-1)
    hot = torch.randperm(flat.numel(), generator=gen)
    for row, (start, uses) in enumerate([(0, 150), (150, 60), (210, 40), (250, 30)]):
        flat[hot[start:start + uses]] = row
    return ids


@pytest.mark.parametrize("need_pos_grad", [False, True], ids=["no positions", "learned positions"])
@pytest.mark.parametrize("layout", ["consecutive", "spread"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_emulated_finish_rows_in_either_layout_are_the_exact_sums(emulated, monkeypatch, dtype, layout, need_pos_grad):
    """finish_segments' first pass (rows of at most one token) over consecutive segments, the
    default, or `groups` apart (PYEMBED_CUDA_FINISH_ROWS=spread); its longer segments always
    `groups` apart: neighbouring hot rows (as a tokenizer numbers frequent tokens), one longer
    than a chunk (summed in pieces), rows of one token (with learned positions, written by
    the position blocks), untouched rows, and a row count that is no multiple of four. Every
    row is its exact sum (integer-valued dout: every sum is exact in bf16)."""
    monkeypatch.setenv("PYEMBED_CUDA_FINISH_ROWS", layout)
    gen = torch.Generator().manual_seed(5)
    ids = _neighbouring_hot_rows(gen)
    dout = torch.randint(-3, 4, (*ids.shape, 16), generator=gen).to(dtype)
    vocab, seq_len = FINISH_VOCAB, ids.shape[1]
    dw, dp = backward(emulated, dout, ids, num_embeddings=vocab, num_positions=seq_len, need_pos_grad=need_pos_grad)
    assert torch.equal(dw, exact_row_sums(ids, dout, vocab).to(dtype))
    if need_pos_grad:
        assert torch.equal(dp, dout.double().sum(0).to(dtype))


@pytest.mark.parametrize("options", [{}, {"padding_idx": 5, "scale_grad_by_freq": True}], ids=["plain", "padding+freq"])
@pytest.mark.parametrize("rows", ["4", "8", "16", "8-last"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_emulated_finish_segments_solo_kernel_gives_the_same_bits(emulated, monkeypatch, dtype, rows, options):
    """PYEMBED_CUDA_FINISH_GROUP: with learned positions reaching every token (the position
    blocks write the one-token rows), finish_segments_solo_kernel at `rows` rows a thread
    group (the position blocks first, or last: 8-last) writes the gradients
    finish_segments_kernel writes, bit for bit -- neighbouring hot rows, one longer than a
    chunk (summed in pieces), one-token and untouched rows, a row count that is no multiple
    of 16 -- and with integer-valued dout the exact sums."""
    gen = torch.Generator().manual_seed(6)
    ids = _neighbouring_hot_rows(gen)
    vocab, seq_len, shape = FINISH_VOCAB, ids.shape[1], (*ids.shape, 16)
    for dout in (torch.randn(shape, generator=gen).to(dtype), torch.randint(-3, 4, shape, generator=gen).to(dtype)):
        call = dict(num_embeddings=vocab, num_positions=seq_len, scale=1.5, need_pos_grad=True, **options)
        monkeypatch.delenv("PYEMBED_CUDA_FINISH_GROUP", raising=False)
        emulated.take_launch_counts()
        default = backward(emulated, dout, ids, **call)
        launches = emulated.take_launch_counts()
        monkeypatch.setenv("PYEMBED_CUDA_FINISH_GROUP", rows)
        solo = backward(emulated, dout, ids, **call)
        assert emulated.take_launch_counts() == launches
        assert torch.equal(solo[0], default[0]) and torch.equal(solo[1], default[1])
    if not options:  # the last dout's: exact in either dtype
        assert torch.equal(solo[0], (1.5 * exact_row_sums(ids, dout, vocab)).to(dtype))
        assert torch.equal(solo[1], dout.double().sum(0).to(dtype))


@pytest.mark.parametrize("vocab", [1, 5, 17])
def test_emulated_finish_segments_solo_kernel_on_tables_smaller_than_its_groups(emulated, monkeypatch, vocab):
    """Tables of fewer rows than a group of finish_segments_solo_kernel holds, or just past a
    multiple of them: every form writes the default kernel's gradients, bit for bit (the
    rows past the table never written), fp32 and bf16, with padding and counts or without."""
    gen = torch.Generator().manual_seed(vocab)
    for dim, dtype in ((4, torch.float32), (8, torch.bfloat16)):
        ids = torch.randint(0, vocab, (3, 64), generator=gen)
        dout = torch.randn(3, 64, dim, generator=gen).to(dtype)
        for padding_idx, by_freq in ((None, False), (0, True)):
            call = dict(num_embeddings=vocab, num_positions=64, scale=1.25, padding_idx=padding_idx,
                        scale_grad_by_freq=by_freq, need_pos_grad=True)
            monkeypatch.delenv("PYEMBED_CUDA_FINISH_GROUP", raising=False)
            default = backward(emulated, dout, ids, **call)
            for form in ("4", "8", "16", "8-last"):
                monkeypatch.setenv("PYEMBED_CUDA_FINISH_GROUP", form)
                solo = backward(emulated, dout, ids, **call)
                assert torch.equal(solo[0], default[0]) and torch.equal(solo[1], default[1]), form


def test_emulated_position_ids_and_out_of_range_ids(emulated):
    ids, weight, pos_weight, dout = make_inputs(2, 10, 30, 16, torch.float32, pos_rows=12, seed=13)
    position_ids = torch.randint(0, 12, ids.shape, generator=torch.Generator().manual_seed(1))
    out = forward(emulated, ids, weight, pos_weight, pos_encoding="learned", position_ids=position_ids)
    assert_within(out, eager_embedding(ids, weight, pos_weight, position_ids=position_ids), 1e-6, 1e-6, what="pos ids")
    _, dp = backward(emulated, dout, ids, position_ids=position_ids, num_embeddings=30, num_positions=12,
                        need_pos_grad=True)
    exact, bound = accumulation_bound(position_ids, dout, 12, 1.0, torch.float32)
    assert_within(dp, exact, bound, what="emulated dP with position_ids")

    bad = torch.tensor([[0, 30, -1, 29]])
    out = forward(emulated, bad, weight)
    expected = torch.stack([weight[0], torch.zeros(16), torch.zeros(16), weight[29]])[None]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out = forward(emulated, bad, weight, pos_weight, pos_encoding="learned")
    assert not out[0, 1:3].any()  # no positional term on a bad id's row either
    out = forward(emulated, bad, weight, pos_encoding="sinusoidal")
    assert not out[0, 1:3].any() and out[0, 0].ne(weight[0]).any()
    dw, _ = backward(emulated, torch.ones(1, 4, 16), bad, num_embeddings=30)
    assert torch.equal(dw.sum(1).nonzero().reshape(-1), torch.tensor([0, 29]))


# The forward with learned positions and no position_ids runs four rows or more a block
# where a row is at most 8 KB (forward_min_rows_per_block: narrower thread rows, more passes
# over each row); given the same positions as position_ids it runs row_grid's own shape
# (one row a block from d = 256). Against the float64 result, and the two bit for bit:
# batches whose block rows share a position (B = 8) or cross one (B = 3, 5), rows of one
# pass or several, 16-byte accesses and element-wise ones (d = 97), an empty part in the
# last block.
FOUR_ROW_SHAPES = [(8, 6, 30, 768), (3, 7, 20, 512), (5, 9, 40, 64), (2, 5, 11, 97)]


@pytest.mark.parametrize("shape", FOUR_ROW_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_emulated_forward_at_four_rows_a_block_gives_the_same_bits(emulated, dtype, shape):
    from pyembed import reference

    batch, seq_len, vocab, dim = shape
    ids, weight, pos_weight, _ = make_inputs(batch, seq_len, vocab, dim, dtype, pos_rows=seq_len + 3, seed=17)
    ids[0, 1], ids[-1, -1] = vocab, -1  # out of range (validate=False): zero rows, positional term included
    four_rows = forward(emulated, ids, weight, pos_weight, pos_encoding="learned", scale=1.5, offset=2)
    positions = (torch.arange(seq_len) + 2).expand(batch, seq_len).contiguous()
    one_row = forward(emulated, ids, weight, pos_weight, pos_encoding="learned", scale=1.5, position_ids=positions)
    assert torch.equal(four_rows, one_row)
    exact = reference.embedding_forward(ids, weight.double(), pos_weight.double(), None, "learned", 1.5, 2, None, 0.0)
    atol, rtol = {torch.float32: (1e-6, 1e-6), torch.float64: (1e-12, 1e-12), torch.bfloat16: (1e-5, 2.0**-8)}[dtype]
    assert_within(four_rows, exact, atol, rtol, what="four rows a block")


# The thread rows row_grid (embedding_kernels.cuh) gives a launch over rows of the widths
# real models use -- d = 768 (GPT-2, BERT), 1024, 1600 (GPT-2 XL), 2048, 2560, 4096
# (Llama), 5120, 8192 -- in 16-byte accesses of fp32 (4 elements) and bf16 / fp16 (8), and
# at four rows or more a block (the forward with learned positions): at most an eighth of
# a block's lanes idle over its passes, counted independently of row_grid's own rule (the
# passes a row takes at that width, the lanes they hold, the accesses the row needs).
# Four rows at d = 768 bf16 took 64-thread rows, a quarter of the lanes idle, until the
# width was chosen by its idle lanes (and d = 1600 bf16: 56 of 256).
@pytest.mark.parametrize("min_rows", [1, 4])
@pytest.mark.parametrize("vec", [4, 8])
@pytest.mark.parametrize("dim", [768, 1024, 1600, 2048, 2560, 4096, 5120, 8192])
def test_row_grid_leaves_few_lanes_idle(emulated, dim, vec, min_rows):
    blocks, width, rows = emulated.row_grid(16384, dim, vec, min_rows)
    accesses = dim // vec
    assert width % 32 == 0 and width * rows <= 256 and rows >= min_rows
    assert blocks == -(-16384 // rows)
    lanes = -(-accesses // width) * width
    assert lanes - accesses <= lanes / 8, f"{width} threads a row: {lanes - accesses} of {lanes} lanes idle"


def test_emulated_backward_is_deterministic(emulated):
    ids = torch.randint(0, 5, (4, 500), generator=torch.Generator().manual_seed(2))
    dout = torch.randn(4, 500, 32)
    first = backward(emulated, dout, ids, num_embeddings=5)[0]
    assert torch.equal(first, backward(emulated, dout, ids, num_embeddings=5)[0])


def test_ops_refuse_tensors_on_another_device(emulated):
    # A direct torch.ops.pyembed.* call could hand a kernel another device's pointer.
    ids, weight = torch.tensor([[1, 2]]), torch.randn(4, 8)
    with pytest.raises(ValueError, match="different devices"):
        forward(emulated, ids.to("meta"), weight)
    with pytest.raises(ValueError, match="different devices"):
        forward(emulated, ids, weight, torch.randn(4, 8, device="meta"), pos_encoding="learned")
    with pytest.raises(ValueError, match="different devices"):
        backward(emulated, torch.randn(1, 2, 8), ids.to("meta"), num_embeddings=4)
    with pytest.raises(ValueError, match="different devices"):
        emulated.embedding_sparse_backward(torch.randn(1, 2, 8), ids.to("meta"), 4, 1.0, None, False)


@pytest.mark.parametrize("num_tokens", [20, 600], ids=["few tokens", "sorted"])
def test_ops_refuse_an_output_gradient_of_another_token_count(emulated, num_tokens):
    # A direct torch.ops.pyembed.* call with a gradient of fewer rows than tokens would have
    # the kernels read past it: every op that reads dout checks its shape first.
    ids = torch.randint(0, 50, (2, num_tokens // 2))
    short = torch.randn(2, num_tokens // 2 - 1, 8)
    with pytest.raises(RuntimeError, match="grad_out of shape"):
        backward(emulated, short, ids, num_embeddings=50)
    for op in (emulated.embedding_sparse_backward, emulated.embedding_touched_rows):
        with pytest.raises(RuntimeError, match="grad_out of shape"):
            op(short, ids, 50, 1.0, None, False)
    dw, _ = backward(emulated, torch.ones(2, num_tokens // 2, 8), ids, num_embeddings=50)  # the right shape passes
    assert torch.equal(dw[:, 0], torch.bincount(ids.reshape(-1), minlength=50).float())


# The CUDA backend's launch-shape settings, read by every call (embedding_kernels.cuh):
# each drawn call runs under one of their combinations.
_KERNEL_SETTINGS = {"PYEMBED_CUDA_FINISH_GROUP": ["4", "8", "16", "8-last"], "PYEMBED_CUDA_FINISH_ROWS": ["spread"],
                    "PYEMBED_CUDA_SORT": ["cub"]}


@st.composite
def _op_calls(draw):
    """Arguments of the three ops, drawn: tables at the sort keys' width edges, rows from
    0 to GPT-2's wide, hot ids (segments past a chunk), unchecked out-of-range ids and
    positions (zero rows, no gradient), dropout, and the kernels' settings."""
    pos = draw(st.sampled_from(["none", "learned", "sinusoidal"]))
    vocab = draw(st.sampled_from([1, 3, 40, 300, *KEY_WIDTH_VOCABS]))
    dim = draw(st.sampled_from([0, 1, 2, 3, 4, 8, 12, 60, 64, 97, 128, 768]))
    dim += dim % 2 if pos == "sinusoidal" else 0
    batch, seq_len = draw(st.integers(1, 4)), draw(st.sampled_from([0, 1, 7, 45, 300]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    ids = torch.randint(0, vocab, (batch, seq_len), generator=g)
    hot = draw(st.sampled_from([0.0, 0.5, 1.0]))  # the share of tokens on one row
    ids = torch.where(torch.rand(ids.shape, generator=g) < hot, draw(st.integers(0, vocab - 1)), ids)
    if draw(st.booleans()):
        bad = draw(st.sampled_from([-1, vocab, -2**31, 2**31 - 1]))
        ids = torch.where(torch.rand(ids.shape, generator=g) < 0.2, bad, ids)
    ids = ids.to(draw(st.sampled_from(ID_DTYPES)))
    position_ids, offset = None, draw(st.integers(0, 4))
    if pos != "none" and draw(st.booleans()):
        position_ids, offset = torch.randint(0, 80, ids.shape, generator=g), 0  # past the 64 + T rows at times
    dtype = draw(st.sampled_from([torch.float64, torch.float32, torch.bfloat16]))
    weight = torch.randn(vocab, dim, generator=g).to(dtype)
    pos_rows = 64 + seq_len
    pos_weight = torch.randn(pos_rows, dim, generator=g).to(dtype) if pos == "learned" else None
    dout = torch.randn(batch, seq_len, dim, generator=g).to(dtype)
    dropout_p = draw(st.sampled_from([0.0, 0.3]))
    key = reference.draw_dropout_key(torch.device("cpu"), g) if dropout_p else None
    kernel_settings = {name: draw(st.sampled_from([None, *values])) for name, values in _KERNEL_SETTINGS.items()}
    forward_args = (ids, weight, pos_weight, position_ids, pos, draw(st.sampled_from([1.0, 27.7])), offset, key,
                    dropout_p)
    backward_args = dict(padding_idx=draw(st.none() | st.integers(0, vocab - 1)),
                         scale_grad_by_freq=draw(st.booleans()),
                         num_positions=pos_rows if pos == "learned" else 0)
    return forward_args, dout, backward_args, kernel_settings


@settings(max_examples=int(os.environ.get("PYEMBED_HYPOTHESIS_EXAMPLES", 40)), deadline=None)
@given(call=_op_calls())
def test_emulated_ops_match_the_reference_on_drawn_calls(emulated, call):
    """Forward, dense and sparse backward of any drawn call give the reference ops' results:
    the forward to its one rounding (the sinusoid to DESIGN §7's bound), the gradients
    within both sides' accumulation bound (Higham's, as accumulation_bound: they sum in
    other orders), the sparse rows exactly."""
    (ids, weight, pos_weight, position_ids, pos, scale, offset, key, dropout_p), dout, options, kernel_settings = call
    dtype, num_tokens = weight.dtype, ids.numel()
    with mock.patch.dict(os.environ):  # restored after
        for name, value in kernel_settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        forward_args = (ids, weight, pos_weight, position_ids, pos, scale, offset, key, dropout_p)
        got, want = emulated.embedding_forward(*forward_args), reference.embedding_forward(*forward_args)
        assert got.shape == want.shape and got.dtype == want.dtype
        atol = 0
        if pos == "sinusoidal":  # DESIGN §7's float32 bound; float64's the same in its epsilon
            atol = sinusoid_atol(ids, position_ids, offset) * (2.0**-29 if dtype == torch.float64 else 1)
            atol = atol * 2 / (1 - dropout_p)
        assert_within(got, want, atol, 2 * UNIT_ROUNDOFF[dtype], what="forward")

        def backward_args(grad, table_scale):
            return (grad, ids, position_ids, offset, weight.shape[0], options["num_positions"], table_scale,
                    options["padding_idx"], options["scale_grad_by_freq"], True, pos == "learned", key, dropout_p)
        # Each term's magnitude summed as the gradient sums the terms (mask, 1/count and all).
        abs_sums = reference.embedding_backward(*backward_args(dout.double().abs(), abs(scale)))
        acc_eps = UNIT_ROUNDOFF[torch.float64 if dtype == torch.float64 else torch.float32]

        def bound(want, abs_sum):  # both sides' rounding and summation error
            return 2 * (UNIT_ROUNDOFF[dtype] * want.double().abs() + acc_eps * (num_tokens + 2) * abs_sum)

        got, want = emulated.embedding_backward(*backward_args(dout, scale)), \
            reference.embedding_backward(*backward_args(dout, scale))
        for name, g, w, a in zip(("dW", "dP"), got, want, abs_sums):
            if name == "dW" or pos == "learned":
                assert g.shape == w.shape and g.dtype == w.dtype, name
                assert_within(g, w, bound(w, a), what=name)
        sparse_args = (dout, ids, weight.shape[0], scale, options["padding_idx"], options["scale_grad_by_freq"], key,
                       dropout_p)
        got, want = emulated.embedding_sparse_backward(*sparse_args), reference.embedding_sparse_backward(*sparse_args)
        assert torch.equal(got[0], want[0])
        assert got[1].dtype == want[1].dtype
        assert_within(got[1], want[1], bound(want[1], abs_sums[0][want[0]]), what="sparse values")

