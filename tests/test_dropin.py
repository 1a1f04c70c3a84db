"""What a user of nn.Embedding can do, done with pyembed and compared with nn.Embedding
(or the same layer written with nn.Embedding): gradients of gradients, forward-mode AD,
torch.func per-sample gradients, integer tables, zero-width tables and Hugging Face's
(1, T) position_ids, on every backend that runs here."""

import contextlib
import copy
import pickle
import subprocess
import sys
import warnings

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn
from torch.func import functional_call, grad, vmap

import pyembed
from helpers import CPU_BACKENDS, RowQuantized, assert_within, eager_embedding, fused, sinusoid_atol


def _pair(backend, vocab=12, dim=6, **kwargs):
    """(FusedEmbedding, nn.Embedding) with the same float64 table."""
    torch.manual_seed(0)
    ours = pyembed.FusedEmbedding(vocab, dim, dtype=torch.float64, backend=backend, **kwargs)
    theirs = nn.Embedding(vocab, dim, dtype=torch.float64, **kwargs)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    return ours, theirs


def _layer(backend, pos_encoding, seed):
    """A float64 EmbeddingLayer (V=12, d=6, 8 positions, sqrt(d) scaling) and its parameters, detached."""
    torch.manual_seed(seed)
    layer = pyembed.EmbeddingLayer(12, 6, 8, pos_encoding=pos_encoding, scale_embeddings=True, backend=backend,
                                   dtype=torch.float64)
    return layer, {k: v.detach() for k, v in layer.named_parameters()}


def _eager_layer(layer: pyembed.EmbeddingLayer):
    """The same layer as models write it: nn.Embedding * scale + positions."""
    def run(params, ids, position_ids=None):
        out = nn.functional.embedding(ids, params["token_embedding.weight"]) * layer.scale
        positions = position_ids if position_ids is not None else torch.arange(ids.shape[-1])
        if layer.pos_encoding == "learned":
            return out + nn.functional.embedding(positions, params["pos_embedding"])
        rows = int(positions.max()) + 1 if positions.numel() else 0
        table = pyembed.sinusoidal_table(rows, layer.embed_dim, dtype=out.dtype)
        return out + table[positions]
    return run


def _ours_and_nn_ops(backend, layer: str, seed: int):
    """(params, (ours, theirs)): a float64 pyembed layer and the same in nn ops, each called
    as fn(params, ids). layer: a positional encoding of _layer's, or "padding and freq"
    (_pair's FusedEmbedding with padding_idx=3 and scale_grad_by_freq)."""
    if layer == "padding and freq":
        ours, theirs = _pair(backend, padding_idx=3, scale_grad_by_freq=True)
        return ({"weight": ours.weight.detach()},
                (lambda p, x: functional_call(ours, p, (x,)), lambda p, x: functional_call(theirs, p, (x,))))
    module, params = _layer(backend, layer, seed)
    return params, (lambda p, x: functional_call(module, p, (x,)), _eager_layer(module))


def _gradient_of_gradient(weight, ids, embed):
    """(g, gg): g = d/dW sum(out^3) built differentiably, gg = d/dW sum(g * g)."""
    w = weight.detach().clone().requires_grad_()
    (g,) = torch.autograd.grad(embed(w).pow(3).sum(), w, create_graph=True)
    (gg,) = torch.autograd.grad((g * g).sum(), w)
    return g.detach(), gg


