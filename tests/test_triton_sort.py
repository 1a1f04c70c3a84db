"""The `triton` backward's tile sort (kernels/embedding.py tile_sort), under the
interpreter: the keys and tokens it leaves are torch's stable sort's, and the sums over
them follow token order. On a GPU, tests/gpu/test_gpu_parity.py runs the same sizes
through the compiled kernels (test_sorted_paths_sum_each_row_in_token_order)."""

import os

import pytest
import torch

from helpers import ID_DTYPES, token_order_ids_and_grad

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs the Triton interpreter (no GPU here)")


def _sort(keys, num_rows, skip, blocks=None):
    """(sorted keys as int64, tokens, bounds) from the tile sort, the bounds' memory NaN-free garbage first."""
    from pyembed.kernels import embedding as k

    n = keys.numel()
    sorted_keys = torch.empty(n, dtype=k.sort_key_dtype(num_rows))
    order = torch.empty(n, dtype=torch.long)
    bounds = torch.full((3 * num_rows + 7,), 123, dtype=torch.long)
    k.tile_sort(keys, sorted_keys, order, bounds, 3 * num_rows, num_rows, skip, blocks=blocks)
    unbiased = sorted_keys.long() + (2**15 if sorted_keys.dtype == torch.int16 else 0)
    return unbiased, order, bounds


# (tokens, table rows): one tile, one past it, three tiles with a part-filled last one, a
# GPT-2 batch of 4097 and the largest batch (2^14) over the widest table (2^18 - 1 rows:
# the unused mark takes all 18 key bits) -- and int16 keys either side of the sign split.
SORT_CASES = [(33, 10), (512, 2**15 + 2), (513, 2**16 - 1), (1500, 2**16), (4097, 50257), (2**14, 2**18 - 1)]


