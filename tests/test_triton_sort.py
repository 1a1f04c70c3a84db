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


def _row_tiles(row_tiles, monkeypatch):
    """The dense gradient's last pass with ``row_tiles`` tiles a program (PYEMBED_TRITON_ROW_TILES),
    planned afresh (a plan replays the launch it was bound with)."""
    from pyembed import _triton

    monkeypatch.setenv("PYEMBED_TRITON_ROW_TILES", row_tiles)
    monkeypatch.setattr(_triton, "_backward_plans", {})
    return int(row_tiles)


def _assert_every_kind_of_tile(summed_rows, tile_rows, row_tiles):
    """Among the programs' rows (row_tiles tiles of tile_rows each), a program with no row to
    sum (its zeros stored at once) and one with some; with several tiles a program, in a
    program with sums also a tile without (its zeros stored by the tile)."""
    rows = row_tiles * tile_rows
    padded = torch.nn.functional.pad(summed_rows, (0, -summed_rows.numel() % rows))  # the last program's
    groups = padded.view(-1, row_tiles, tile_rows).any(2)  # (programs, tiles): a row to sum
    assert (~groups.any(1)).any() and groups.any(1).any()
    assert row_tiles == 1 or (groups.any(1, keepdim=True) & ~groups).any()


def test_finish_row_tiles_takes_four_only_for_large_two_byte_tables(monkeypatch):
    """Four tiles a program where most programs hold nothing to sum and a tile is 32 bytes a
    thread: a dense gradient of 2-byte elements, 16-byte rows, 2^16 rows or more. The
    variable's other settings are for a GPU run to time, and a bad one is refused."""
    from pyembed.kernels import embedding as k

    monkeypatch.delenv("PYEMBED_TRITON_ROW_TILES", raising=False)
    assert k.finish_row_tiles(torch.bfloat16, 4096, 128256, True) == 4  # Llama-3
    assert k.finish_row_tiles(torch.float16, 8, 2**16, True) == 4
    assert k.finish_row_tiles(torch.bfloat16, 768, 50257, True) == 1  # GPT-2: 76% of its programs would sum
    assert k.finish_row_tiles(torch.float32, 4096, 128256, True) == 1  # 64 bytes a thread already
    assert k.finish_row_tiles(torch.bfloat16, 100, 128256, True) == 1  # 200-byte rows: stored element-wise
    assert k.finish_row_tiles(torch.bfloat16, 4096, 128256, False) == 1  # a sparse gradient's rows
    monkeypatch.setenv("PYEMBED_TRITON_ROW_TILES", "2")
    assert k.finish_row_tiles(torch.float32, 768, 50257, False) == 2
    monkeypatch.setenv("PYEMBED_TRITON_ROW_TILES", "3")
    with pytest.raises(ValueError, match="PYEMBED_TRITON_ROW_TILES must be 1, 2 or 4"):
        k.finish_row_tiles(torch.bfloat16, 4096, 128256, True)


def test_finish_sum_stages_pipelines_the_rows_loop_in_four_tile_programs_or_on_request(monkeypatch):
    """The loop summing a segment's rows is pipelined (3 stages) in a 2-byte table's programs
    of four row tiles (a large table, finish_row_tiles), else runs as written (1), unless
    PYEMBED_TRITON_SUM_STAGES asks for either or 2, for a GPU run to time; never with dropout
    or float64 (the pipelined loop spilled there); a bad setting is refused."""
    from pyembed.kernels import embedding as k

    monkeypatch.delenv("PYEMBED_TRITON_SUM_STAGES", raising=False)
    assert k.finish_sum_stages(torch.float32, False) == 1
    assert k.finish_sum_stages(torch.bfloat16, False) == 1
    row_tiles = k.finish_row_tiles(torch.bfloat16, 4096, 128256, True)  # Llama-3's table: four
    assert k.finish_sum_stages(torch.bfloat16, False, row_tiles) == 3
    assert k.finish_sum_stages(torch.bfloat16, True, row_tiles) == 1  # dropout
    # PYEMBED_TRITON_ROW_TILES=4 on an fp32 table (64 bytes a thread a tile): as written
    assert k.finish_sum_stages(torch.float32, False, 4) == 1
    monkeypatch.setenv("PYEMBED_TRITON_SUM_STAGES", "2")
    assert k.finish_sum_stages(torch.float32, False) == 2
    assert k.finish_sum_stages(torch.bfloat16, True) == 1  # dropout
    assert k.finish_sum_stages(torch.float64, False) == 1
    monkeypatch.setenv("PYEMBED_TRITON_SUM_STAGES", "1")
    assert k.finish_sum_stages(torch.bfloat16, False, row_tiles) == 1
    monkeypatch.setenv("PYEMBED_TRITON_SUM_STAGES", "3")
    assert k.finish_sum_stages(torch.float16, False) == 3
    monkeypatch.setenv("PYEMBED_TRITON_SUM_STAGES", "4")
    with pytest.raises(ValueError, match="PYEMBED_TRITON_SUM_STAGES must be 1, 2 or 3"):
        k.finish_sum_stages(torch.float32, False)


