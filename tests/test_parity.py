"""Every backend against independent results: eager PyTorch
(nn.Embedding + mul + add) in the same precision and in float64, for outputs and
gradients, over dtypes, id dtypes, positional encodings and awkward shapes."""

import math
import os
import sys

import pytest
import torch

import pyembed
from helpers import (
    BACKENDS, BOUNDARY_VOCAB, CPU_BACKENDS, ID_DTYPES, KEY_WIDTH_VOCABS, WEIGHT_DTYPES, accumulation_bound,
    assert_within, boundary_ids_and_grad, eager_embedding, exact_row_sums, fused, key_width_ids_and_grad,
    long_segment_ids_and_grad, make_inputs, max_abs_err, run_with_grads, sinusoid_atol,
)

# (B, T, V, d): a single token and a single-row table; 97 tokens with d=60; tiny vocab
# (forced duplicates) with d=100; a plain power-of-two case.
SHAPES = [(1, 1, 1, 8), (1, 97, 50, 60), (4, 33, 7, 100), (3, 17, 1000, 64)]
POS_ENCODINGS = ["none", "learned", "sinusoidal"]


def parity_matrix(test):
    """Every backend (CPU tensors; CUDA tensors too with a GPU) x dtype x id dtype x
    positional encoding x shape."""
    for name, values, ids in (("backend", BACKENDS, None), ("shape", SHAPES, str),
                              ("pos_encoding", POS_ENCODINGS, None), ("id_dtype", ID_DTYPES, str),
                              ("dtype", WEIGHT_DTYPES, str)):
        test = pytest.mark.parametrize(name, values, ids=ids)(test)
    return test


def _case(shape, dtype, id_dtype, pos_encoding, seed=0):
    batch, seq_len, vocab, dim = shape
    offset = 3 if pos_encoding != "none" else 0
    pos_rows = offset + seq_len + 2 if pos_encoding == "learned" else None
    ids, weight, pos_weight, dout = make_inputs(batch, seq_len, vocab, dim, dtype, id_dtype, pos_rows, seed)
    kwargs = dict(pos_encoding=pos_encoding, scale=math.sqrt(dim), offset=offset)
    return ids, weight, pos_weight, dout, kwargs


def _as_f64(t):
    return None if t is None else t.double()


def _forward_atol(dtype, pos_encoding, ids, offset):
    """DESIGN §7: 1e-6 (fp32) / 1e-12 (fp64), plus the float32-sinusoid allowance."""
    atol = 1e-6 if dtype == torch.float32 else 1e-12
    if pos_encoding == "sinusoidal" and dtype == torch.float32:
        return atol + sinusoid_atol(ids, offset=offset)
    return atol


@parity_matrix
def test_forward_matches_eager(backend, dtype, id_dtype, pos_encoding, shape):
    ids, weight, pos_weight, _, kwargs = _case(shape, dtype, id_dtype, pos_encoding)
    ours = fused(backend)(ids, weight, pos_weight, **kwargs)
    assert ours.shape == (*ids.shape, weight.shape[1]) and ours.dtype == dtype
    exact = eager_embedding(ids, weight.double(), _as_f64(pos_weight), **kwargs)
    if dtype in (torch.float32, torch.float64):
        atol = _forward_atol(dtype, pos_encoding, ids, kwargs["offset"])
        rtol = 1e-6 if dtype == torch.float32 else 1e-12
        assert_within(ours, exact, atol, rtol, what=f"{backend} forward vs float64")
        assert_within(ours, eager_embedding(ids, weight, pos_weight, **kwargs), atol, rtol,
                      what=f"{backend} forward vs eager")
    else:
        # DESIGN §7: at most 2x the error of the same-precision eager path.
        eager = eager_embedding(ids, weight, pos_weight, **kwargs)
        assert max_abs_err(ours, exact) <= 2 * max_abs_err(eager, exact)