def _closed_form(weight, ids, padding_idx=None, scale_grad_by_freq=False):
    """g and gg of _gradient_of_gradient for a lookup, by hand. With c_v the count of id v
    and o_t = w_v for its tokens: g_v = sum_t 3 o_t^2 (/ c_v) = 3 c_v w_v^2 (3 w_v^2); F = sum
    g^2 has dF/do_t = 2 g_v 6 o_t (/ c_v), and the op's backward sums that over the c_v
    tokens (/ c_v again): gg_v = 36 c_v^2 w_v^3 (36 w_v^3 / c_v). Padding: no gradient."""
    counts = torch.bincount(ids.reshape(-1), minlength=weight.shape[0]).to(weight.dtype)[:, None]
    used = counts > 0
    if padding_idx is not None:
        used[padding_idx] = False
    w = weight.detach()
    if scale_grad_by_freq:
        g, gg = 3 * w**2, 36 * w**3 / counts.clamp(min=1)
    else:
        g, gg = 3 * counts * w**2, 36 * counts**2 * w**3
    return torch.where(used, g, 0), torch.where(used, gg, 0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("options", [{}, {"padding_idx": 3}, {"scale_grad_by_freq": True}], ids=str)
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_double_backward_equals_nn_embedding(backend, options, sparse):
    ours, theirs = _pair(backend, sparse=sparse, **options)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    got = _gradient_of_gradient(ours.weight, ids, lambda w: functional_call(ours, {"weight": w}, (ids,)))
    assert got[0].is_sparse == sparse and got[1].is_sparse == sparse
    got = [t.to_dense() for t in got]
    for a, b in zip(got, _closed_form(ours.weight, ids, **options)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    if not options.get("scale_grad_by_freq"):
        # nn.Embedding agrees; with scale_grad_by_freq its double backward drops one 1/count
        # (torch.autograd.gradgradcheck fails on nn.Embedding there), so it is no oracle
        # (and it refuses the option with sparse=True).
        want = _gradient_of_gradient(theirs.weight, ids, lambda w: functional_call(theirs, {"weight": w}, (ids,)))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b.to_dense(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_double_backward_of_a_zero_wide_table_equals_nn_embedding(backend):
    """A (V, 0) table (nn.Embedding takes one): the gradient's own backward gives the empty
    tensors nn.Embedding's does (the C++ form reshaped the output gradient to (-1, 0), which
    is ambiguous; the Python form took the empty gradient for one not asked for)."""
    ids = torch.tensor([[0, 3], [2, 2]])
    results = []
    for embed in (fused(backend), nn.functional.embedding):
        weight = torch.randn(5, 0, dtype=torch.float64, requires_grad=True)
        out = embed(ids, weight)
        dout = torch.randn_like(out, requires_grad=True)
        (weight_grad,) = torch.autograd.grad(out, weight, dout, create_graph=True)
        results.append((out, weight_grad, *torch.autograd.grad(weight_grad.sum(), dout)))
    for a, b in zip(*results):
        assert a.shape == b.shape and a.dtype == b.dtype


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", ["none", "learned", "sinusoidal"])
def test_gradgradcheck(backend, pos_encoding):
    torch.manual_seed(1)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    w = torch.randn(9, 4, dtype=torch.float64, requires_grad=True)
    p = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    tables = (w, p) if pos_encoding == "learned" else (w,)

    def f(w, p=None):
        return pyembed.fused_embedding(ids, w, p, pos_encoding=pos_encoding, scale=1.7, offset=1, padding_idx=5,
                                       scale_grad_by_freq=True, backend=backend)
    assert torch.autograd.gradgradcheck(f, tables)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("max_norm", [None, 1.0])
def test_forward_ad_tangent_equals_nn_embedding(backend, max_norm):
    ours, theirs = _pair(backend, max_norm=max_norm)
    ids = torch.tensor([[0, 1], [2, 2], [11, 4]])
    tangent = torch.randn(12, 6, dtype=torch.float64)
    table = torch.randn(12, 6, dtype=torch.float64) * 2  # rows past max_norm: renormalised in place
    tangents = []
    for module in (ours, theirs):
        weight = table.clone()
        with fwAD.dual_level():
            out = functional_call(module, {"weight": fwAD.make_dual(weight, tangent)}, (ids,))
            primal, t = fwAD.unpack_dual(out)
        tangents.append((primal, t))
    for a, b in zip(*tangents):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_forward_ad_through_the_layer_includes_positions(backend, pos_encoding):
    layer, params = _layer(backend, pos_encoding, seed=3)
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    ids = torch.tensor([[0, 1, 5], [2, 2, 11]])
    results = []
    for fn in (lambda p: functional_call(layer, p, (ids,), {"offset": 2}),
               lambda p: _eager_layer(layer)(p, ids, torch.arange(2, 5))):
        with fwAD.dual_level():
            dual = {k: fwAD.make_dual(v, tangents[k]) for k, v in params.items()}
            results.append(fwAD.unpack_dual(fn(dual)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("options", [{}, {"padding_idx": 3, "scale_grad_by_freq": True}], ids=str)
def test_per_sample_gradients_with_vmap_equal_nn_embedding(backend, options):
    ours, theirs = _pair(backend, **options)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1], [2, 2, 2, 2]])
    target = torch.randn(3, 4, 6, dtype=torch.float64)

    def loss(params, module, x, y):
        return (functional_call(module, params, (x,)) - y).pow(2).sum()

    per_sample = [vmap(grad(loss), in_dims=(None, None, 0, 0))({"weight": m.weight.detach()}, m, ids, target)["weight"]
                  for m in (ours, theirs)]
    assert per_sample[0].shape == (3, 12, 6)
    torch.testing.assert_close(per_sample[0], per_sample[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_func_grad_of_a_sparse_table_equals_nn_embedding(backend):
    """torch.func.grad of a sparse=True table: the coalesced sparse gradient, as
    nn.Embedding(sparse=True) gives (its functorch wrappers have no storage to inspect)."""
    ours, theirs = _pair(backend, sparse=True)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])

    def loss(params, module):
        return functional_call(module, params, (ids,)).pow(2).sum()

    got, want = (grad(loss)({"weight": m.weight.detach()}, m)["weight"] for m in (ours, theirs))
    assert got.is_sparse and got.is_coalesced()
    torch.testing.assert_close(got.to_dense(), want.to_dense(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_func_grad_of_grad_equals_nn_embedding(backend):
    """Second order under torch.func (grad of a function of a gradient): the dense
    gradient's own derivative (DenseGradFunctorch's backward), as nn.Embedding's."""
    ours, theirs = _pair(backend, sparse=False)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])

    def loss(params, module):
        return functional_call(module, params, (ids,)).pow(3).sum()

    def curvature(params, module):  # a scalar of the first gradient, whose gradient is second order
        return grad(loss)(params, module)["weight"].pow(2).sum()

    got, want = (grad(curvature)({"weight": m.weight.detach()}, m)["weight"] for m in (ours, theirs))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
@pytest.mark.parametrize("seq_len", [5, 0])  # 0: samples of no token (the batching rule's reshape failed)
def test_per_sample_gradients_of_the_layer(backend, pos_encoding, seq_len):
    layer, params = _layer(backend, pos_encoding, seed=4)
    ids = torch.randint(0, 12, (4, seq_len))
    target = torch.randn(4, seq_len, 6, dtype=torch.float64)

    def ours(p, x, y):
        return (functional_call(layer, p, (x,)) - y).pow(2).sum()

    def eager(p, x, y):
        return (_eager_layer(layer)(p, x) - y).pow(2).sum()

    got = vmap(grad(ours), in_dims=(None, 0, 0))(params, ids, target)
    want = vmap(grad(eager), in_dims=(None, 0, 0))(params, ids, target)
    assert got.keys() == want.keys()
    for k in got:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layer", ["learned", "sinusoidal", "padding and freq"])
@pytest.mark.parametrize("batching", ["is_grads_batched", "vmap of autograd.grad"])
def test_batched_output_gradients_equal_nn_ops(backend, layer, batching):
    """Several output gradients through one eager graph at once -- torch.autograd.grad(...,
    is_grads_batched=True) (rows of a Jacobian) and torch.func.vmap over autograd.grad --:
    the eager call's node gets a batched output gradient, which has no storage for
    `triton`'s kernels to read (they raised "Cannot access storage of BatchedTensorImpl"),
    and gives each the gradients of the same layer written with nn ops."""
    params, layers = _ours_and_nn_ops(backend, layer, seed=6)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1], [2, 2, 2, 11]])
    douts = torch.randn(5, 3, 4, 6, dtype=torch.float64)
    results = []
    for run in layers:
        tables = {k: v.clone().requires_grad_() for k, v in params.items()}
        out = run(tables, ids)
        if batching == "is_grads_batched":
            grads = torch.autograd.grad(out, tuple(tables.values()), douts, is_grads_batched=True)
        else:
            grads = vmap(lambda d: torch.autograd.grad(out, tuple(tables.values()), d, retain_graph=True))(douts)
        results.append(grads)
    for got, want in zip(*results, strict=True):
        assert got.shape == (5, *want.shape[1:])
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layer", ["learned", "padding and freq"])
@pytest.mark.parametrize("hessian", ["torch.func.hessian", "autograd.functional forward-mode"])
def test_forward_over_reverse_hessians_equal_nn_ops(backend, layer, hessian):
    """Hessians as torch.func computes them -- jacfwd(jacrev(f)), forward mode over the
    backward: the gradient's own jvp -- and as torch.autograd.functional.hessian does with
    outer_jacobian_strategy="forward-mode" (legacy vmap's batched tangents), equal to the
    same layer's in nn ops. Both failed: the gradient had no jvp, torch.func's generated
    vmap rule split the config (a NamedTuple) into leaves, and `triton`'s kernels were
    handed batched tangents, which have no storage."""
    params, layers = _ours_and_nn_ops(backend, layer, seed=7)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    names = tuple(params)
    results = []
    for run in layers:
        def loss(*tables):
            return run(dict(zip(names, tables)), ids).pow(3).sum()
        tables = tuple(params.values())
        if hessian == "torch.func.hessian":
            results.append(torch.func.hessian(loss, argnums=tuple(range(len(tables))))(*tables))
        else:
            results.append(torch.autograd.functional.hessian(loss, tables, vectorize=True,
                                                             outer_jacobian_strategy="forward-mode"))
    got, want = (torch.cat([h.reshape(-1) for row in r for h in row]) for r in results)
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_forward_over_reverse_through_dropout_equals_reverse_over_reverse(backend):
    """A Hessian-vector product through the fused dropout's mask, in forward mode over the
    backward (the mask's own jvp) and in reverse mode twice: the same product (the Hessian
    is symmetric), the same mask (one generator state)."""
    torch.manual_seed(8)
    weight, tangent = torch.randn(12, 6, dtype=torch.float64), torch.randn(12, 6, dtype=torch.float64)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])

    def gradient(table, create_graph):
        out = pyembed.fused_embedding(ids, table, scale=2.0, dropout_p=0.4, backend=backend,
                                      generator=torch.Generator().manual_seed(0))
        return torch.autograd.grad(out.pow(3).sum(), table, create_graph=create_graph)[0]

    with fwAD.dual_level():
        dual = fwAD.make_dual(weight, tangent).requires_grad_()
        forward_over_reverse = fwAD.unpack_dual(gradient(dual, True)).tangent
    table = weight.clone().requires_grad_()
    (reverse_over_reverse,) = torch.autograd.grad(gradient(table, True), table, tangent)
    assert forward_over_reverse.abs().max() > 0
    torch.testing.assert_close(forward_over_reverse, reverse_over_reverse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("tracing_mode", ["real", "symbolic", "fake"])
@pytest.mark.parametrize("trainable", [False, True], ids=["frozen", "trainable"])
def test_make_fx_graphs_hold_the_range_check(backend, tracing_mode, trainable):
    """make_fx outside torch.compile records the dispatcher's ops alone: the graph of a
    lookup holds the check op and the backend's forward op, gives the eager output, and
    raises for an out-of-range id when it runs. Before, `cpu`'s C++ node checked at trace
    time only (its graph gave a zero row), and every other case failed to trace (a check
    reading values from tracing tensors, triton launching around the dispatcher)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    torch.manual_seed(9)
    ids, weight, pos = torch.tensor([[1, 3, 3, 0], [2, 5, 1, 1]]), torch.randn(6, 8), torch.randn(5, 8)
    weight.requires_grad_(trainable)  # a table that wants a gradient takes an autograd node's route

    def lookup(i, w, p):
        return pyembed.fused_embedding(i, w, p, scale=2.0, backend=backend)

    graph = make_fx(lookup, tracing_mode=tracing_mode)(ids, weight, pos)
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "pyembed.check_ranges.default" in ops
    torch.testing.assert_close(graph(ids, weight, pos), nn.functional.embedding(ids, weight.detach()) * 2.0 + pos[:4],
                               rtol=1e-6, atol=1e-6)
    with pytest.raises(IndexError, match="max id 9"):
        graph(torch.tensor([[1, 9, 3, 0], [2, 5, 1, 1]]), weight, pos)


# Calls under FakeTensorMode: fused_embedding's options (position_ids=True: given, 0..T-1).
_FAKE_CALLS = {
    "plain": dict(scale=2.0),
    "sync check, learned positions given": dict(validate="sync", position_ids=True),
    "sinusoid, offset, padding, freq": dict(pos_encoding="sinusoidal", offset=3, padding_idx=0,
                                            scale_grad_by_freq=True),
    "dropout": dict(dropout_p=0.25),
    "sparse": dict(sparse=True),
}


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("call", list(_FAKE_CALLS))
@pytest.mark.parametrize("where", ["in the mode", "fake tensors out of it"])
def test_fake_tensor_mode_runs_as_nn_ops(backend, call, where):
    """FakeTensorMode (shapes without values: torch's memory tracker and runtime estimator
    run models so): forward and backward give the shapes, dtypes and layouts of the same
    layer in nn ops on the same fake tensors -- inside the mode, and on fake tensors used
    after it, which aten ops accept. Before, every validated call read the ids' values
    (DataDependentOutputException) and a sparse table's gradient hook read addresses. A
    sparse gradient's row count depends on the ids: the mode needs a ShapeEnv for it, as
    for torch.unique."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    options = dict(_FAKE_CALLS[call])
    mode = FakeTensorMode(shape_env=ShapeEnv()) if options.get("sparse") else FakeTensorMode()
    given_positions = options.pop("position_ids", False)
    nn_options = {k: v for k, v in options.items() if k not in ("validate", "dropout_p")}  # values, not shapes
    results = []
    def ours(*args, **kwargs):
        return pyembed.fused_embedding(*args, **kwargs, **options, backend=backend)

    for run in (ours, lambda *args, **kwargs: eager_embedding(*args, **kwargs, **nn_options)):
        with mode:
            ids = torch.randint(1, 12, (3, 5))
            weight = torch.randn(12, 6, dtype=torch.float64, requires_grad=True)
            pos = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
            position_ids = torch.arange(5).repeat(3, 1) if given_positions else None
        pos_weight = None if options.get("pos_encoding") == "sinusoidal" else pos
        # (nn ops in the mode: the positions eager_embedding makes with torch.arange would be real)
        with mode if where == "in the mode" or run is not ours else contextlib.nullcontext():
            out = run(ids, weight, pos_weight, position_ids=position_ids)
            out.sum().backward()
        assert type(out) is FakeTensor and type(weight.grad) is FakeTensor
        results.append((out.shape, out.dtype, out.stride(), weight.grad.shape, weight.grad.layout,
                        None if pos_weight is None else pos.grad.shape))
    assert results[0] == results[1]


def test_memory_tracker_under_fake_tensor_mode_counts_as_nn_embedding():
    """torch's MemTracker over fake tensors (no memory allocated; torchtitan estimates a
    model's memory so): a training step's peak with FusedEmbedding and with EmbeddingLayer
    equals nn.Embedding's, and the learned positions' table and gradient add their bytes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mem_tracker = pytest.importorskip("torch.distributed._tools.mem_tracker", reason="torch without MemTracker")

    def peak(make_embedding):
        with FakeTensorMode():
            model = nn.Sequential(make_embedding(), nn.Linear(64, 1000))
            optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
            ids = torch.randint(0, 1000, (4, 128))
            tracker = mem_tracker.MemTracker()
            tracker.track_external(model, optimizer)
            with tracker:
                for step in range(2):
                    if step:
                        tracker.reset_mod_stats()
                    model(ids).logsumexp(-1).mean().backward()
                    optimizer.step()
                    optimizer.zero_grad()
            return sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())

    backends = [b for b in CPU_BACKENDS if b != "triton"]  # triton: a forward is ~10 s in its interpreter
    baseline = peak(lambda: nn.Embedding(1000, 64))
    assert [peak(lambda: pyembed.FusedEmbedding(1000, 64, backend=b)) for b in backends] == [baseline] * len(backends)
    with_positions = [peak(lambda: pyembed.EmbeddingLayer(1000, 64, 128, backend=b)) for b in backends]
    assert with_positions == [peak(lambda: _NnLayer(1000, 64, 128))] * len(backends)
    assert with_positions[0] > baseline  # the positions' table, its gradient and its AdamW state


class _NnLayer(nn.Module):
    """EmbeddingLayer's learned-positions layer in nn ops."""

    def __init__(self, vocab, dim, max_seq_len):
        super().__init__()
        self.token_embedding, self.pos_embedding = nn.Embedding(vocab, dim), nn.Embedding(max_seq_len, dim)

    def forward(self, ids):
        return self.token_embedding(ids) + self.pos_embedding.weight[:ids.shape[-1]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layer", ["learned", "sinusoidal", "padding and freq"])
def test_func_functionalize_equals_nn_ops(backend, layer):
    """torch.func.functionalize (eagerly, and traced by make_fx as the pre-export recipe
    does): the values and gradients of the same layer in nn ops, and a graph of the
    dispatcher's ops holding the range check. Before, every call raised "NYI: Functionalize
    rule for custom_function_call" (the autograd.Function torch.func transforms get)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    params, (ours, theirs) = _ours_and_nn_ops(backend, layer, seed=12)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    trainable = {k: v.clone().requires_grad_() for k, v in params.items()}
    got, want = torch.func.functionalize(ours)(trainable, ids), theirs(params, ids)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(got)
    got.backward(dout)
    nn_params = {k: v.clone().requires_grad_() for k, v in params.items()}
    theirs(nn_params, ids).backward(dout)
    for name, param in trainable.items():
        torch.testing.assert_close(param.grad, nn_params[name].grad, rtol=1e-12, atol=1e-12)
    graph = make_fx(torch.func.functionalize(ours))(params, ids)
    ops = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert "pyembed.check_ranges.default" in ops
    torch.testing.assert_close(graph(params, ids), want, rtol=1e-12, atol=1e-12)


# (a trainable layer's dropout on the cpu backend only: see the docstring)
@pytest.mark.parametrize("backend, trainable", [(b, False) for b in CPU_BACKENDS]
                         + ([("cpu", True)] if "cpu" in CPU_BACKENDS else []))
def test_func_functionalize_with_dropout_draws_the_eager_mask(backend, trainable):
    """functionalize over the layer with dropout: the eager call's output (and gradients)
    from the same generator state. A frozen layer takes the forward op alone; a trainable one
    the `cpu` backend's lookup op, which draws the key itself. (On `reference` and `triton`
    the gradient of dropout is an autograd.Function's, which functionalize cannot run.)"""
    layer = pyembed.EmbeddingLayer(12, 6, 8, dropout=0.4, backend=backend, dtype=torch.float64)
    layer.requires_grad_(trainable)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    results = []
    for run in (layer, torch.func.functionalize(layer)):
        layer.zero_grad()
        torch.manual_seed(3)
        out = run(ids)
        if trainable:
            out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape))
        results.append([out.detach(), *(p.grad.clone() for p in layer.parameters() if trainable)])
    assert (results[0][0] == 0).any()
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_func_linearize_equals_nn_ops(backend):
    """torch.func.linearize (a jvp traced by make_fx, replayed for new tangents): the
    tangents of the same layer in nn ops."""
    layer, params = _layer(backend, "learned", seed=10)
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    tangents = {k: torch.randn_like(v) for k, v in params.items()}
    got, want = (torch.func.linearize(lambda p: run(p, ids), params)[1](tangents)
                 for run in (lambda p, x: functional_call(layer, p, (x,)), _eager_layer(layer)))
    assert got.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int16, torch.int32, torch.int64], ids=str)