@pytest.mark.parametrize("positions", [False, True], ids=["no positions", "learned positions"])
def test_triton_dense_gradient_is_the_same_at_any_sum_stages(positions, monkeypatch):
    """Zipf-distributed ids (real text: a few rows used hundreds of times, summed from the
    chunks' pieces, many 2-128 times, summed row by row): the dense gradient with the rows'
    loop as written and pipelined (PYEMBED_TRITON_SUM_STAGES 2, 3) is the same, bit for bit
    -- the adds keep their order -- and the float64 reference's. The interpreter runs the
    pipelined loop as a plain one: here the setting's way to the kernel is what is checked;
    tests/gpu runs the compiled ones."""
    from pyembed import _triton, reference
    from pyembed.kernels import embedding as k

    vocab, dim = 3000, 16
    g = torch.Generator().manual_seed(5)
    ids = torch.multinomial(torch.arange(1, vocab + 1, dtype=torch.float64).pow(-1.1), 2 * 600, replacement=True,
                            generator=g).view(2, 600)
    uses = torch.bincount(ids.flatten(), minlength=vocab)
    assert uses.max() > k.CHUNK_ROWS and ((uses > 1) & (uses <= k.CHUNK_ROWS)).sum() > 10
    dout = torch.randn(2, 600, dim, generator=g)
    args = (None, 0, vocab, 600 if positions else 0, 1.5, None, False, True, positions)
    results = {}
    for stages in ("1", "2", "3"):
        monkeypatch.setenv("PYEMBED_TRITON_SUM_STAGES", stages)
        monkeypatch.setattr(_triton, "_backward_plans", {})
        results[stages] = _triton.backward(dout, ids, *args)
    for stages in ("2", "3"):
        for got, want in zip(results[stages], results["1"]):
            assert (got is None and want is None) or torch.equal(got, want), stages
    exact_w, exact_p = reference.embedding_backward(dout.double(), ids, *args)
    assert torch.allclose(results["1"][0].double(), exact_w, rtol=1e-5, atol=1e-5)
    assert not positions or torch.allclose(results["1"][1].double(), exact_p, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("row_tiles", ["1", "2", "4"], ids=lambda r: f"{r} tiles")
@pytest.mark.parametrize("by_freq", [False, True], ids=["plain", "by_freq"])
def test_triton_dense_gradient_writes_untouched_tiles_and_rows_as_plus_zero(by_freq, row_tiles, monkeypatch):
    """The dense gradient's last pass writes the zeros of a program's untouched rows by a
    branch of its own where none of its rows is used (nothing summed), else tile by tile,
    a tile of untouched rows by zeros alone, one with some used rows by summing: under a
    negative scale every kind of untouched row is +0.0, as a zero fill (not +0 * scale =
    -0.0), and the used rows are the float64 reference's. 300 tokens over 20000 rows of
    d = 64 (32-row tiles), with 1, 2 and 4 tiles a program: most hold no used row."""
    from pyembed import _triton, reference
    from pyembed.kernels import embedding as k

    row_tiles = _row_tiles(row_tiles, monkeypatch)
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
    _assert_every_kind_of_tile(~untouched, 32, row_tiles)
    tiles = untouched.view(-1, 32).all(1)
    assert tiles.float().mean() > 0.5 and untouched.view(-1, 32)[~tiles].any()  # most untouched; some mixed
    assert not dw[untouched].any() and not dw[untouched].signbit().any()


@pytest.mark.parametrize("row_tiles", ["1", "4"], ids=lambda r: f"{r} tiles")
@pytest.mark.parametrize("reverse", [False, True], ids=["in order", "in reverse"])
def test_triton_dense_gradient_with_positions_writes_each_row_once(reverse, row_tiles, monkeypatch):
    """With learned positions reaching every token, the dense gradient's last launch writes
    the rows used once from its position programs and every other row from its table
    programs; a tile whose rows are all empty or used once writes only its empty rows'
    zeros. The interpreter runs programs one after another, position programs last, so a
    table program that also wrote a once-used row (zeros, or a sum) would be overwritten
    unseen: the launch runs in reverse program order too (on a GPU they race). 300 tokens
    over 20000 rows of d = 64 (32-row tiles, 1 or 4 a program), a row used 5 times and
    one twice among them."""
    from triton.runtime import interpreter

    from pyembed import _triton, reference
    from pyembed.kernels import embedding as k

    row_tiles = _row_tiles(row_tiles, monkeypatch)
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
    _assert_every_kind_of_tile(uses > 1, 32, row_tiles)