@parity_matrix
def test_dense_gradients_accumulate_in_fp32(backend, dtype, id_dtype, pos_encoding, shape):
    ids, weight, pos_weight, dout, kwargs = _case(shape, dtype, id_dtype, pos_encoding, seed=1)
    _, dw, dp = run_with_grads(fused(backend), ids, weight, pos_weight, dout, **kwargs)
    assert dw.dtype == dtype and dw.shape == weight.shape and not dw.is_sparse
    # scale is applied in the compute dtype: float32, or float64 for float64 tables.
    scale = float(torch.tensor(kwargs["scale"], dtype=torch.float64 if dtype == torch.float64 else torch.float32))
    exact, bound = accumulation_bound(ids, dout, weight.shape[0], scale, dtype)
    assert_within(dw, exact, bound, what=f"{backend} dW")
    if pos_encoding == "learned":
        positions = torch.arange(ids.shape[1]).expand_as(ids) + kwargs["offset"]
        exact, bound = accumulation_bound(positions, dout, pos_weight.shape[0], 1.0, dtype)
        assert_within(dp, exact, bound, what=f"{backend} dP")
    else:
        assert dp is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_padding_idx_and_scale_grad_by_freq_match_nn_embedding(backend, dtype):
    ids, weight, _, dout = make_inputs(3, 40, 9, 24, dtype, seed=2)
    ids[0, :5] = 8  # the padding row is used, and often
    for padding_idx in (8, -1):
        for by_freq in (False, True):
            kwargs = dict(padding_idx=padding_idx, scale_grad_by_freq=by_freq)
            out, dw, _ = run_with_grads(fused(backend), ids, weight, None, dout, **kwargs)
            # Forward returns the padding row's content, as nn.Embedding does.
            torch.testing.assert_close(out, torch.nn.functional.embedding(ids, weight), rtol=0, atol=0)
            assert torch.all(dw[8] == 0)
            counts = torch.bincount(ids.reshape(-1), minlength=9).double()
            terms = dout.double() / (counts[ids][..., None] if by_freq else 1.0)
            keep = (ids != 8)[..., None]
            exact, bound = accumulation_bound(ids, terms * keep, 9, 1.0, dtype)
            assert_within(dw, exact, bound, what=f"{backend} dW padding={padding_idx} freq={by_freq}")
            _, eager_dw, _ = run_with_grads(eager_embedding, ids, weight.double(), None, dout.double(), **kwargs)
            torch.testing.assert_close(exact, eager_dw)  # the closed form is nn.Embedding's


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_sparse_gradient_is_coalesced_and_equals_nn_embedding(backend, dtype):
    ids, weight, _, dout = make_inputs(4, 25, 30, 16, dtype, seed=3)
    w = weight.clone().requires_grad_()
    out = fused(backend)(ids, w, sparse=True, padding_idx=2, scale=1.5)
    (grad,) = torch.autograd.grad(out, w, dout)
    assert grad.is_sparse and grad.is_coalesced() and grad.dtype == dtype
    indices = grad._indices()[0]
    assert torch.all(indices[1:] > indices[:-1]), "indices must be sorted and unique"
    assert 2 not in indices.tolist(), "the padding row must be absent"
    assert set(indices.tolist()) == set(ids.reshape(-1).tolist()) - {2}, "exactly the touched rows"

    e = torch.nn.Embedding.from_pretrained(weight.double(), freeze=False, padding_idx=2, sparse=True)
    (e(ids) * 1.5).backward(dout.double())
    eager = e.weight.grad.coalesce()
    torch.testing.assert_close(indices, eager._indices()[0])
    _, bound = accumulation_bound(ids, dout, 30, 1.5, dtype)
    assert_within(grad.to_dense(), eager.to_dense(), bound, what=f"{backend} sparse dW")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_sparse_adam_step_equals_eager_step(backend):
    ids, weight, _, dout = make_inputs(2, 50, 40, 12, torch.float32, seed=4)
    ours = pyembed.FusedEmbedding.from_pretrained(weight.clone(), freeze=False, sparse=True, backend=backend)
    eager = torch.nn.Embedding.from_pretrained(weight.clone(), freeze=False, sparse=True)
    for module in (ours, eager):
        opt = torch.optim.SparseAdam(module.parameters(), lr=0.1)
        module(ids).backward(dout)
        opt.step()
    assert not torch.equal(ours.weight, weight), "the step must move the table"
    torch.testing.assert_close(ours.weight, eager.weight, rtol=1e-6, atol=1e-6)
    # .grad holds the sorted, unique rows, flagged so (pyembed._coalesced): SparseAdam skipped its re-sort.
    grad = ours.weight.grad
    assert grad.is_coalesced()
    torch.testing.assert_close(grad._indices(), grad.coalesce()._indices())