@pytest.mark.parametrize("num_tokens, num_rows", SORT_CASES, ids=str)
def test_tile_sort_is_torchs_stable_sort(num_tokens, num_rows):
    """Keys out of the table and the skipped row sort last, as num_rows (the unused mark);
    each key's tokens stay in token order; the bounds start as zeros, then -1."""
    gen = torch.Generator().manual_seed(num_tokens)
    keys = torch.randint(-2, num_rows + 2, (num_tokens,), generator=gen)
    keys[: num_tokens // 3] = num_rows - 1  # a hot row, the largest used key
    keys[-1] = 0
    skip = int(keys[num_tokens // 2])
    unused = (keys < 0) | (keys >= num_rows) | (keys == skip)
    expected_keys, expected_order = torch.where(unused, num_rows, keys).sort(stable=True)
    for id_dtype in ID_DTYPES:
        got_keys, got_order, bounds = _sort(keys.to(id_dtype), num_rows, skip)
        assert torch.equal(got_keys, expected_keys) and torch.equal(got_order, expected_order), id_dtype
        assert torch.equal(bounds, torch.where(torch.arange(bounds.numel()) < 3 * num_rows, 0, -1))


@pytest.mark.parametrize("num_tokens", [100, 1500], ids=["one tile", "three tiles"])
def test_tile_sort_at_the_gpus_blocks(num_tokens):
    """The GPU's blocks (eight rank programs a tile, eight column steps each, merge
    programs of 64 words), which the interpreter otherwise runs a tile at a time."""
    from pyembed.kernels import embedding as k

    keys = torch.randint(0, 600, (num_tokens,), generator=torch.Generator().manual_seed(1))
    keys[::7] = 5
    expected_keys, expected_order = torch.where(keys == 9, 600, keys).sort(stable=True)
    got_keys, got_order, _ = _sort(keys, 600, 9, blocks=(k.RANK_ROWS, k.RANK_COLUMNS, k.MERGE_BLOCK))
    assert torch.equal(got_keys, expected_keys) and torch.equal(got_order, expected_order)


def test_tile_sort_takes_what_fits_its_words(monkeypatch):
    """2^14 tokens (14 position bits) over fewer than 2^18 rows (18 key bits: the unused
    mark num_rows included); PYEMBED_TRITON_TILE_SORT=0 leaves every size to torch's sort."""
    from pyembed.kernels import embedding as k

    assert k.tile_sorts(1, 1) and k.tile_sorts(2**14, 2**18 - 1)
    assert not k.tile_sorts(2**14 + 1, 50257) and not k.tile_sorts(4096, 2**18) and not k.tile_sorts(0, 10)
    monkeypatch.setenv("PYEMBED_TRITON_TILE_SORT", "0")
    assert not k.tile_sorts(4096, 50257)


@pytest.mark.parametrize("num_tokens, vocab", [(1500, 2**16 + 5), (4097, 50257)], ids=str)
def test_triton_sorted_paths_sum_each_row_in_token_order(num_tokens, vocab):
    """Each row's float32 sum adds its tokens in token order, bit for bit (tokens of mixed
    magnitudes: another order gives other bits), in the dense, sparse and touched-rows
    backwards, int64 and int32 ids, with a padding row and out-of-range ids."""
    from pyembed import _triton

    ids, dout, expected, pad = token_order_ids_and_grad(num_tokens, vocab)
    used = torch.unique(ids[(ids >= 0) & (ids < vocab) & (ids != pad)])
    for id_dtype in ID_DTYPES:
        dw, _ = _triton.backward(dout, ids.to(id_dtype), None, 0, vocab, 0, 1.0, pad, False, True, False)
        assert torch.equal(dw, expected), id_dtype
        rows, values = _triton.triton_sparse_backward(dout, ids.to(id_dtype), vocab, 1.0, pad, False)
        assert torch.equal(rows, used) and torch.equal(values, expected[used]), id_dtype
        rows, values = _triton.touched_rows(dout, ids.to(id_dtype), vocab, 1.0, pad, False)
        assert torch.equal(rows[: used.numel()], used) and torch.equal(values[: used.numel()], expected[used])
        assert (rows[used.numel():] == -1).all()


@pytest.mark.parametrize("by_freq", [False, True], ids=["plain", "by_freq"])
def test_triton_dense_gradient_writes_untouched_tiles_and_rows_as_plus_zero(by_freq):
    """The dense gradient's last pass writes a tile of untouched rows by a branch of its
    own (zeros, nothing summed) and a tile with some used rows by summing: under a negative
    scale both kinds of untouched row are +0.0, as a zero fill (not +0 * scale = -0.0), and
    the used rows are the float64 reference's. 300 tokens over 20000 rows of d = 64
    (32-row tiles): most tiles hold no used row, the others mix used and untouched rows."""
    from pyembed import _triton, reference
    from pyembed.kernels import embedding as k

    vocab, scale = 20000, -0.75
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, vocab, (2, 150), generator=g)
    dout = torch.randn(2, 150, 64, generator=g)
    dw, _ = _triton.backward(dout, ids, None, 0, vocab, 0, scale, None, by_freq, True, False)
    expected, _ = reference.embedding_backward(dout.double(), ids, None, 0, vocab, 0, scale, None, by_freq, True, False)
    assert torch.allclose(dw.double(), expected, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[ids.flatten()] = False
    assert k._segment_blocks(64, torch.float32)[0] == 32  # the tiles' rows
    tiles = untouched.view(-1, 32).all(1)
    assert tiles.float().mean() > 0.5 and untouched.view(-1, 32)[~tiles].any()  # both kinds of tile
    assert not dw[untouched].any() and not dw[untouched].signbit().any()


@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "in reverse"])
def test_triton_dense_gradient_with_positions_writes_each_row_once(reverse, monkeypatch):
    """With learned positions reaching every token, the dense gradient's last launch writes
    the rows used once from its position programs and every other row from its table
    programs; a tile whose rows are all empty or used once writes only its empty rows'
    zeros. The interpreter runs programs one after another, position programs last, so a
    table program that also wrote a once-used row (zeros, or a sum) would be overwritten
    unseen: the launch runs in reverse program order too (on a GPU they race). 300 tokens
    over 20000 rows of d = 64 (32-row tiles), a row used 5 times and one twice among them."""
    from triton.runtime import interpreter

    from pyembed import _triton, reference
    from pyembed.kernels import embedding as k

    if reverse:
        builder = interpreter.interpreter_builder
        in_order = builder.set_grid_idx
        monkeypatch.setattr(builder, "set_grid_idx", lambda x, y, z: in_order(
            builder.grid_dim[0] - 1 - x, builder.grid_dim[1] - 1 - y, builder.grid_dim[2] - 1 - z))
    vocab, seq_len, scale = 20000, 150, -0.75
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (2, seq_len), generator=g)
    ids[0, :5], ids[1, 10:12] = 7, 9000  # in two tiles
    dout = torch.randn(2, seq_len, 64, generator=g)
    dw, dp = _triton.backward(dout, ids, None, 0, vocab, seq_len, scale, None, False, True, True)
    exact_w, exact_p = reference.embedding_backward(dout.double(), ids, None, 0, vocab, seq_len, scale, None, False,
                                                    True, True)
    assert torch.allclose(dw.double(), exact_w, rtol=1e-6, atol=1e-6)
    assert torch.allclose(dp.double(), exact_p, rtol=1e-6, atol=1e-6)
    uses = torch.bincount(ids.flatten(), minlength=vocab)
    assert not dw[uses == 0].any() and not dw[uses == 0].signbit().any()  # +0.0, as a zero fill
    assert k._segment_blocks(64, torch.float32)[0] == 32  # the tiles' rows
    tiles = uses.view(-1, 32)
    summed = (tiles > 1).any(1)
    assert summed.sum() == 2 and ((tiles == 1).any(1) & ~summed).any()  # both kinds of tile