def test_integer_tables_are_looked_up_like_nn_embedding(backend, dtype):
    table = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]], dtype=dtype)
    ids = torch.tensor([[2, 0], [1, 1]])
    ours = pyembed.FusedEmbedding.from_pretrained(table, backend=backend)
    theirs = nn.Embedding.from_pretrained(table)
    assert torch.equal(ours(ids), theirs(ids)) and ours(ids).dtype == dtype
    assert not ours.weight.requires_grad


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2],
                         ids=str)
def test_tables_the_kernels_do_not_take_are_looked_up_like_nn_embedding(backend, dtype):
    # nn.Embedding looks up complex and float8 tables (frozen: torch's autograd gives them no
    # gradient); a swapped model's such a table raised at its first call.
    table = torch.randn(6, 4, dtype=torch.complex128).to(dtype) if dtype.is_complex else torch.randn(6, 4).to(dtype)
    ids = torch.tensor([[2, 0, 5], [1, 1, 4]])
    ours = pyembed.FusedEmbedding.from_pretrained(table, padding_idx=1, backend=backend)
    theirs = nn.Embedding.from_pretrained(table, padding_idx=1)
    assert ours(ids).dtype == dtype and torch.equal(ours(ids).view(torch.uint8), theirs(ids).view(torch.uint8))
    model = pyembed.replace_embeddings(nn.Sequential(nn.Embedding.from_pretrained(table)), backend=backend)
    assert type(model[0]) is pyembed.FusedEmbedding
    assert torch.equal(model(ids).view(torch.uint8), table[ids].view(torch.uint8))
    with pytest.raises(TypeError, match="no positional encoding or scale"):
        pyembed.fused_embedding(ids, table, pos_encoding="sinusoidal", backend=backend)
    with pytest.raises(IndexError):
        ours(torch.tensor([6]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_zero_width_tables(backend, sparse):
    for vocab, ids in ((10, torch.tensor([[0, 2, 4, 5], [4, 3, 0, 9]])), (0, torch.tensor([], dtype=torch.long))):
        ours = pyembed.FusedEmbedding(vocab, 0, sparse=sparse, backend=backend)
        theirs = nn.Embedding(vocab, 0, sparse=sparse)
        for m in (ours, theirs):
            m(ids).sum().backward()
        assert ours(ids).shape == theirs(ids).shape == (*ids.shape, 0)
        assert ours.weight.grad.shape == theirs.weight.grad.shape == (vocab, 0)
        assert ours.weight.grad.is_sparse == theirs.weight.grad.is_sparse == sparse


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("route", ["plain", "positions", "sparse", "dropout", "forward AD"])
def test_the_output_can_be_changed_in_place_as_nn_embeddings(backend, route):
    # Model code scales or adds to an embedding's output in place (`x *= scale`, `x += pos`):
    # nn.Embedding's output is a tensor of its own. An autograd.Function's output that is a
    # view made inside it refuses that ("...is a view and is being modified inplace"): the
    # reference backend's output was such a view (its rows reshaped to ids.shape + (d,)).
    ids = torch.tensor([[0, 3, 3, 5], [7, 3, 1, 1]])
    torch.manual_seed(0)
    weight, pos_weight = torch.randn(12, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    kwargs = {"positions": dict(pos_encoding="learned", scale=2.0), "sparse": dict(sparse=True),
              "dropout": dict(dropout_p=0.25)}.get(route, {})

    def pyembed_lookup(w, p):
        return pyembed.fused_embedding(ids, w, p if route == "positions" else None, backend=backend, **kwargs)

    def nn_lookup(w, p):
        out = nn.functional.embedding(ids, w)
        return out * 2.0 + p[:4] if route == "positions" else out

    def gradients(lookup, in_place):
        w, p = weight.clone().requires_grad_(), pos_weight.clone().requires_grad_()
        torch.manual_seed(1)  # the dropout mask
        with fwAD.dual_level() if route == "forward AD" else contextlib.nullcontext():
            out = lookup(w, p)
            if in_place:
                out.mul_(3.0)
                out += 1.0
            else:
                out = out * 3.0 + 1.0
        out.pow(2).sum().backward()
        return w.grad.to_dense(), p.grad

    got = gradients(pyembed_lookup, in_place=True)
    wants = [gradients(pyembed_lookup, in_place=False)] + [gradients(nn_lookup, False)] * (route != "dropout")
    for want in wants:
        torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
        assert (got[1] is None) == (want[1] is None)
        if got[1] is not None:
            torch.testing.assert_close(got[1], want[1], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("shape", ["(T,)", "(1, T)"])
def test_position_ids_broadcast_over_the_batch(backend, shape):
    torch.manual_seed(5)
    ids = torch.randint(0, 12, (4, 5))
    positions = torch.tensor([3, 0, 7, 7, 1])
    given = positions if shape == "(T,)" else positions[None]
    for pos_encoding in ("learned", "sinusoidal"):
        layer = pyembed.EmbeddingLayer(12, 6, 8, pos_encoding=pos_encoding, backend=backend, dtype=torch.float64)
        out = layer(ids, position_ids=given)
        out.pow(2).sum().backward()
        grads = {k: v.grad.clone() for k, v in layer.named_parameters()}
        layer.zero_grad()
        expected = layer(ids, position_ids=positions.expand(4, 5))
        expected.pow(2).sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        for k, v in layer.named_parameters():
            torch.testing.assert_close(grads[k], v.grad, rtol=0, atol=0)
        params = {k: v.detach() for k, v in layer.named_parameters()}
        torch.testing.assert_close(out, _eager_layer(layer)(params, ids, positions.expand(4, 5)), rtol=1e-12,
                                   atol=1e-12)


_SEQUENCES = [[1, 2, 3, 7, 7], [4, 0], [5], [6, 6, 0]]  # different lengths; 0 is the padding id below


def _jagged(rows) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("options", [dict(), dict(padding_idx=0, scale_grad_by_freq=True), dict(sparse=True)],
                         ids=["plain", "padding and freq", "sparse"])
def test_jagged_ids_are_looked_up_as_nn_embedding_looks_them_up(backend, options):
    """A jagged NestedTensor of ids (sequences of different lengths, packed): a jagged
    output over the ids' own offsets -- the same ragged size, so it adds to other tensors
    of that structure, as nn.Embedding's output of it --, the values and gradients
    nn.Embedding gives the packed ids (its own backward of jagged ids fails when sparse)."""
    ours, theirs = _pair(backend, vocab=10, dim=6, **options)
    ids = _jagged(_SEQUENCES)
    got, want = ours(ids), theirs(ids.values())
    assert got.is_nested and got.shape[1] == ids.shape[1] and got.offsets() is ids.offsets()
    with torch.no_grad():  # jagged tensors of other ragged sizes do not add: this one is the ids' (nn's output's)
        torch.testing.assert_close((got + theirs(ids)).values(), 2 * want, rtol=0, atol=0)
    torch.testing.assert_close(got.values(), want, rtol=0, atol=0)
    dout = torch.randn_like(want)
    got.values().backward(dout)
    want.backward(dout)
    torch.testing.assert_close(ours.weight.grad.to_dense(), theirs.weight.grad.to_dense(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
@pytest.mark.parametrize("positions", ["from each start", "offset", "given"])
def test_jagged_ids_count_positions_from_each_sequence_start(backend, pos_encoding, positions):
    """EmbeddingLayer over jagged ids: each sequence's tokens at positions offset, offset +
    1, ... (or the jagged position_ids given), no padding to the longest -- the same layer
    in nn ops run on each sequence alone, concatenated: values and gradients."""
    layer = pyembed.EmbeddingLayer(10, 6, 12, pos_encoding=pos_encoding, scale_embeddings=True, backend=backend,
                                   dtype=torch.float64)
    params = {k: v.detach().requires_grad_() for k, v in layer.named_parameters()}
    ids = _jagged(_SEQUENCES)
    offset = 4 if positions == "offset" else 0
    starts = {"given": [[7, 1, 1, 0, 11], [2, 3], [9], [0, 0, 5]]}.get(positions)
    given = None if starts is None else torch.nested.nested_tensor_from_jagged(
        torch.tensor(sum(starts, [])), offsets=ids.offsets())
    got = layer(ids, position_ids=given, offset=offset)
    want = torch.cat([
        _eager_layer(layer)(params, torch.tensor(row),
                            torch.tensor(starts[i]) if starts else torch.arange(len(row)) + offset)
        for i, row in enumerate(_SEQUENCES)])
    assert got.is_nested and got.shape[1] == ids.shape[1]
    torch.testing.assert_close(got.values(), want, rtol=1e-12, atol=1e-12)
    dout = torch.randn_like(want)
    got.values().backward(dout)
    want.backward(dout)
    for name, param in layer.named_parameters():
        torch.testing.assert_close(param.grad, params[name].grad, rtol=1e-12, atol=1e-12)
    torch._dynamo.reset()  # (each case compiles EmbeddingLayer.forward anew: no recompile limit across cases)
    compiled = torch.compile(layer, fullgraph=True)(ids, position_ids=given, offset=offset)
    torch.testing.assert_close(compiled.values(), got.values(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_jagged_ids_refuse_holes_other_structures_and_positions_past_the_table(backend):
    layer = pyembed.EmbeddingLayer(10, 6, 4, backend=backend)
    with_holes = torch.nested.narrow(torch.randint(0, 10, (2, 6)), 1, torch.tensor([0, 1]), torch.tensor([3, 2]),
                                     layout=torch.jagged)
    with pytest.raises(ValueError, match="contiguous jagged tensor .* with holes"):
        layer(with_holes)
    ids = _jagged([[1, 2], [3]])
    with pytest.raises(ValueError, match="position_ids must be a jagged tensor of the ids' structure"):
        layer(ids, position_ids=_jagged([[0, 1], [0]]))  # its own offsets: another ragged size, as torch.nested sees it
    with pytest.raises(ValueError, match="position 4 is out of range"):
        layer(_jagged([[1, 2, 3, 4, 5], [3]]))
    fused = pyembed.FusedEmbedding(10, 6, max_norm=1.0, backend=backend)  # nn.Embedding's max_norm takes no jagged ids
    rows = fused(ids).values()
    assert rows.norm(dim=1).max() <= 1.0 + 1e-6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_inductor_compiles_sparse_and_dense_layers_fullgraph(backend):
    # nn.Embedding(sparse=True) compiles with fullgraph=True; so must ours, under Inductor
    # (not only aot_eager), giving eager's gradients. One graph holds both kinds.
    torch.manual_seed(6)
    sparse = pyembed.FusedEmbedding(40, 8, sparse=True, padding_idx=0, backend=backend)
    layer = pyembed.EmbeddingLayer(40, 8, 16, scale_embeddings=True, sparse=True, backend=backend)
    dense = pyembed.FusedEmbedding(40, 8, scale_grad_by_freq=True, backend=backend)
    modules = (sparse, layer, dense)

    def step(ids):
        return (sparse(ids) * layer(ids) + dense(ids)).pow(2).sum()

    ids = torch.randint(0, 40, (3, 16))
    torch._dynamo.reset()
    torch.compile(step, fullgraph=True, backend="inductor")(ids).backward()
    compiled = [p.grad.to_dense().clone() for m in modules for p in m.parameters()]
    for m in modules:
        m.zero_grad(set_to_none=True)
    step(ids).backward()
    assert sparse.weight.grad.is_sparse and layer.token_embedding.weight.grad.is_sparse
    for got, p in zip(compiled, [p for m in modules for p in m.parameters()]):
        torch.testing.assert_close(got, p.grad.to_dense(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("table", ["contiguous", "transposed"])
def test_default_compile_of_a_sparse_layer_breaks_its_graph_there_and_compiles_the_rest(backend, table):
    # Without fullgraph=True Dynamo allows no op whose output size depends on data, as the
    # sparse gradient's backward is (the rows the ids touch): AOTAutograd's trace of it
    # failed and Dynamo gave up the model's forward and each frame down to the op ("won't
    # convert": their code ran eagerly, the linear layer compiled alone); with a transposed
    # table the backward then failed outright. Now one graph
    # break at the call, run eagerly (its coalesced gradient), the rest compiled; a call
    # without a gradient holds no backward, so no break.
    from torch._dynamo.utils import counters

    torch.manual_seed(8)
    weight = torch.randn(40, 8) if table == "contiguous" else torch.randn(8, 40).t()
    embedding = pyembed.FusedEmbedding.from_pretrained(weight, freeze=False, sparse=True, padding_idx=0,
                                                       backend=backend)
    linear = torch.nn.Linear(8, 8)
    params = [embedding.weight, *linear.parameters()]

    def model(ids):
        return linear(embedding(ids)).relu().sum()

    ids = torch.randint(0, 40, (3, 16))
    model(ids).backward()
    expected = [p.grad.to_dense().clone() for p in params]
    for p in params:
        p.grad = None
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    compiled(ids).backward()
    assert counters["aot_autograd"]["not_ok"] == 0, dict(counters["aot_autograd"])  # no frame given up
    assert sum(counters["resumes"].values()) == 1, dict(counters["resumes"])  # one break, tracing resumed after it
    assert counters["stats"]["unique_graphs"] == 1  # the linear layer's
    assert embedding.weight.grad.is_sparse and embedding.weight.grad.is_coalesced()
    for p, want in zip(params, expected):
        torch.testing.assert_close(p.grad.to_dense(), want, rtol=1e-6, atol=1e-6)
    counters.clear()
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-6, atol=1e-6)
    assert not counters["graph_break"] and counters["stats"]["unique_graphs"] == 1, dict(counters)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("config", [dict(), dict(pos_encoding="sinusoidal", dropout=0.1), dict(sparse=True)],
                         ids=["learned", "sinusoid+dropout", "sparse"])
@pytest.mark.parametrize("wrapper", ["checkpoint", "save_on_cpu", "detect_anomaly"])
@pytest.mark.filterwarnings("ignore:Anomaly Detection has been enabled")
def test_activation_checkpointing_offloading_and_anomaly_mode(backend, config, wrapper):
    # What training scripts wrap layers in: non-reentrant activation checkpointing (the
    # forward runs again in the backward), saved-tensor hooks that move what autograd
    # saves to the CPU, anomaly mode. Each gives the plain call's output and gradients,
    # bitwise: same dropout mask, same saved ids.
    torch.manual_seed(7)
    layer = pyembed.EmbeddingLayer(50, 16, 8, backend=backend, dtype=torch.float64, **config)
    ids = torch.randint(0, 50, (3, 8))

    def run(wrapped):
        layer.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        if not wrapped:
            out = layer(ids)
        elif wrapper == "checkpoint":
            out = torch.utils.checkpoint.checkpoint(layer, ids, use_reentrant=False)
        else:
            context = (torch.autograd.graph.save_on_cpu() if wrapper == "save_on_cpu"
                       else torch.autograd.detect_anomaly(check_nan=True))
            with context:
                out = layer(ids)
        out.sin().sum().backward()
        return [out.detach()] + [p.grad.to_dense() for p in layer.parameters() if p.grad is not None]

    plain, wrapped = run(False), run(True)
    assert len(plain) == len(wrapped) == (3 if "pos_encoding" not in config else 2)
    for a, b in zip(plain, wrapped):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", ["learned", "sinusoidal"])
def test_torch_export_with_dynamic_shapes_keeps_the_checks(backend, pos_encoding):
    # torch.export (the path to AOTInductor / ExecuTorch) traces the layers into one graph
    # that takes new batch and sequence sizes, computes what eager computes, and still
    # refuses an out-of-range id.
    torch.manual_seed(8)
    model = nn.Sequential(pyembed.EmbeddingLayer(50, 16, 32, pos_encoding=pos_encoding, scale_embeddings=True,
                                                 backend=backend)).eval()
    ids = torch.randint(0, 50, (2, 8))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=32)
    exported = torch.export.export(model, (ids,), dynamic_shapes={"input": {0: batch, 1: seq}}).module()
    other = torch.randint(0, 50, (3, 20))
    torch.testing.assert_close(exported(other), model(other), rtol=0, atol=0)
    with pytest.raises(IndexError, match="max id 70"):
        exported(torch.tensor([[1, 70]]))


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the cpu backend (the C++ extension) is not built")
def test_an_aotinductor_package_of_an_exported_model_runs_the_cpu_ops_with_their_checks(tmp_path):
    # Deployment past torch.export: AOTInductor compiles the exported graph into a package
    # whose C++ runtime calls pyembed's registered C++ ops (pyembed::check_ranges,
    # pyembed::embedding_forward) through the dispatcher -- loaded in a process that
    # imported pyembed. New batch and sequence sizes give eager's output bit for bit; an
    # out-of-range id is refused by the op's check (a RuntimeError: the C++ runtime passes
    # errors on as RuntimeError, its message pyembed's).
    torch.manual_seed(9)
    model = nn.Sequential(pyembed.EmbeddingLayer(50, 16, 32, scale_embeddings=True, backend="cpu")).eval()
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=32)
    exported = torch.export.export(model, (torch.randint(0, 50, (2, 8)),),
                                   dynamic_shapes={"input": {0: batch, 1: seq}})
    path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "model.pt2"))
    loaded = torch._inductor.aoti_load_package(path)
    other = torch.randint(0, 50, (3, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(other), model(other), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="max id 70, but the embedding table has V=50"):
        loaded(torch.tensor([[1, 70]]))


def _pyembed_ops(program) -> set:
    """The pyembed ops an exported program calls, its subgraphs' included."""
    return {str(node.target) for module in program.graph_module.modules() if isinstance(module, torch.fx.GraphModule)
            for node in module.graph.nodes if node.op == "call_function" and str(node.target).startswith("pyembed.")}


def _exportable(layer: str, backend: str) -> nn.Module:
    if layer == "token only":  # FusedEmbedding: ids of any shape, no positions
        return pyembed.FusedEmbedding(50, 16, backend=backend).eval()
    if layer == "sparse":
        return pyembed.EmbeddingLayer(50, 16, 32, sparse=True, backend=backend).eval()
    return pyembed.EmbeddingLayer(50, 16, 32, pos_encoding=layer, scale_embeddings=True, backend=backend).eval()


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("layer", ["learned", "sinusoidal", "token only", "sparse"])
@pytest.mark.parametrize("strict", [False, True])
def test_decompositions_make_an_exported_program_aten_ops_with_eagers_output(backend, layer, strict):
    # For runtimes that run no custom op (ONNX, ExecuTorch, TensorRT): decomposed, the
    # exported program holds ATen ops only, takes new sizes, gives eager's output (the
    # sinusoid within DESIGN §7 of the closed form) and refuses an out-of-range id -- the
    # gather's own check, as for nn.Embedding.
    torch.manual_seed(11)
    model = _exportable(layer, backend)
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=32)
    program = torch.export.export(model, (torch.randint(0, 50, (2, 8)),), dynamic_shapes=({0: batch, 1: seq},),
                                  strict=strict)
    decomposed = program.run_decompositions(pyembed.decompositions())
    assert _pyembed_ops(program) and not _pyembed_ops(decomposed)
    other = torch.randint(0, 50, (3, 20))
    out = decomposed.module()(other)
    if layer == "sinusoidal":
        weight = model.token_embedding.weight.detach().double()
        exact = pyembed.fused_embedding(other, weight, pos_encoding="sinusoidal", scale=4.0, backend="reference")
        assert_within(out, exact, 1e-6 + sinusoid_atol(other), what="decomposed sinusoid")
    else:
        torch.testing.assert_close(out, model(other), rtol=0, atol=0)
    with pytest.raises(IndexError, match="out of range"):
        decomposed.module()(torch.tensor([[1, 70]]))


def test_decompositions_refuse_a_training_graphs_dropout():
    model = pyembed.EmbeddingLayer(50, 16, 32, dropout=0.1, backend="reference").train()
    program = torch.export.export(model, (torch.randint(0, 50, (2, 8)),))
    with pytest.raises(NotImplementedError, match="inference graphs; export the model in eval mode"):
        program.run_decompositions(pyembed.decompositions())


@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the cpu backend (the C++ extension) is not built")
def test_an_aotinductor_package_of_the_decomposed_program_runs_without_pyembed(tmp_path):
    # Decomposed, the program is ATen ops that Inductor compiles into its own kernel: the
    # AOTInductor package needs no pyembed where it runs (undecomposed, loading it there
    # fails: "Could not find schema for pyembed::check_ranges"). In a process that never
    # imports pyembed, new sizes give eager's output bit for bit and a bad id Inductor's
    # bounds check.
    torch.manual_seed(14)
    model = nn.Sequential(_exportable("learned", "cpu"))
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=32)
    program = torch.export.export(model, (torch.randint(0, 50, (2, 8)),), dynamic_shapes=({0: batch, 1: seq},))
    package = torch._inductor.aoti_compile_and_package(program.run_decompositions(pyembed.decompositions()),
                                                       package_path=str(tmp_path / "model.pt2"))
    other = torch.randint(0, 50, (3, 20))
    torch.save({"ids": other, "out": model(other).detach()}, tmp_path / "expected.pt")
    script = f"""
import sys, torch
loaded = torch._inductor.aoti_load_package({package!r})
expected = torch.load({str(tmp_path / "expected.pt")!r})
with torch.no_grad():
    torch.testing.assert_close(loaded(expected["ids"]), expected["out"], rtol=0, atol=0)
    try:
        loaded(torch.tensor([[1, 70]]))
        raise SystemExit("a bad id was not refused")
    except RuntimeError as error:
        assert "index out of bounds" in str(error), error
assert "pyembed" not in sys.modules
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_an_onnx_export_of_the_decomposed_program_runs_in_onnx_runtime(tmp_path):
    # The ONNX path end to end, as a user deploys a model: export, decompose, torch.onnx
    # (whose exporter refuses pyembed's own ops: "No ONNX function found"), then ONNX
    # Runtime on new sizes -- eager's output bit for bit, and Gather's error for a bad id.
    pytest.importorskip("onnxscript", reason="onnxscript is not installed (requirements-dev.txt has it)")
    ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (requirements-dev.txt has it)")
    torch.manual_seed(12)
    model = nn.Sequential(_exportable("learned", "cpu" if "cpu" in CPU_BACKENDS else "reference"))
    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=32)
    program = torch.export.export(model, (torch.randint(0, 50, (2, 8)),), dynamic_shapes=({0: batch, 1: seq},))
    onnx_program = torch.onnx.export(program.run_decompositions(pyembed.decompositions()), dynamo=True)
    onnx_program.save(str(tmp_path / "model.onnx"))
    session = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    other = torch.randint(0, 50, (3, 20))
    (out,) = session.run(None, {name: other.numpy()})
    torch.testing.assert_close(torch.from_numpy(out), model(other), rtol=0, atol=0)
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.InvalidArgument, match="out of data bounds"):
        session.run(None, {name: torch.tensor([[1, 70]]).numpy()})


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton and its interpreter (no GPU here)")
@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_program_checks_in_the_call_and_holds_no_error_record(monkeypatch, strict):
    """On a GPU the default check runs inside the forward kernel, which records a bad id in
    this process's pinned memory, given to it as an address (pyembed.checks). An exported
    program outlives the process (saved, run by AOTInductor elsewhere), so it must not hold
    that address -- a stray pointer for a kernel anywhere else: it checks in the call. Here
    the interpreted triton kernel checks CPU tensors as it checks CUDA tensors on a GPU."""
    from pyembed import checks

    monkeypatch.setattr(checks, "KERNEL_CHECKED_DEVICES", ("cuda", "cpu"))
    checks.check_errors("cpu")
    address = checks.error_record_address(torch.device("cpu"))
    model = pyembed.EmbeddingLayer(50, 16, 32, scale_embeddings=True, backend="triton").eval()
    ids = torch.randint(0, 50, (2, 8))
    bad = ids.clone()
    bad[1, 3] = 70
    program = torch.export.export(model, (ids,), strict=strict)
    assert str(address) not in program.graph_module.code
    exported = program.module()
    torch.testing.assert_close(exported(ids), model(ids), rtol=0, atol=0)
    with pytest.raises(IndexError, match="max id 70"):
        exported(bad)
    # Eager calls still check in the kernel: the bad id is reported by the next call.
    model(bad)
    with pytest.raises(IndexError, match="earlier call on cpu: id 70"):
        model(ids)


def test_only_torch_export_counts_as_exporting():
    """pyembed asks whether it is exporting to choose the range check (in the call for a
    program saved to run elsewhere, in the kernel on a GPU) and whether a table's fused
    optimizer applies. Dynamo before torch 2.13 folded torch.compiler.is_exporting() to
    True under torch.compile as well (pytorch/pytorch#176347): on the GPU machine's torch 2.11
    every compiled call synchronised with the device and ignored fused optimizers."""
    from pyembed import functional

    class Flag(torch.nn.Module):
        def forward(self, x):
            return x + 1 if functional._is_exporting() else x

    x = torch.zeros(2)
    assert torch.equal(Flag()(x), x)
    assert torch.equal(torch.compile(Flag(), backend="eager", fullgraph=True)(x), x)
    for strict in (False, True):
        assert torch.equal(torch.export.export(Flag(), (x,), strict=strict).module()(x), x + 1)


TRAINABLE_EXPORTS = [(b, layer) for b in CPU_BACKENDS for layer in ("learned", "sinusoidal", "sparse", "dropout")
                     if not (b in ("triton", "reference") and layer == "dropout")]  # (README: those are not)


@pytest.mark.parametrize("backend,layer", TRAINABLE_EXPORTS)
@pytest.mark.parametrize("strict", [False, True])
def test_an_exported_program_trains_as_the_model_does(backend, layer, strict):
    # PT2E's quantization-aware training and on-device training run the exported program's
    # module forward and backward. Non-strict export (torch.export's default) runs the model
    # on FakeTensors, which took the general route, whose Function the program inlines: its
    # forward op was recorded without a backward, and the tables got no gradient (a warning,
    # silently None). Now they take the common call's op, whose autograd the program keeps.
    torch.manual_seed(15)
    if layer == "dropout":
        model = pyembed.EmbeddingLayer(50, 16, 32, dropout=0.1, backend=backend)
    else:
        model = _exportable(layer, backend).train()
    twin = copy.deepcopy(model)
    ids = torch.randint(0, 50, (2, 8))
    exported = torch.export.export(twin, (ids,), strict=strict).module()
    dout = torch.randn(2, 8, 16)
    for run in (exported, model):
        torch.manual_seed(16)  # the same dropout mask
        run(ids).backward(dout)
    grads = dict(exported.named_parameters())
    for name, param in model.named_parameters():
        assert grads[name].grad is not None, name
        torch.testing.assert_close(grads[name].grad.to_dense(), param.grad.to_dense(), rtol=0, atol=0)


# What a trace records per backend: the C++ backends' pyembed::embedding, whose arguments
# carry the check; the reference's check op and lookup op (what torch.compile records).
TRACED_OPS = {"cpu": ["pyembed::embedding"], "reference": ["pyembed::check_ranges", "pyembed::reference_lookup"]}


@pytest.mark.parametrize("backend", [b for b in CPU_BACKENDS if b in TRACED_OPS])
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_torch_jit_trace_records_dispatcher_ops_and_a_saved_trace_checks_and_trains(tmp_path, backend, grad):
    # TorchScript (deprecated by PyTorch, still deployed): torch.jit.trace records
    # dispatcher ops only, with the range check among them, and without a TracerWarning; the
    # saved module, loaded where pyembed is imported, takes new sizes, refuses a bad id or
    # a sequence longer than the learned table, and trains: its tables' gradients are the
    # eager module's. The reference backend (auto's when the extension is not built) once
    # recorded its autograd.Function as a Python call (torch.jit.save cannot write one; the
    # check trace differed: TracingCheckError), under no_grad its forward op without a
    # backward, and ran its range check unrecorded.
    # (torch.jit.script cannot compile the modules: their forward takes keyword-only arguments.)
    torch.manual_seed(10)
    model = pyembed.EmbeddingLayer(50, 16, 32, scale_embeddings=True, padding_idx=0, backend=backend).eval()
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.trace (load, ...) is deprecated"
        warnings.simplefilter("error", torch.jit.TracerWarning)
        traced = torch.jit.trace(model, torch.randint(0, 50, (2, 8)))
    assert [n.kind() for n in traced.inlined_graph.nodes() if n.kind().startswith(("pyembed::", "prim::Python"))] \
        == TRACED_OPS[backend]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        torch.jit.save(traced, str(tmp_path / "model.pt"))
        loaded = torch.jit.load(str(tmp_path / "model.pt"))
    other = torch.randint(0, 50, (3, 20))
    out, expected = loaded(other), model(other)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    dout = torch.randn_like(out)
    out.backward(dout)
    expected.backward(dout)
    for name, param in model.named_parameters():
        torch.testing.assert_close(dict(loaded.named_parameters())[name].grad, param.grad, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="max id 70, but the embedding table has V=50"):
        loaded(torch.tensor([[1, 70]]))
    with pytest.raises(RuntimeError, match="max_seq_len=32"):
        loaded(torch.randint(0, 50, (1, 40)))


class _Head(nn.Module):
    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding, self.linear = embedding, nn.Linear(16, 3)

    def forward(self, ids):
        return self.linear(self.embedding(ids))


def test_torch_fx_symbolic_trace_records_the_lookup_as_one_call():
    # torch.fx.symbolic_trace (FX graph mode quantization, feature extraction) traces into
    # every module but torch.nn's own, and the op refused its Proxies ("ids must be an int32
    # or int64 tensor, got Proxy"): pyembed's calls are recorded as call_function nodes. The
    # traced models compute what nn.Embedding's traced model does (max_norm's in-place renorm
    # of the table included), and train, pickled too.
    from torch.fx import symbolic_trace

    from pyembed.functional import embedding_renorm_, fused_embedding

    torch.manual_seed(17)
    plain = _Head(nn.Embedding(50, 16, padding_idx=0, max_norm=1.0))
    fused = copy.deepcopy(plain)
    fused.embedding = pyembed.FusedEmbedding(50, 16, padding_idx=0, max_norm=1.0)
    fused.embedding.load_state_dict(plain.embedding.state_dict())
    layer = _Head(pyembed.EmbeddingLayer(50, 16, 32, scale_embeddings=True))
    ids = torch.randint(0, 50, (2, 8))
    traced_plain, traced_fused, traced_layer = (symbolic_trace(m) for m in (plain, fused, layer))
    assert [n.target for n in traced_fused.graph.nodes if n.op == "call_function"] == [embedding_renorm_,
                                                                                        fused_embedding]
    assert [n.target for n in traced_layer.graph.nodes if n.op == "call_function"] == [fused_embedding]
    out = traced_fused(ids)
    expected = traced_plain(ids)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(fused.embedding.weight, plain.embedding.weight, rtol=0, atol=0)  # renormed alike
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(fused.embedding.weight.grad, plain.embedding.weight.grad, rtol=0, atol=0)
    unpickled = pickle.loads(pickle.dumps(traced_layer))
    torch.testing.assert_close(unpickled(ids), layer(ids), rtol=0, atol=0)
    unpickled(ids).sum().backward()
    assert unpickled.embedding.token_embedding.weight.grad is not None


@pytest.mark.skipif("triton" not in CPU_BACKENDS, reason="needs triton and its interpreter (no GPU here)")
@pytest.mark.skipif("cpu" not in CPU_BACKENDS, reason="the triton lookup's C++ node needs the C++ extension")
@pytest.mark.parametrize("grad", [True, False])
def test_torch_jit_trace_of_the_triton_backend_is_refused_not_recorded_empty(grad):
    # The triton backend's eager call is no op the tracer can record, nor are its launches:
    # its trace held the output's allocation alone (aten::empty), and the traced module
    # returned that memory unwritten. It raises instead, saying what traces.
    model = pyembed.EmbeddingLayer(50, 16, 32, backend="triton")
    ids = torch.randint(0, 50, (2, 8))
    model(ids)  # a call of that metadata first: later ones replay its launch from C++
    with warnings.catch_warnings(), torch.set_grad_enabled(grad):
        warnings.simplefilter("ignore", FutureWarning)
        with pytest.raises(NotImplementedError, match="torch.jit.trace cannot record the triton backend"):
            torch.jit.trace(model, ids)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_under_autocast_the_lookup_keeps_its_dtype_and_gradients_as_nn_embedding(backend):
    """Mixed-precision training wraps the model in torch.autocast. nn.Embedding is on none
    of autocast's cast lists: its output keeps the table's dtype and the next op (a
    Linear) is the one that runs in bfloat16. pyembed's ops take the same place: the same
    output, dtype and gradient as nn.Embedding's under the same autocast, the layer's too."""
    torch.manual_seed(0)
    ours = pyembed.FusedEmbedding(50, 16, backend=backend)
    theirs = nn.Embedding(50, 16)
    with torch.no_grad():
        theirs.weight.copy_(ours.weight)
    head = nn.Linear(16, 4)
    ids = torch.randint(0, 50, (2, 8))
    results = []
    for embedding in (ours, theirs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            rows = embedding(ids)
            logits = head(rows)
        logits.float().square().sum().backward()
        results.append((rows.dtype, logits.dtype, rows.detach(), embedding.weight.grad))
    (rows_dtype, logits_dtype, rows, grad), expected = results
    assert (rows_dtype, logits_dtype) == (torch.float32, torch.bfloat16) == expected[:2]
    assert torch.equal(rows, expected[2])
    torch.testing.assert_close(grad, expected[3])  # the same bf16 head's gradient, summed per row
    layer = pyembed.EmbeddingLayer(50, 16, 8, backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(ids).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_quantized_table_is_looked_up_through_its_own_embedding_as_nn_embeddings_is(backend, dtype):
    # The table's own lookup (F.embedding: the subclass dequantizes the rows it gathers), then
    # the scale, positions and dropout as the contract says, rounded once: the output of the
    # same call on the dequantized table (every backend computes in float32 and rounds once;
    # the dropout mask is the same Philox draw), nn.Embedding's without them, bit for bit.
    # Before, every call failed: the subclass has no pyembed op (NotImplementedError).
    torch.manual_seed(0)
    table = RowQuantized.quantize(torch.randn(30, 16, dtype=dtype))
    plain = table.dequantized()
    ids = torch.randint(0, 30, (256, 7))  # 256 terms in each position's gradient
    embedding, theirs = pyembed.FusedEmbedding(30, 16, padding_idx=2, backend=backend), nn.Embedding(30, 16)
    for module in (embedding, theirs):  # as torchao's quantize_ swaps a weight
        module.weight = nn.Parameter(table, requires_grad=False)
    with torch.no_grad():
        assert torch.equal(embedding(ids), theirs(ids))
    for pos_encoding in ("learned", "sinusoidal"):
        layer = pyembed.EmbeddingLayer(30, 16, 8, pos_encoding, scale_embeddings=True, dropout=0.25,
                                       backend=backend, dtype=dtype)
        layer.token_embedding.weight = nn.Parameter(table, requires_grad=False)
        pos_weight = layer.pos_embedding
        plain_pos = None if pos_weight is None else pos_weight.detach().clone().requires_grad_()
        for seed in (1, 2):
            torch.manual_seed(seed)
            out = layer(ids, offset=1)
            torch.manual_seed(seed)
            expected = pyembed.fused_embedding(ids, plain, plain_pos, pos_encoding=pos_encoding, scale=16**0.5,
                                               offset=1, dropout_p=0.25, backend=backend)
            assert torch.equal(out == 0, expected == 0)  # the same elements dropped
            # (DESIGN §7: a backend's fused multiply-add may round the sum otherwise)
            atol = (1e-6 if dtype == torch.float32 else 0) + (sinusoid_atol(ids, offset=1) if pos_weight is None else 0)
            assert_within(out, expected, atol=atol, rtol=1e-6 if dtype == torch.float32 else 2**-7)
            if pos_weight is not None:  # the positions train beside the frozen quantized table
                dout = torch.randn_like(out)
                got, = torch.autograd.grad(out, pos_weight, dout)
                # summed in float32, rounded once (DESIGN §1): within one rounding of the exact
                # sum of the kept elements' gradients (dropped ones are the output's zeros)
                terms = (dout.double() * (out != 0) / 0.75).reshape(-1, 16)
                positions = (torch.arange(7) + 1).repeat(256)
                exact = torch.zeros(8, 16, dtype=torch.float64).index_add_(0, positions, terms)
                bound = torch.zeros(8, 16, dtype=torch.float64).index_add_(0, positions, terms.abs())
                assert_within(got, exact, atol=bound * torch.finfo(dtype).eps)
    with pytest.raises(IndexError, match="30"):
        embedding(torch.tensor([[1, 30]]))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_unchecked_quantized_lookup_gives_out_of_range_ids_and_positions_zero_rows(backend):
    # validate=False: the contract's zero rows (an out-of-range id's whole row, an
    # out-of-range learned position's term), as the same call on the dequantized table
    # gives them -- not the subclass's own IndexError (on a GPU, a device-side assert).
    torch.manual_seed(0)
    table = RowQuantized.quantize(torch.randn(30, 16))
    pos_weight = torch.randn(6, 16, requires_grad=True)
    ids = torch.tensor([[1, 30, 5, -1], [29, 0, 31, 2]])
    position_ids = torch.tensor([[0, 1, 6, 5], [9, 3, 2, 1]])
    for padding_idx in (None, 2):
        for kwargs in (dict(), dict(pos_weight=pos_weight, position_ids=position_ids),
                       dict(pos_encoding="sinusoidal")):
            options = dict(scale=2.0, padding_idx=padding_idx, validate=False, backend=backend, **kwargs)
            out = pyembed.fused_embedding(ids, table, **options)
            expected = pyembed.fused_embedding(ids, table.dequantized(), **options)
            assert_within(out, expected, atol=1e-6, rtol=1e-6)
            assert not out[ids.ge(30) | ids.lt(0)].any()
    dout = torch.randn(2, 4, 16)
    out = pyembed.fused_embedding(ids, table, pos_weight, position_ids=position_ids, validate=False, backend=backend)
    got, = torch.autograd.grad(out, pos_weight, dout)
    # the positions' gradient: the in-range tokens' at in-range positions, nothing else
    used = ids.ge(0) & ids.lt(30) & position_ids.lt(6)
    exact = torch.zeros(6, 16).index_add_(0, position_ids[used], dout[used])
    assert_within(got, exact, atol=1e-6, rtol=1e-6)