def _sorted_unique_rows(grad) -> bool:
    rows = grad._indices()[0]
    return bool(torch.all(rows[1:] > rows[:-1]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_dot_grad_is_flagged_coalesced_exactly_while_it_is(backend):
    """AccumulateGrad drops the flag of the coalesced gradient it stores (pytorch#105916);
    pyembed sets it back when .grad is the gradient it built, and never on a sum that has
    duplicate rows (a flag that lies would make SparseAdam apply a row's update twice)."""
    name, _, device = backend.partition("@")
    ids, weight, _, dout = make_inputs(3, 40, 25, 8, torch.float32, seed=6)
    ids, dout = ids.to(device or "cpu"), dout.to(device or "cpu")
    w = weight.to(ids.device).requires_grad_()
    pyembed.fused_embedding(ids, w, sparse=True, padding_idx=0, backend=name).backward(dout)
    ours = w.grad
    assert ours.is_coalesced() and _sorted_unique_rows(ours)
    eager = torch.nn.Embedding.from_pretrained(weight.double(), freeze=False, padding_idx=0, sparse=True)
    eager(ids.cpu()).backward(dout.cpu().double())
    first = ours.to_dense()  # .grad is summed in place below
    torch.testing.assert_close(first.cpu().double(), eager.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)

    # Accumulated with nn.Embedding's uncoalesced gradient: the sum has duplicate rows.
    torch.nn.functional.embedding(ids, w, sparse=True).backward(dout)
    total = w.grad
    assert not total.is_coalesced() and not _sorted_unique_rows(total)
    expected = first + torch.zeros_like(w).index_add_(0, ids.reshape(-1), dout.reshape(-1, 8))
    torch.testing.assert_close(total.to_dense(), expected)
    # Our coalesced gradient summed into that .grad: it arrived coalesced, the sum is not.
    pyembed.fused_embedding(ids, w, sparse=True, padding_idx=0, backend=name).backward(dout)
    assert not w.grad.is_coalesced() and not _sorted_unique_rows(w.grad)
    torch.testing.assert_close(w.grad.to_dense(), expected + first)

    # The table used twice in one graph: autograd sums the two gradients before .grad.
    w.grad = None
    half = ids.shape[1] // 2
    out = torch.cat([pyembed.fused_embedding(ids[:, :half], w, sparse=True, backend=name),
                     pyembed.fused_embedding(ids[:, half:], w, sparse=True, backend=name)], 1)
    out.backward(dout)
    assert not w.grad.is_coalesced() or _sorted_unique_rows(w.grad)
    exact = torch.zeros_like(w).index_add_(0, ids.reshape(-1), dout.reshape(-1, 8))
    torch.testing.assert_close(w.grad.to_dense(), exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("form", ["module", "functional", "transposed"])
def test_compiled_dot_grad_is_flagged_coalesced_exactly_while_it_is(backend, form):
    """A torch.compile'd backward builds the sparse gradient in Inductor's code, where no
    Python of pyembed's runs: the table's .grad keeps the flag all the same (a flag lost
    there made SparseAdam sort every step again), and the step equals nn.Embedding's --
    a module's table, and a plain Parameter given to the functional op in compiled code,
    contiguous or not (a transposed table's flag was set on the graph's contiguous copy)."""
    name, _, device = backend.partition("@")
    device = device or "cpu"
    torch.manual_seed(8)
    layer = pyembed.EmbeddingLayer(30, 8, 12, sparse=True, backend=name, device=device)
    weight, call = layer.token_embedding.weight, layer
    if form != "module":
        weight = torch.nn.Parameter(weight.detach().t().contiguous().t() if form == "transposed" else weight.detach().clone())
        pos_weight = layer.pos_embedding.detach()

        def functional(ids):
            return pyembed.fused_embedding(ids, weight, pos_weight, sparse=True, backend=name)
        call = functional
    reference = torch.nn.Embedding.from_pretrained(weight.detach().clone(), freeze=False, sparse=True)
    ids = torch.randint(0, 30, (3, 12), device=device)
    dout = torch.randn(3, 12, 8, device=device)
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, backend="inductor")
    compiled(ids).backward(dout)
    grad = weight.grad
    assert grad.is_coalesced() and _sorted_unique_rows(grad)
    reference(ids).backward(dout)
    torch.testing.assert_close(grad.to_dense(), reference.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)

    for table in (weight, reference.weight):
        torch.optim.SparseAdam([table], lr=0.1).step()
    torch.testing.assert_close(weight, reference.weight, rtol=1e-6, atol=1e-6)

    first = grad.to_dense()
    compiled(ids).backward(dout)  # summed into .grad: flagged only if the sum has unique rows
    assert not weight.grad.is_coalesced() or _sorted_unique_rows(weight.grad)
    torch.testing.assert_close(weight.grad.to_dense(), 2 * first)
    torch.nn.functional.embedding(ids, weight, sparse=True).backward(dout)  # nn's rows: duplicates
    assert not weight.grad.is_coalesced() and not _sorted_unique_rows(weight.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dot_grad_built_with_create_graph_is_flagged_too(backend):
    # The Python route and the C++ node (cpu, cuda) record the gradient they build either way.
    name, _, device = backend.partition("@")
    ids, weight, _, _ = make_inputs(3, 10, 25, 8, torch.float64, seed=2)
    w = weight.to(device or "cpu").requires_grad_()
    pyembed.fused_embedding(ids.to(w.device), w, sparse=True, backend=name).pow(2).sum().backward(create_graph=True)
    assert w.grad.is_coalesced() and _sorted_unique_rows(w.grad)
    exact = torch.zeros_like(weight).index_add_(0, ids.reshape(-1), 2 * weight[ids.reshape(-1)])
    torch.testing.assert_close(w.grad.detach().to_dense().cpu(), exact)
    w.grad = None  # the graph it holds refers back to w


@pytest.mark.parametrize("backend", BACKENDS)
def test_learned_positions_with_position_ids(backend):
    ids, weight, pos_weight, dout = make_inputs(3, 20, 64, 32, torch.float32, pos_rows=50, seed=5)
    g = torch.Generator().manual_seed(5)
    position_ids = torch.randint(0, 50, ids.shape, generator=g)  # repeats: positions collide
    kwargs = dict(position_ids=position_ids, scale=2.0)
    out, dw, dp = run_with_grads(fused(backend), ids, weight, pos_weight, dout, **kwargs)
    eout, edw, edp = run_with_grads(eager_embedding, ids, weight, pos_weight, dout, **kwargs)
    assert_within(out, eout, 1e-6, 1e-6, what="forward")
    exact, bound = accumulation_bound(position_ids, dout, 50, 1.0, torch.float32)
    assert_within(dp, exact, bound, what=f"{backend} dP")
    torch.testing.assert_close(dw, edw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_one_hot_row_keeps_fp32_accumulation(backend, dtype):
    # 4096 copies of one id: a bf16 accumulator stops absorbing +1 at 256.
    ids = torch.full((4, 1024), 3)
    weight = torch.randn(10, 64).to(dtype)
    w = weight.clone().requires_grad_()
    out = fused(backend)(ids, w)
    out.backward(torch.ones_like(out))
    torch.testing.assert_close(w.grad[3].double(), torch.full((64,), 4096.0, dtype=torch.float64), rtol=0.01, atol=0)
    assert torch.all(w.grad[torch.arange(10) != 3] == 0)


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.partition("@")[0] in ("cuda", "triton")])
@pytest.mark.parametrize("dim", [8, 6], ids=str)  # 16-byte rows, and rows of single elements
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_long_segments_sum_by_chunk_pieces_in_token_order(backend, dim, sparse):
    """The GPU backends' order of addition for a row used more than a chunk's 128 times:
    each piece in token order, then the pieces in order (tests/helpers.py), bit for bit,
    with mixed magnitudes that give other bits in any other order. The chunk kernels load
    several rows ahead of their adds; the adds keep this order."""
    ids, dout, expected = long_segment_ids_and_grad(dim)
    weight = torch.randn(expected.shape, requires_grad=True)
    fused(backend)(ids, weight, sparse=sparse).backward(dout)
    grad = weight.grad.to_dense() if sparse else weight.grad
    assert torch.equal(grad, expected)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_segments_across_chunk_boundaries_sum_exactly(backend, dtype, sparse):
    # Integer-valued gradients: every partial and total sum is exact, in any order, so
    # each row must equal the float64 index_add bit for bit (padding row 11 excluded).
    ids, dout = boundary_ids_and_grad(dtype)
    weight = torch.randn(BOUNDARY_VOCAB, 8, dtype=dtype, requires_grad=True)
    fused(backend)(ids, weight, padding_idx=11, sparse=sparse).backward(dout)
    exact = exact_row_sums(ids, dout, BOUNDARY_VOCAB, skip=11)
    grad = weight.grad.to_dense() if sparse else weight.grad
    assert torch.equal(grad.double(), exact)
    # scale_grad_by_freq: the sum times scale / count, one rounding of the factor.
    w = weight.detach().requires_grad_()
    fused(backend)(ids, w, scale=3.0, padding_idx=11, scale_grad_by_freq=True, sparse=sparse).backward(dout)
    counts = torch.bincount(ids.reshape(-1), minlength=BOUNDARY_VOCAB).clamp(min=1).double()[:, None]
    grad = w.grad.to_dense() if sparse else w.grad
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(grad.double(), exact * 3.0 / counts, rtol=tol, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", KEY_WIDTH_VOCABS)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_rows_at_the_sort_keys_width_edges_sum_exactly(backend, vocab, sparse):
    # The backward sorts narrowed keys (int16 stored less 2^15 below 2^16 rows, else int32);
    # a key read back wrong would move a row's sum or merge two segments.
    ids, dout = key_width_ids_and_grad(vocab)
    weight = torch.zeros(vocab, 2, requires_grad=True)
    fused(backend)(ids, weight, padding_idx=vocab - 3, sparse=sparse).backward(dout)
    exact = exact_row_sums(ids, dout, vocab, skip=vocab - 3)
    grad = weight.grad.to_dense() if sparse else weight.grad
    assert torch.equal(grad.double(), exact)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
@pytest.mark.parametrize("dropout_p", [0.0, 0.5])
def test_empty_input_gives_empty_output_and_zero_grads(backend, pos_encoding, dropout_p):
    ids = torch.empty(2, 0, dtype=torch.long)
    weight = torch.randn(5, 8, requires_grad=True)
    pos_weight = torch.randn(4, 8, requires_grad=True) if pos_encoding == "learned" else None
    out = fused(backend)(ids, weight, pos_weight, pos_encoding=pos_encoding, dropout_p=dropout_p)
    assert out.shape == (2, 0, 8)
    out.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(5, 8))
    if pos_weight is not None:
        assert torch.equal(pos_weight.grad, torch.zeros(4, 8))
    w = weight.detach().requires_grad_()
    (grad,) = torch.autograd.grad(fused(backend)(ids, w, sparse=True).sum(), w)
    assert grad.is_sparse and grad._nnz() == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_inputs(backend):
    ids, weight, pos_weight, dout = make_inputs(6, 16, 20, 8, torch.float32, pos_rows=16, seed=6)
    ids_t = ids.t()  # (16, 6), non-contiguous
    weight_t = weight.t().contiguous().t()  # same values, column-major
    out = fused(backend)(ids_t, weight_t, pos_weight[:6])
    expected = eager_embedding(ids_t.contiguous(), weight, pos_weight[:6])
    assert_within(out, expected, 1e-6, 1e-6, what="non-contiguous")


@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_false_gives_zero_rows_for_bad_ids(backend):
    ids = torch.tensor([[0, 7, -3, 2, 100]])
    weight = torch.randn(5, 8, requires_grad=True)
    out = fused(backend)(ids, weight, validate=False)
    expected = torch.stack([weight[0], torch.zeros(8), torch.zeros(8), weight[2], torch.zeros(8)])[None]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.sum().backward()
    expected_grad = torch.zeros(5, 8)
    expected_grad[[0, 2]] = 1
    torch.testing.assert_close(weight.grad, expected_grad, rtol=0, atol=0)


@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_validate_false_bad_id_row_has_no_positional_term_either(backend, pos_encoding):
    # The whole row is zero, so ranks holding different rows can sum (pyembed.parallel);
    # the positions' gradient still counts every token.
    ids = torch.tensor([[0, 7, -3, 2, 100]])
    weight = torch.randn(5, 8)
    pos_weight = torch.randn(5, 8, requires_grad=True) if pos_encoding == "learned" else None
    out = fused(backend)(ids, weight, pos_weight, pos_encoding=pos_encoding, validate=False)
    full = eager_embedding(ids.clamp(0, 4), weight, pos_weight, pos_encoding=pos_encoding)
    bad = torch.tensor([False, True, True, False, True])
    assert not out[0, bad].any()
    assert_within(out[0, ~bad], full[0, ~bad], 1e-6, 1e-6, what="good ids")
    if pos_weight is not None:
        out.sum().backward()
        torch.testing.assert_close(pos_weight.grad, torch.ones(5, 8), rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradcheck_float64(backend):
    ids, weight, pos_weight, _ = make_inputs(2, 6, 5, 4, torch.float64, pos_rows=9, seed=7)
    w, p = weight.requires_grad_(), pos_weight.requires_grad_()

    # padding_idx and scale_grad_by_freq deliberately depart from the true gradient, so
    # gradcheck covers the differentiable part: lookup, scale and learned positions.
    def fn(w, p):
        return fused(backend)(ids, w, p, scale=1.7, offset=2)

    assert torch.autograd.gradcheck(fn, (w, p))
    assert torch.autograd.gradcheck(
        lambda w: fused(backend)(ids, w, pos_encoding="sinusoidal", scale=0.3), (w,)
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("vocab", [50, 300_000], ids=["counting-sort", "comparison-sort"])
def test_backward_is_bitwise_identical_across_runs_and_thread_counts(backend, vocab):
    # A small vocabulary with many duplicates, and a large one with few tokens (the CPU
    # backend groups ids by a counting sort or a comparison sort accordingly).
    if vocab > 50 and backend == "triton" and os.environ.get("TRITON_INTERPRET") == "1":
        # The interpreter copies every tensor argument in and out at each launch: a 300k-row
        # gradient costs ~100 s. The Triton kernels take no vocabulary-dependent path (the
        # sort choice above is the CPU backend's), so a table still far larger than the
        # token count (the same spread-out ids) tests the same code.
        vocab = 5000
    g = torch.Generator().manual_seed(8)
    ids = torch.randint(0, 50, (4, 700), generator=g) * (vocab // 50)
    ids[0, :600] = 7  # a hot row: split into parts, summed in a fixed order
    dout = torch.randn(4, 700, 40, generator=g)
    weight = torch.randn(vocab, 40)
    threads = torch.get_num_threads()
    results = []
    # The contract holds under torch.use_deterministic_algorithms(True). Our kernels need
    # no flag (no float atomics), so they are tested without it; the reference is plain
    # ATen, whose CUDA index_add_ is deterministic only with it.
    deterministic = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic or backend == "reference@cuda")
    try:
        for n in (max(threads, 2), 1, max(threads, 2)):  # several threads even in a one-thread xdist worker
            torch.set_num_threads(n)
            for sparse in (False, True):
                w = weight.clone().requires_grad_()
                (grad,) = torch.autograd.grad(fused(backend)(ids, w, sparse=sparse), w, dout)
                results.append(grad.to_dense())
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    for r in results[1:]:
        assert torch.equal(r, results[0])
    exact, bound = accumulation_bound(ids, dout, vocab, 1.0, torch.float32)
    assert_within(results[0], exact, bound, what=f"{backend} dW")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pos_encoding", POS_ENCODINGS)
def test_rows_wider_than_one_tile(backend, pos_encoding):
    # d = 1000: several column blocks per row with a masked tail (Triton BLOCK_D = 512).
    ids, weight, pos_weight, dout, kwargs = _case((2, 9, 30, 1000), torch.bfloat16, torch.int64, pos_encoding, seed=9)
    out, dw, dp = run_with_grads(fused(backend), ids, weight, pos_weight, dout, **kwargs)
    exact = eager_embedding(ids, weight.double(), None if pos_weight is None else pos_weight.double(), **kwargs)
    eager = eager_embedding(ids, weight, pos_weight, **kwargs)
    assert max_abs_err(out, exact) <= 2 * max_abs_err(eager, exact)
    scale = float(torch.tensor(kwargs["scale"], dtype=torch.float32))
    w_exact, w_bound = accumulation_bound(ids, dout, 30, scale, torch.bfloat16)
    assert_within(dw, w_exact, w_bound, what=f"{backend} dW, d=1000")


def _backend_ops(backend, emulated):
    """(forward, dense backward, sparse backward) ops of a BACKENDS entry (inputs moved to
    its device, outputs back), or the emulated CUDA ones."""
    if backend == "cuda-emulated":
        return emulated.embedding_forward, emulated.embedding_backward, emulated.embedding_sparse_backward
    name, _, device = backend.partition("@")
    registered = pyembed.dispatch.get(name)
    ops = registered.forward, registered.backward, registered.sparse_backward
    if not device:
        return ops
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731
    back = lambda r: tuple(t.cpu() for t in r) if isinstance(r, tuple) else r.cpu()  # noqa: E731
    return tuple(lambda *args, op=op: back(op(*map(to, args))) for op in ops)


@pytest.mark.parametrize("backend", BACKENDS + ["cuda-emulated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_backward_steps_over_unused_keys_among_used_ones(request, backend, dtype):
    """With validate=False, out-of-range ids -- below and above the table, each distinct,
    more distinct keys (44) than table rows (6) -- and the padding row sort among the
    used rows and must be left out of every gradient. Row 2 is used 100 times (a tree of
    several levels on the GPU backends), so scale_grad_by_freq's 1/count must reach its
    last level."""
    _, dense, sparse = _backend_ops(backend,
                                    request.getfixturevalue("emulated") if backend == "cuda-emulated" else None)
    ids = torch.cat([torch.arange(-20, 0), torch.arange(6, 26), torch.full((100,), 2), torch.full((30,), 4),
                     torch.tensor([0, 5, 5, 3])])
    ids = ids[torch.randperm(ids.numel(), generator=torch.Generator().manual_seed(5))][None]
    dout = torch.randn(1, ids.shape[1], 16, generator=torch.Generator().manual_seed(6)).to(dtype)
    used = (ids >= 0) & (ids < 6) & (ids != 4)
    counts = torch.bincount(ids[(ids >= 0) & (ids < 6)], minlength=6).double()
    keys = torch.where(used, ids, 0)
    for by_freq in (False, True):
        terms = dout.double() * used[..., None] / (counts[keys][..., None] if by_freq else 1)
        exact, bound = accumulation_bound(keys, terms, 6, 0.5, dtype)
        dw, _ = dense(dout, ids, None, 0, 6, 0, 0.5, 4, by_freq, True, False)
        assert_within(dw, exact, bound, what=f"{backend} dense dW, scale_grad_by_freq={by_freq}")
        rows, values = sparse(dout, ids, 6, 0.5, 4, by_freq)
        assert rows.tolist() == [0, 2, 3, 5]
        assert_within(values, exact[rows], bound[rows], what=f"{backend} sparse dW, scale_grad_by_freq={by_freq}")
    rows, values = sparse(dout, ids, 0, 1.0, None, False)  # an empty table: no row is used
    assert rows.numel() == 0 and values.shape == (0, 16)


@pytest.mark.parametrize("backend", BACKENDS + ["cuda-emulated"])
@pytest.mark.parametrize("num_tokens", [5, 300], ids=["short-batch", "sorted"])
def test_untouched_rows_are_positive_zeros_under_a_negative_scale(request, backend, num_tokens):
    """A dense gradient's untouched rows and padding row are +0.0, bit for bit what
    nn.Embedding's zero-filled gradient holds, also when the scale is negative (a sum of
    nothing times -1.5 would be -0.0): on the short-batch path and the sorted one."""
    _, dense, _ = _backend_ops(backend, request.getfixturevalue("emulated") if backend == "cuda-emulated" else None)
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 20, (1, num_tokens), generator=gen)  # rows 20-29 never named
    ids[0, :2] = 4  # the padding row, used
    dout = torch.randn(1, num_tokens, 8, generator=gen)
    table = torch.nn.Embedding(30, 8, padding_idx=4)
    table(ids).backward(dout * -1.5)
    dw, _ = dense(dout, ids, None, 0, 30, 0, -1.5, 4, False, True, False)
    untouched = torch.ones(30, dtype=torch.bool)
    untouched[ids] = False
    untouched[4] = True
    assert torch.equal(dw[untouched].view(torch.int32), table.weight.grad[untouched].view(torch.int32))
    keep = ids != 4
    exact, bound = accumulation_bound(ids[keep], dout[keep], 30, -1.5, torch.float32)
    assert_within(dw, exact, bound, what=f"{backend} dW")


def _linux_status(field: str) -> int:
    """A kB figure of /proc/self/status (VmSize: the address space mapped)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the address space from Linux's /proc")
def test_a_large_dense_cpu_gradient_is_exact_and_unmapped_when_freed():
    """The cpu backend's dense gradient of a table over 1 MiB is fresh memory of its own whose
    never-written rows read as the kernel's zero pages: its values are nn.Embedding's, bit for
    bit, and freeing it returns it (30 gradients of 64 MiB leave the address space as they
    found it)."""
    gen = torch.Generator().manual_seed(3)
    vocab, dim = 16384, 1024  # 64 MiB of fp32
    ids = torch.randint(0, vocab, (2, 40), generator=gen)
    dout = torch.randn(2, 40, dim, generator=gen)
    weight = torch.randn(vocab, dim, generator=gen).requires_grad_()
    table = torch.nn.Embedding(vocab, dim, _weight=weight.detach().clone())
    table(ids).backward(dout)
    pyembed.fused_embedding(ids, weight, backend="cpu").backward(dout)
    assert torch.equal(weight.grad, table.weight.grad)
    weight.grad = None
    before = _linux_status("VmSize")
    for _ in range(30):
        pyembed.fused_embedding(ids, weight, backend="cpu").backward(dout)
        weight.grad = None
    assert _linux_status("VmSize") - before < 2 * 64 * 1024  # a leak would be 30 x 64 MiB


@pytest.mark.parametrize("backend", BACKENDS + ["cuda-emulated"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_sinusoid_of_a_column_shard_is_the_wide_tables_columns(request, backend, dtype):
    """A column shard (DTensor Shard(1)) computes columns [c0, c0 + n) of the D-wide
    output: its sinusoid is taken at the global columns, not those of an n-wide table."""
    emulated = request.getfixturevalue("emulated") if backend == "cuda-emulated" else None
    op = _backend_ops(backend, emulated)[0]
    full_dim, offset = 24, 5
    ids, weight, _, _ = make_inputs(3, 11, 40, full_dim, dtype)
    exact = eager_embedding(ids, weight.double(), pos_encoding="sinusoidal", scale=2.0, offset=offset)
    atol = 1e-12 + (0 if dtype == torch.float64 else 1e-6 + sinusoid_atol(ids, offset=offset))
    for start, width in ((0, 24), (0, 8), (6, 8), (10, 14), (2, 4), (22, 2)):
        shard = weight[:, start:start + width].contiguous()
        out = op(ids, shard, None, None, "sinusoidal", 2.0, offset, None, 0.0, start, full_dim)
        assert_within(out.double(), exact[..., start:start + width], atol, what=f"columns {start}..{start + width}")
    for start, width in ((1, 4), (20, 6)):  # odd start (a pair split), past the last column
        with pytest.raises(ValueError, match="even-aligned slice"):
            op(ids, torch.ones(40, width, dtype=dtype), None, None, "sinusoidal", 2.0, 0, None, 0.0, start, full_dim)


@pytest.mark.parametrize("backend", BACKENDS + ["cuda-emulated"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_sinusoid_of_a_two_byte_table_is_the_closed_form_rounded_once_up_to_position_99999(request, backend, dtype):
    """A 2-byte table's sinusoid (on the GPU backends the angle less whole turns, then the
    SFU's sine and cosine; emulated and interpreted, the accurate ones of that reduced
    angle) is the float64 closed form rounded once to the table's dtype, within the fp32
    angle's own error (DESIGN §7) and the SFU's 2^-21.4, at positions from 0 to 99999."""
    emulated = request.getfixturevalue("emulated") if backend == "cuda-emulated" else None
    op = _backend_ops(backend, emulated)[0]
    dim = 64
    position_ids = torch.tensor([[0, 1, 2, 7, 100, 511, 2047, 5000, 12345, 65535, 99999]])
    ids = torch.zeros_like(position_ids)
    out = op(ids, torch.zeros(1, dim, dtype=dtype), None, position_ids, "sinusoidal", 1.0, 0, None, 0.0, 0, dim)
    angle = position_ids[0, :, None].double() * 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    exact = torch.stack((angle.sin(), angle.cos()), dim=-1).reshape(1, -1, dim)
    atol = sinusoid_atol(ids, position_ids=position_ids) + 2.0**-21
    assert_within(out.double(), exact, atol, rtol=torch.finfo(dtype).eps / 2, what=f"{backend} {dtype} sinusoid")


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b.startswith("triton")])
@pytest.mark.parametrize("pos_encoding, position_ids", [("learned", False), ("learned", True), ("sinusoidal", False),
                                                        ("none", False)])
def test_triton_forward_with_64_bit_slots_equals_32_bit_slots(backend, pos_encoding, position_ids):
    """The triton forward divides its slots into (token, t) in 32 bits unless a launch has
    more than 2^31 of them (WIDE_SLOTS, which no test here can allocate): the 64-bit path,
    forced on a small batch, gives the same bits, and both equal the float64 reference."""
    from pyembed.kernels import embedding as k

    class wide:  # a launch (embedding_forward's `launch`) with WIDE_SLOTS forced on
        def __init__(self, kernel):
            self.launch = k._direct(kernel)

        def __getitem__(self, grid):
            return lambda *args, **constexprs: self.launch[grid](*args, **{**constexprs, "WIDE_SLOTS": True})

    device = "cuda" if backend.endswith("@cuda") else "cpu"
    batch, seq_len, dim, offset = 3, 37, 40, 5
    ids, weight, pos_weight, _ = make_inputs(batch, seq_len, 50, dim, torch.float32, torch.int64,
                                             offset + seq_len + 3 if pos_encoding == "learned" else None)
    ids, weight = ids.to(device), weight.to(device)
    pos_weight = pos_weight.to(device) if pos_weight is not None else None
    pids = (torch.arange(seq_len).flip(0).repeat(batch, 1) + offset).to(device) if position_ids else None
    mode = k.POS_CODES[pos_encoding]
    outs = []
    for launch in (k._direct, wide):
        out = torch.empty(batch * seq_len, dim, device=device)
        k.embedding_forward(ids, weight, pos_weight, pids, mode, 2.0, offset, None, 0, 1.0, 0, dim, out, launch=launch)
        outs.append(out.view(batch, seq_len, dim).cpu())
    assert torch.equal(outs[0], outs[1])
    exact = eager_embedding(ids.cpu(), weight.cpu().double(), None if pos_weight is None else pos_weight.cpu().double(),
                            pos_encoding=pos_encoding, scale=2.0, offset=offset,
                            position_ids=pids.cpu() if position_ids else None)
    atol = 1e-6 + (sinusoid_atol(ids.cpu(), offset=offset) if pos_encoding == "sinusoidal" else 0)
    assert_within(outs[0], exact, atol, 1e-6, what=f"{pos_encoding} forward vs float64")
