"""The optimizer inside the backward (pyembed.apply_optimizer_in_backward), against torch:

- training a small model with the fused optimizer equals training it with the torch
  optimizer over nn.Embedding (same init, data, LR schedule), step by step, for every fused
  class, dense and sparse tables, learned positions, padding_idx, on every backend;
- the optimizer's state_dict moves between fused and plain training either way;
- each backend's update kernel equals torch's own functional optimizer (reference_update)
  on random tables, states and gradient rows;
- what cannot be fused raises, clearly.
"""

import copy
import dataclasses
import io
import itertools
import math
import pathlib
import re
import sys
import threading
import time
import types
import warnings

import pytest
import torch
from torch import nn

import pyembed
from helpers import CPU_BACKENDS, RowQuantized
from pyembed import dispatch, optim

ROOT = pathlib.Path(__file__).resolve().parents[1]
V, D, MAX_LEN, BATCH, SEQ, PAD = 24, 12, 10, 3, 7, 1
STEPS = 5
# (optimizer class, kwargs, sparse token table)
CONFIGS = {
    "SGD": (torch.optim.SGD, dict(lr=0.1), False),
    "SGD-momentum-wd": (torch.optim.SGD, dict(lr=0.05, momentum=0.9, dampening=0.1, weight_decay=0.01), False),
    "SGD-nesterov-max": (torch.optim.SGD, dict(lr=0.05, momentum=0.8, nesterov=True, maximize=True), False),
    "Adam-wd": (torch.optim.Adam, dict(lr=0.01, weight_decay=0.05), False),
    "AdamW": (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1), False),
    # fused=True: torch keeps the step beside the parameter (on a GPU), pyembed counts it on the host
    "AdamW-fused": (torch.optim.AdamW, dict(lr=0.01, betas=(0.8, 0.95), weight_decay=0.1, fused=True), False),
    "Adagrad": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.01, weight_decay=0.01, initial_accumulator_value=0.1),
                False),
    "SGD-sparse": (torch.optim.SGD, dict(lr=0.1), True),
    "Adagrad-sparse": (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.05), True),
    "SparseAdam": (torch.optim.SparseAdam, dict(lr=0.01, betas=(0.8, 0.9)), True),
}
POS_OPTIMIZER = (torch.optim.AdamW, dict(lr=0.02, weight_decay=0.01))  # for the positions of sparse configs


GPU_BACKENDS = [f"{name}@cuda" for name in dispatch.backends_for("cuda")] if torch.cuda.is_available() else []
# The backends with kernels of their own on a GPU (reference@cuda runs plain torch there).
GPU_KERNELS = [name for name in GPU_BACKENDS if name != "reference@cuda"]


@pytest.fixture(params=CPU_BACKENDS + ["cuda-emulated"] + GPU_BACKENDS)
def backend(request, monkeypatch):
    """A backend name, "name@cuda" for the fused model on the GPU; "cuda-emulated" puts the
    CUDA kernels run through host emulation in the registry as "cuda", so CPU tensors take
    the cuda backend's kernels, update included."""
    if request.param != "cuda-emulated":
        return request.param
    install_emulated_cuda(request.getfixturevalue("emulated"), monkeypatch)
    return "cuda"


def install_emulated_cuda(emulated, monkeypatch) -> None:
    monkeypatch.setitem(dispatch._registry, "cuda", dispatch.Backend(
        "cuda", emulated.embedding_forward, emulated.embedding_backward, emulated.embedding_sparse_backward,
        lambda device: None, touched_rows=emulated.embedding_touched_rows, optimizer_update=emulated.optimizer_update,
        optimizer_backward=emulated.optimizer_backward, position_update=emulated.position_update))
    monkeypatch.setattr(dispatch, "_resolved", {})


class Plain(nn.Module):
    """The same model in plain torch: nn.Embedding * sqrt(d) + a positions Parameter, a head."""

    def __init__(self, sparse):
        super().__init__()
        self.tok = nn.Embedding(V, D, padding_idx=PAD, sparse=sparse)
        self.pos = nn.Parameter(torch.randn(MAX_LEN, D) * 0.1)
        self.head = nn.Linear(D, 3)

    def forward(self, ids):
        x = self.tok(ids) * math.sqrt(D) + self.pos[: ids.shape[1]]
        return self.head(torch.tanh(x))


class Fused(nn.Module):
    def __init__(self, plain, backend):
        """backend: a name, or "name@device" for a model on that device."""
        super().__init__()
        name, _, device = backend.partition("@")
        self.emb = pyembed.EmbeddingLayer(V, D, MAX_LEN, "learned", scale_embeddings=True, padding_idx=PAD,
                                          sparse=plain.tok.sparse, backend=name)
        with torch.no_grad():
            self.emb.token_embedding.weight.copy_(plain.tok.weight)
            self.emb.pos_embedding.copy_(plain.pos)
        self.head = nn.Linear(D, 3)
        self.head.load_state_dict(plain.head.state_dict())
        self.to(device or "cpu")

    def forward(self, ids):
        return self.head(torch.tanh(self.emb(ids)))


def batches(steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, V // 2, (BATCH, SEQ), generator=g)  # half the vocabulary: untouched rows too
        ids[0, :2] = PAD
        yield ids, torch.randn(BATCH, SEQ, 3, generator=g)


def plain_optimizers(plain, config):
    cls, kwargs, sparse = CONFIGS[config]
    pos_cls, pos_kwargs = POS_OPTIMIZER if sparse else (cls, kwargs)
    return [cls([plain.tok.weight], **kwargs), pos_cls([plain.pos], **pos_kwargs),
            torch.optim.SGD(plain.head.parameters(), lr=0.1)]


def fused_optimizers(model, config):
    cls, kwargs, sparse = CONFIGS[config]
    pos_cls, pos_kwargs = POS_OPTIMIZER if sparse else (cls, kwargs)
    [tok] = pyembed.apply_optimizer_in_backward(cls, [model.emb.token_embedding.weight], kwargs)
    [pos] = pyembed.apply_optimizer_in_backward(pos_cls, [model.emb.pos_embedding], pos_kwargs)
    return [tok, pos, torch.optim.SGD(model.head.parameters(), lr=0.1)]


def schedulers_of(optimizers):
    """An LR schedule that halves every 2 steps (the fused kernels read lr from param_groups)."""
    return [torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5) for o in optimizers]


def train(model, optimizers, data, schedulers=None):
    schedulers = schedulers_of(optimizers) if schedulers is None else schedulers
    device = next(model.parameters()).device
    for ids, target in data:
        loss = nn.functional.mse_loss(model(ids.to(device)), target.to(device))
        loss.backward()
        for o in optimizers:
            o.step()
            o.zero_grad(set_to_none=True)
        for s in schedulers:
            s.step()


def tables(model):
    """(token table, positions) on the CPU."""
    if isinstance(model, Plain):
        return model.tok.weight, model.pos
    return model.emb.token_embedding.weight.cpu(), model.emb.pos_embedding.cpu()


def assert_close_relative(got, want, what=""):
    """Within 1e-5 relative to the tensor's own scale: an element near zero moves by the
    optimizer's step, not by a fraction of itself (Adam's m / sqrt(v) of a near-zero
    gradient carries the summation-order difference of that gradient)."""
    got, want = got.detach(), want.detach()
    scale = want.abs().max().item() if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


def assert_close_tables(fused_model, plain_model, what):
    for name, got, want in zip(("token table", "positions"), tables(fused_model), tables(plain_model)):
        assert_close_relative(got, want, f"{what} {name}")


@pytest.mark.parametrize("config", CONFIGS)
def test_fused_training_equals_torch_optimizer(config, backend):
    torch.manual_seed(0)
    plain = Plain(CONFIGS[config][2])
    model = Fused(plain, backend)
    plain_opts, fused_opts = plain_optimizers(plain, config), fused_optimizers(model, config)
    train(plain, plain_opts, batches(STEPS))
    train(model, fused_opts, batches(STEPS))
    assert_close_tables(model, plain, config)
    assert model.emb.token_embedding.weight.grad is None and model.emb.pos_embedding.grad is None
    assert model.head.weight.grad is None  # zeroed by its own optimizer, as plain's
    # The state_dicts hold the same entries, types, dtypes, devices and values.
    for fused_opt, plain_opt in zip(fused_opts[:2], plain_opts[:2]):
        fused_state, plain_state = fused_opt.state_dict()["state"], plain_opt.state_dict()["state"]
        assert fused_state.keys() == plain_state.keys()
        for key, value in plain_state.get(0, {}).items():
            got = fused_state[0][key]
            assert type(got) is type(value), key
            if isinstance(value, torch.Tensor):
                # torch keeps a non-fused optimizer's step on the CPU, the rest beside the parameter.
                on_cpu = key == "step" and not CONFIGS[config][1].get("fused")
                device = value.device if on_cpu else model.emb.pos_embedding.device
                assert (got.dtype, got.device, got.shape) == (value.dtype, device, value.shape), key
                assert_close_relative(got.cpu(), value, f"state {key}")
            else:
                assert got == value, key
        assert fused_opt.state_dict()["param_groups"] == plain_opt.state_dict()["param_groups"]


# The backends whose eager lookups on fused tables take a C++ autograd node (fused_autograd_op).
NODE_BACKENDS = [name for name in CPU_BACKENDS + GPU_KERNELS
                 if dispatch.get(name.partition("@")[0]).fused_autograd_op is not None]


def train_through_node_and_function(start, fuse, monkeypatch, steps=3, compiled=False):
    """Copies of ``start`` (an EmbeddingLayer) trained ``steps`` steps after ``fuse(layer)``
    (which returns the fused optimizers): first through its backend's C++ node
    (fused_autograd_op), then with the registry's fused_autograd_op removed, through the
    Python Function; each under torch.compile if ``compiled``. Each run: (layer,
    optimizers, whether each forward's grad_fn was a Python Function's); the .grad of an
    unfused table kept."""
    name = start.backend

    def train_copy():
        layer = copy.deepcopy(start)
        optimizers = fuse(layer)
        forward = torch.compile(layer, backend="eager") if compiled else layer
        torch.manual_seed(1)  # the dropout masks
        routes = set()
        for ids, _ in batches(steps):
            out = forward(ids.to(layer.pos_embedding.device))
            routes.add(isinstance(out.grad_fn, torch.autograd.function.BackwardCFunction))
            (out * torch.linspace(-1, 1, D, device=out.device)).sum().backward()
        return layer, optimizers, routes

    node_run = train_copy()
    monkeypatch.setitem(dispatch._registry, name, dataclasses.replace(dispatch.get(name), fused_autograd_op=None))
    monkeypatch.setattr(dispatch, "_resolved", {})
    return node_run, train_copy()


def assert_same_training(node_run, function_run):
    (node_layer, node_opts, node_routes), (function_layer, function_opts, function_routes) = node_run, function_run
    assert (node_routes, function_routes) == ({False}, {True})
    for got, want in zip(node_layer.parameters(), function_layer.parameters()):
        assert torch.equal(got, want)
        assert (got.grad is None) == (want.grad is None)
        assert got.grad is None or torch.equal(got.grad, want.grad)
    for got, want in zip(node_opts, function_opts):
        got_state, want_state = got.state_dict()["state"], want.state_dict()["state"]
        assert got_state.keys() == want_state.keys()
        for key, value in want_state.get(0, {}).items():
            assert torch.equal(torch.as_tensor(got_state[0][key]), torch.as_tensor(value)), key


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("backend", NODE_BACKENDS)
def test_the_cpp_node_updates_the_tables_as_the_python_function(config, backend, monkeypatch):
    """An eager lookup on tables whose optimizer runs in the backward takes its backend's C++
    autograd node (fused_autograd_op), whose backward updates them through
    _autograd.fused_step; the general route's Python Function updates them through
    _gradients. The same steps both ways -- with dropout for three configs (the mask applied
    by the update's reads) -- give the same tables and optimizer states, bit for bit; the
    node is what the first run took, the Function the second."""
    cls, kwargs, sparse = CONFIGS[config]
    name, _, device = backend.partition("@")
    dropout = 0.2 if config in ("AdamW", "SGD-momentum-wd", "SparseAdam") else 0.0
    torch.manual_seed(0)
    start = pyembed.EmbeddingLayer(V, D, MAX_LEN, scale_embeddings=True, padding_idx=PAD, sparse=sparse,
                                   dropout=dropout, backend=name, device=device or "cpu")

    def fuse(layer):
        return (pyembed.apply_optimizer_in_backward(cls, [layer.token_embedding.weight], kwargs)
                + pyembed.apply_optimizer_in_backward(POS_OPTIMIZER[0], [layer.pos_embedding], POS_OPTIMIZER[1]))
    assert_same_training(*train_through_node_and_function(start, fuse, monkeypatch))


@pytest.mark.parametrize("fused", ["token table", "positions"])
@pytest.mark.parametrize("backend", NODE_BACKENDS)
def test_the_cpp_node_gives_the_unfused_table_its_gradient(fused, backend, monkeypatch):
    """One table fused, the other not: the node updates the first and gives the second the
    gradient the Python Function gives it (accumulated over the steps, bit for bit)."""
    name, _, device = backend.partition("@")
    torch.manual_seed(0)
    start = pyembed.EmbeddingLayer(V, D, MAX_LEN, padding_idx=PAD, backend=name, device=device or "cpu")

    def fuse(layer):
        table = layer.token_embedding.weight if fused == "token table" else layer.pos_embedding
        return pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [table], {"lr": 0.1})
    node_run, function_run = train_through_node_and_function(start, fuse, monkeypatch)
    assert_same_training(node_run, function_run)
    unfused = node_run[0].pos_embedding if fused == "token table" else node_run[0].token_embedding.weight
    assert unfused.grad is not None and unfused.grad.abs().sum() > 0


def test_the_fused_tables_call_lets_other_threads_run_while_its_cpp_kernels_do():
    """The C++ node's call on tables whose optimizer runs in the backward
    (``_C.embedding_fused``, python=False: the `cpu` and `cuda` kernels) lets go of the GIL
    around its work, as a plain lookup's call (``_C.embedding``) does: another Python thread
    runs meanwhile. With Python's switch interval out of reach, that thread can run during a
    call only if the call releases the GIL; it held it before (ten 8x2048 `cpu` lookups under
    pytest: 0 turns of the other thread in most, at most 12 in one)."""
    from pyembed import _extension

    layer = pyembed.EmbeddingLayer(1000, 256, 2048, backend="cpu")
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, list(layer.parameters()), {"lr": 0.1})
    ids = torch.randint(0, 1000, (8, 2048))
    turns, stop = [0], threading.Event()

    def other():
        while not stop.is_set():
            turns[0] += 1
            time.sleep(0)  # gives the GIL back each turn: the lookup's thread takes it at once

    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    thread = threading.Thread(target=other)
    try:
        thread.start()
        during = []
        for _ in range(10):
            before = turns[0]
            out = _extension._C.embedding_fused(False, True, True, ids, layer.token_embedding.weight,
                                                layer.pos_embedding, None, "learned", 1.0, 0, None, False, True, 0,
                                                0.0, None, False)
            during.append(turns[0] - before)
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(interval)
    expected = pyembed.fused_embedding(ids, layer.token_embedding.weight.detach(), layer.pos_embedding.detach(),
                                       backend="reference")
    torch.testing.assert_close(out, expected)
    assert sorted(during)[len(during) // 2] > 5, during  # in most calls (16-300 turns each since)


@pytest.mark.parametrize("config", ["AdamW", "AdamW-fused", "SGD-momentum-wd", "SparseAdam"])
def test_a_checkpoint_moves_between_fused_and_plain_training(config):
    torch.manual_seed(1)
    plain = Plain(CONFIGS[config][2])
    model = Fused(plain, "auto")
    data = list(batches(6, seed=3))
    plain_opts, fused_opts = plain_optimizers(plain, config), fused_optimizers(model, config)
    plain_schedules, fused_schedules = schedulers_of(plain_opts), schedulers_of(fused_opts)
    train(plain, plain_opts, data[:3], plain_schedules)
    train(model, fused_opts, data[:3], fused_schedules)

    def resume(opts, source_opts, source_schedules):
        """Through a saved file, as a checkpoint goes (a state_dict holds the live state tensors)."""
        schedules = schedulers_of(opts)
        for target, source in zip(opts + schedules, source_opts + source_schedules):
            saved = io.BytesIO()
            torch.save(source.state_dict(), saved)
            saved.seek(0)
            target.load_state_dict(torch.load(saved))
        return opts, schedules

    # Fused -> plain: a second plain model resumes from the fused checkpoint.
    resumed = Plain(CONFIGS[config][2])
    with torch.no_grad():
        resumed.tok.weight.copy_(model.emb.token_embedding.weight)
        resumed.pos.copy_(model.emb.pos_embedding)
        resumed.head.load_state_dict(model.head.state_dict())
    resumed_run = resume(plain_optimizers(resumed, config), fused_opts, fused_schedules)
    # Plain -> fused: a second fused model resumes from the plain checkpoint.
    fused_again = Fused(plain, "auto")
    fused_again_run = resume(fused_optimizers(fused_again, config), plain_opts, plain_schedules)
    for m, (opts, schedules) in ((plain, (plain_opts, plain_schedules)), (model, (fused_opts, fused_schedules)),
                                 (resumed, resumed_run), (fused_again, fused_again_run)):
        train(m, opts, data[3:], schedules)
    assert_close_tables(model, plain, "fused vs plain")
    assert_close_tables(model, resumed, "fused -> plain checkpoint")
    assert_close_tables(fused_again, plain, "plain -> fused checkpoint")


def test_fused_embedding_module_with_scale_grad_by_freq_and_no_positions():
    """FusedEmbedding (nn.Embedding's drop-in) with scale_grad_by_freq, Adam, 4 steps."""
    torch.manual_seed(2)
    plain = nn.Embedding(V, D, scale_grad_by_freq=True)
    fused = pyembed.FusedEmbedding(V, D, scale_grad_by_freq=True, _weight=plain.weight.detach().clone())
    plain_opt = torch.optim.Adam(plain.parameters(), lr=0.05)
    pyembed.apply_optimizer_in_backward(torch.optim.Adam, [fused.weight], {"lr": 0.05})
    for ids, _ in batches(4, seed=5):
        (plain(ids) ** 2).sum().backward()
        plain_opt.step()
        plain_opt.zero_grad()
        (fused(ids) ** 2).sum().backward()
    assert_close_relative(fused.weight, plain.weight)


@pytest.mark.parametrize("config", ["SGD-momentum-wd", "AdamW", "Adagrad", "SparseAdam"])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_a_fused_step_under_fake_tensor_mode_makes_torchs_optimizer_state(config, backend):
    """FakeTensorMode (torch's memory tracker runs a training step so): the fused step
    makes the optimizer state torch's optimizer makes in the same step of the nn-ops layer
    -- the same tensors, shapes and dtypes -- and leaves no .grad, as a real fused step.
    Before, it computed the touched rows, whose count depends on the ids' values
    (DynamicOutputShapeException; no fake kernel for the cpu op; triton's kernels on fake
    tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    optimizer_class, kwargs, sparse = CONFIGS[config]
    with FakeTensorMode(shape_env=ShapeEnv()):  # (a sparse gradient's row count is a symbol)
        ids = torch.randint(0, V, (BATCH, SEQ))
        layer = pyembed.EmbeddingLayer(V, D, MAX_LEN, sparse=sparse, backend=backend)
        optimizers = pyembed.apply_optimizer_in_backward(optimizer_class, [layer.token_embedding.weight], kwargs)
        plain = nn.Embedding(V, D, sparse=sparse)
        plain_optimizer = optimizer_class(plain.parameters(), **kwargs)
        for _ in range(2):
            layer(ids).sum().backward()
            plain(ids).sum().backward()
            plain_optimizer.step()
            plain_optimizer.zero_grad()

    def described(state):
        return {k: (type(v), tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else type(v)
                for k, v in state.items()}

    assert layer.token_embedding.weight.grad is None and layer.pos_embedding.grad is not None
    assert described(optimizers[0].state[layer.token_embedding.weight]) == described(plain_optimizer.state[plain.weight])


def test_torch_finds_the_fused_optimizers_where_its_own_live():
    from torch.distributed.optim import _get_in_backward_optimizers

    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN)
    [opt] = pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [layer.token_embedding.weight], {"lr": 1e-3})
    assert _get_in_backward_optimizers(layer) == [opt]
    assert isinstance(opt, torch.optim.AdamW)


@pytest.mark.parametrize("backend", NODE_BACKENDS)
def test_under_torch_compile_the_call_takes_the_cpp_node_eagerly(backend, monkeypatch):
    """Under torch.compile a lookup on fused tables is a graph break, the call run eagerly
    as any eager call: through the C++ node where its backend has one (the same training,
    bit for bit, as through the Python Function, which it took before)."""
    name, _, device = backend.partition("@")
    torch.manual_seed(0)
    start = pyembed.EmbeddingLayer(V, D, MAX_LEN, scale_embeddings=True, padding_idx=PAD, dropout=0.2,
                                   backend=name, device=device or "cpu")
    torch._dynamo.reset()
    node_run, function_run = train_through_node_and_function(
        start, lambda layer: pyembed.apply_optimizer_in_backward(torch.optim.AdamW, layer.parameters(), {"lr": 0.1}),
        monkeypatch, compiled=True)
    torch._dynamo.reset()
    assert_same_training(node_run, function_run)


def test_under_torch_compile_the_call_runs_eagerly_and_trains_the_same():
    torch.manual_seed(4)
    plain = Plain(False)
    eager, compiled = Fused(plain, "auto"), Fused(plain, "auto")
    eager_opts, compiled_opts = fused_optimizers(eager, "AdamW"), fused_optimizers(compiled, "AdamW")
    train(eager, eager_opts, batches(3))
    train(torch.compile(compiled, backend="eager"), compiled_opts, batches(3))
    assert_close_tables(compiled, eager, "compiled vs eager")


@pytest.mark.parametrize("how", ["export", "strict export", "jit.trace"])
def test_a_model_whose_optimizer_runs_in_the_backward_exports_and_keeps_training(how):
    """torch.export and torch.jit.trace record such a table's lookup as any table's, range
    check included (a saved program holds no optimizer; strict export failed on the graph
    break that keeps these calls out of compiled graphs, the trace recorded the forward
    without the check); the model itself trains on as before."""
    torch.manual_seed(5)
    plain = Plain(False)
    model, twin = Fused(plain, "auto"), Fused(plain, "auto")
    opts, twin_opts = fused_optimizers(model, "AdamW"), fused_optimizers(twin, "AdamW")
    ids, _ = next(batches(1))
    if how == "jit.trace":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.trace is deprecated"
            program = torch.jit.trace(model.eval(), ids)
    else:
        program = torch.export.export(model.eval(), (ids,), strict=how == "strict export").module()
    torch.testing.assert_close(program(ids), model(ids), rtol=0, atol=0)
    bad = ids.clone()
    bad[0, 0] = V
    with pytest.raises((IndexError, RuntimeError), match=f"but the embedding table has V={V}"):  # (a trace's)
        program(bad)
    train(model.train(), opts, batches(2))
    train(twin.train(), twin_opts, batches(2))
    assert_close_tables(model, twin, "after an export vs never exported")


# --------------------------------------------------------------------------- kernels
RULE_CASES = [  # (optimizer class, kwargs, all_rows)
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01), True),
    (torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True), True),
    (torch.optim.SGD, dict(lr=0.1), False),
    (torch.optim.Adam, dict(lr=0.01, weight_decay=0.1), True),
    (torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1, maximize=True), True),
    (torch.optim.Adagrad, dict(lr=0.1, lr_decay=0.1, weight_decay=0.1), True),
    (torch.optim.Adagrad, dict(lr=0.1), False),
    (torch.optim.SparseAdam, dict(lr=0.01), False),
]


def _random_update(cls, kwargs, dtype, rows_count=7, num_rows=19, dim=37, steps=3, seed=0):
    """A table, its optimizer state after `steps` - 1 earlier steps (random, as torch keeps
    it) and this step's gradient rows; returns (table, state, update, rows, values)."""
    g = torch.Generator().manual_seed(seed)
    table = nn.Parameter(torch.randn(num_rows, dim, generator=g, dtype=torch.float64).to(dtype))
    optimizer = cls([table], **kwargs)
    table._pyembed_optimizer = optimizer
    with torch.no_grad():  # as inside a backward
        for _ in range(steps):  # earlier steps fill the state (the momentum buffer exists after the first)
            _, state, update = optim.prepare(table)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.shape == table.shape:
            value.copy_(torch.rand(value.shape, generator=g, dtype=torch.float64))  # >= 0: sums, second moments
    rows = torch.randperm(num_rows, generator=g)[:rows_count].sort().values
    values = torch.randn(rows_count, dim, generator=g, dtype=torch.float64).to(dtype)
    return table, state, update, rows, values


# One row: a one-token step's positional table, whose count Triton specialises as a constant
# (== 1) -- Triton 3.6 crashed compiling the every-row update for it (LLVM assertion in its
# coalescing pass; make test-compat compiles what these tests launch with that Triton).
@pytest.mark.parametrize("rows_count", [7, 1])
@pytest.mark.parametrize("dim", [37, 40])  # 40: rows of 16-byte multiples (vector accesses) in every dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", range(len(RULE_CASES)))
@pytest.mark.parametrize("kernel", ["cpu", "cuda-emulated", "triton"])
def test_update_kernel_equals_torch_functional_optimizer(kernel, case, dtype, dim, rows_count, request):
    if kernel == "cuda-emulated":
        run = request.getfixturevalue("emulated").optimizer_update
    else:
        if kernel not in CPU_BACKENDS:
            pytest.skip(f"the {kernel} backend is not available on CPU tensors here")
        run = dispatch.get(kernel).optimizer_update
    cls, kwargs, all_rows = RULE_CASES[case]
    table, state, update, rows, values = _random_update(cls, kwargs, dtype, rows_count=rows_count, dim=dim)
    assert update.all_rows == all_rows
    # The spec: torch's functional optimizer in float64 on the same inputs, then rounded.
    exact_table = table.detach().double().clone()
    exact_state = {k: (v.double().clone() if isinstance(v, torch.Tensor) and v.shape == table.shape else
                       (v.clone() if isinstance(v, torch.Tensor) else v)) for k, v in state.items()}
    optim.reference_update(exact_table, exact_state, update, rows, values.double(),
                           sparse_grad=cls is torch.optim.SparseAdam)  # torch's SparseAdam takes only sparse ones
    state1, state2 = optim.state_tensors(update.rule, state, table)
    run(table.detach(), state1, state2, rows, values, update.rule, list(update.hyper), update.all_rows)
    # Computed in float32 and rounded once: within a few units of the dtype's last place.
    tol = {torch.float32: 2e-6, torch.float64: 1e-12, torch.bfloat16: 2 * 2.0**-8}[dtype]
    torch.testing.assert_close(table.detach().double(), exact_table, rtol=tol, atol=tol)
    for key, value in exact_state.items():
        if isinstance(value, torch.Tensor) and value.shape == table.shape:
            torch.testing.assert_close(state[key].double(), value, rtol=tol, atol=tol, msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("kernel", ["cuda-emulated", "triton"])
def test_gpu_touched_rows_need_no_sync_and_the_update_skips_their_unused_slots(kernel, request):
    """On a GPU the touched rows are sized by min(tokens, V) (no host sync for their count),
    unused slots row -1: the same rows and sums as the sparse backward, and the same update
    as with the exact rows, in both update modes."""
    if kernel == "cuda-emulated":
        emulated = request.getfixturevalue("emulated")
        touched_rows, sparse_backward, update = (emulated.embedding_touched_rows, emulated.embedding_sparse_backward,
                                                 emulated.optimizer_update)
    else:
        if kernel not in CPU_BACKENDS:
            pytest.skip(f"the {kernel} backend is not available on CPU tensors here")
        backend = dispatch.get(kernel)
        touched_rows, sparse_backward, update = backend.touched_rows, backend.sparse_backward, backend.optimizer_update
    g = torch.Generator().manual_seed(3)
    ids = torch.tensor([[4, 9, 4, 17, 2, 2, 30, 9]])  # 5 distinct rows (2 the padding), 8 slots, one out of range
    dout = torch.randn(1, 8, 16, generator=g)
    rows, values = touched_rows(dout, ids, 19, 1.5, 2, True)
    exact_rows, exact_values = sparse_backward(dout, ids, 19, 1.5, 2, True)
    used = rows >= 0
    assert rows.shape == (8,) and torch.equal(rows[used], exact_rows) and not used[len(exact_rows):].any()
    torch.testing.assert_close(values[used], exact_values)
    for cls, kwargs, all_rows in (RULE_CASES[3], RULE_CASES[7]):  # Adam (every row), SparseAdam (touched rows)
        results = []
        for r, v in ((rows, values), (exact_rows, exact_values)):
            table, state, upd, _, _ = _random_update(cls, kwargs, torch.float32, num_rows=19, dim=16)
            state1, state2 = optim.state_tensors(upd.rule, state, table)
            update(table.detach(), state1, state2, r, v, upd.rule, list(upd.hyper), upd.all_rows)
            results.append(torch.cat([table.detach(), state1, state2]))
        assert upd.all_rows == all_rows and torch.equal(results[0], results[1])


def _optimizer_backward_cases():
    """(kernel, variant, case, dtype, dim, tokens): every combination for the CUDA kernels
    (emulated, and on a GPU); for `triton` its sorted path (300 tokens) -- under the
    interpreter (~2.5 s a case) plain in float32 and with scale_grad_by_freq and dropout in
    bfloat16, at 16-byte rows (d is a mask there, not another code path); on a GPU every
    variant, dtype and width, as the compiler may round each specialisation its own way
    (fp32 AdamW with dropout, in no other case, differed there at 1b594a4). The fallback
    of at most FEW_TOKENS tokens calls the two ops it is compared with."""
    for kernel in ["cuda-emulated", "triton"] + GPU_KERNELS:
        for variant, case, dtype, dim, tokens in itertools.product(
                ["plain", "by_freq+dropout"],
                [0, 2, 4, 5],  # SGD momentum, SGD (touched rows only), AdamW, Adagrad
                [torch.float32, torch.bfloat16],
                [10, 24],  # 24: 16-byte rows in both dtypes (vector accesses)
                [24, 300]):  # 24: at most kFewTokens, no sort; 300: a 150-use row's pieces
            interpreted = tokens == 300 and dim == 24 and (variant == "plain") == (dtype == torch.float32)
            if kernel == "triton" and not interpreted:
                continue
            if kernel == "triton@cuda" and tokens != 300:
                continue
            yield pytest.param(kernel, variant, case, dtype, dim, tokens,
                               id=f"{kernel}-{variant}-{case}-{str(dtype)[6:]}-{dim}-{tokens}")


@pytest.mark.parametrize("kernel, variant, case, dtype, dim, tokens", list(_optimizer_backward_cases()))
def test_optimizer_backward_equals_touched_rows_then_update(kernel, variant, case, dtype, dim, tokens, request):
    """optimizer_backward (a dense table's update straight from dout and ids, the segments
    summed in the update's kernel) gives the bits of the two-op form it replaces: the
    touched rows' sums, then optimizer_update -- padding, out-of-range ids, a hot row longer
    than a chunk, scale_grad_by_freq and the forward's dropout as that form has them."""
    device = torch.device("cuda" if kernel.endswith("@cuda") else "cpu")
    if kernel == "cuda-emulated":
        ops = request.getfixturevalue("emulated")
    elif kernel == "cuda@cuda":
        ops = torch.ops.pyembed
    else:  # triton (under the interpreter on CPU tensors): its Python functions with the ops' schemas
        if device.type == "cpu" and kernel not in CPU_BACKENDS:
            pytest.skip("the triton backend is not available on CPU tensors here")
        backend = dispatch.get("triton")
        ops = types.SimpleNamespace(optimizer_backward=backend.optimizer_backward,
                                    embedding_touched_rows=backend.touched_rows,
                                    optimizer_update=backend.optimizer_update)
    cls, kwargs, all_rows = RULE_CASES[case]
    g = torch.Generator().manual_seed(case * 7 + tokens)
    num_rows, padding_idx = 50, 3
    ids = torch.randint(0, num_rows, (tokens,), generator=g)
    ids[: tokens // 2] = 11  # hot: at 300 tokens longer than a chunk (128)
    ids[1], ids[-1], ids[-2] = padding_idx, num_rows + 4, num_rows  # the padding row; out of range (validate=False)
    ids = ids[torch.randperm(tokens, generator=g)].view(2, tokens // 2).to(device)
    dout = torch.randn(2, tokens // 2, dim, generator=g).to(device=device, dtype=dtype)
    by_freq, dropout = variant != "plain", variant != "plain"
    key = torch.tensor([1234, 8], dtype=torch.long, device=device) if dropout else None
    p = 0.25 if dropout else 0.0
    results = []
    for fused in (True, False):
        table, state, update, _, _ = _random_update(cls, kwargs, dtype, num_rows=num_rows, dim=dim, seed=case)
        assert update.all_rows == all_rows
        table = table.detach().to(device)
        state1, state2 = (s.to(device) for s in optim.state_tensors(update.rule, state, table))
        if fused:
            ops.optimizer_backward(dout, ids, 2.5, padding_idx, by_freq, key, p, table, state1, state2,
                                   update.rule, list(update.hyper), update.all_rows)
        else:
            rows, values = ops.embedding_touched_rows(dout, ids, num_rows, 2.5, padding_idx, by_freq, key, p)
            ops.optimizer_update(table, state1, state2, rows, values, update.rule, list(update.hyper), update.all_rows)
        results.append([table.cpu(), state1.cpu(), state2.cpu()])
    for name, fused, two_ops in zip(("table", "state1", "state2"), *results):
        assert torch.equal(fused, two_ops), name
    before = _random_update(cls, kwargs, dtype, num_rows=num_rows, dim=dim, seed=case)[0]
    assert not torch.equal(results[0][0], before)  # it did update


@pytest.mark.parametrize("case", [0, 2, 4, 5])  # SGD momentum, SGD (no state), AdamW, Adagrad
@pytest.mark.parametrize("variant", ["plain", "dropout+bf16"])
@pytest.mark.parametrize("kernel", ["cuda-emulated", "triton"] + GPU_KERNELS)
def test_position_update_equals_the_positions_gradient_then_update(kernel, variant, case, request):
    """position_update (the learned positions' update straight from dout, p = offset + t)
    gives the bits of the two-op form it replaces: the positions' gradient (the backward op),
    then optimizer_update over every row -- the rows the sequence does not reach (below the
    offset, and past the table's end for its last tokens) with a zero gradient -- and the
    forward's dropout as that form applies it."""
    device = torch.device("cuda" if kernel.endswith("@cuda") else "cpu")
    if kernel == "cuda-emulated":
        emulated = request.getfixturevalue("emulated")
        backend = types.SimpleNamespace(position_update=emulated.position_update, backward=emulated.embedding_backward,
                                        optimizer_update=emulated.optimizer_update)
    else:
        if kernel == "triton" and kernel not in CPU_BACKENDS:
            pytest.skip("the triton backend is not available on CPU tensors here")
        backend = dispatch.get(kernel.removesuffix("@cuda"))
    cls, kwargs, _ = RULE_CASES[case]
    dtype = torch.float32 if variant == "plain" else torch.bfloat16
    g = torch.Generator().manual_seed(case)
    num_positions, dim, offset = 40, 24, 15  # 30 tokens a sequence: the last 5 past the table
    ids = torch.randint(0, 50, (3, 30), generator=g).to(device)
    dout = torch.randn(3, 30, dim, generator=g).to(device=device, dtype=dtype)
    key = torch.tensor([99, 4], dtype=torch.long, device=device) if variant != "plain" else None
    p = 0.3 if key is not None else 0.0
    results = []
    for fused in (True, False):
        table, state, update, _, _ = _random_update(cls, kwargs, dtype, num_rows=num_positions, dim=dim, seed=case)
        table = table.detach().to(device)
        state1, state2 = (s.to(device) for s in optim.state_tensors(update.rule, state, table))
        if fused:
            backend.position_update(dout, ids, offset, key, p, table, state1, state2, update.rule, list(update.hyper))
        else:
            _, grad = backend.backward(dout, ids, None, offset, 0, num_positions, 2.5, None, False, False, True, key, p)
            backend.optimizer_update(table, state1, state2, torch.arange(num_positions, device=device), grad,
                                     update.rule, list(update.hyper), False)
        results.append([table.cpu(), state1.cpu(), state2.cpu()])
    for name, fused, two_ops in zip(("table", "state1", "state2"), *results):
        assert torch.equal(fused, two_ops), name
    before = _random_update(cls, kwargs, dtype, num_rows=num_positions, dim=dim, seed=case)[0]
    assert not torch.equal(results[0][0], before)  # it did update


@pytest.mark.parametrize("kernel", ["triton", "cuda-emulated"])
@pytest.mark.parametrize("step_beside_table", [False, True], ids=["step-on-cpu", "fused-step-beside-table"])
def test_fused_backward_allocates_no_table_sized_gradient_and_reads_nothing_back(kernel, request, monkeypatch,
                                                                                 step_beside_table):
    """A second AdamW step under a dispatch recorder: no op makes a tensor of the (V, d)
    table's bytes (the gradient torch's optimizer needs is never materialised; the state exists since the
    first step) and none reads device data back, the step counter included where a fused=True
    group keeps it beside the table (on a GPU: counted on the host); a plain group's step,
    which torch keeps on the CPU, is read (Triton under the interpreter; the CUDA host code
    under emulation)."""
    from test_host_sync import HostSyncRecorder

    name = "triton" if kernel == "triton" else "cuda"
    if kernel == "triton" and name not in CPU_BACKENDS:
        pytest.skip("the triton backend is not available on CPU tensors here")
    if kernel == "cuda-emulated":
        install_emulated_cuda(request.getfixturevalue("emulated"), monkeypatch)
    vocab, dim = 3000, 16
    layer = pyembed.EmbeddingLayer(vocab, dim, 64, backend=name)
    [optimizer] = pyembed.apply_optimizer_in_backward(
        torch.optim.AdamW, [layer.token_embedding.weight, layer.pos_embedding], {"lr": 1e-3, "fused": step_beside_table})
    ids = torch.randint(0, vocab, (4, 50))
    layer(ids).sum().backward()  # the first step creates the state (zeros_like the table)
    steps = [optimizer.state[p]["step"] for p in layer.parameters()]

    class Recorder(HostSyncRecorder):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            read_step = func._schema.name == "aten::_local_scalar_dense" and any(args[0] is t for t in steps)
            if read_step and not step_beside_table:
                self.syncs.remove(func._schema.name)  # torch's CPU step counter (state["step"]), not device data
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and not (func._schema.is_mutable or func.is_view):  # new memory
                    self.largest = max(self.largest, t.numel() * t.element_size())  # bytes: scratch is bytes
            return out

    out = layer(ids).sum()
    with Recorder() as recorder:
        out.backward()
    assert recorder.syncs == []
    assert 0 < recorder.largest < vocab * dim * layer.token_embedding.weight.element_size(), recorder.largest
    assert layer.token_embedding.weight.grad is None
    assert [float(optimizer.state[p]["step"]) for p in layer.parameters()] == [2.0, 2.0]


def test_rule_codes_agree_with_the_cuda_and_cpu_header():
    header = (ROOT / "csrc" / "optim.h").read_text()
    enum = re.search(r"enum Rule : int \{([^}]*)\}", header).group(1)
    codes = {name.strip().split("=")[0].strip(): int(name.split("=")[1]) for name in enum.split(",")}
    assert codes == {"kSGD": optim.SGD, "kAdam": optim.ADAM, "kAdagrad": optim.ADAGRAD,
                     "kSparseAdam": optim.SPARSE_ADAM}


def test_rows_outside_the_table_or_unsorted_are_refused_by_the_cpu_op():
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the cpu backend is not built")
    table, state, update, _, values = _random_update(torch.optim.SGD, dict(lr=0.1), torch.float32, rows_count=2)
    before = table.detach().clone()
    for rows in (torch.tensor([3, 19]), torch.tensor([-1, 2]), torch.tensor([5, 5]), torch.tensor([6, 4])):
        with pytest.raises(IndexError, match="ascending, unique"):
            torch.ops.pyembed.optimizer_update(table.detach(), torch.empty(0), torch.empty(0), rows, values,
                                               update.rule, list(update.hyper), False)
    assert torch.equal(table.detach(), before)


def test_a_scheduler_stepped_without_the_no_op_step_neither_warns_nor_skips_a_value(backend):
    # The update is the backward's, so a loop may leave out step() (it does nothing): an LR
    # scheduler then warned that step() was never called before it ("skipping the first
    # value"), which was false -- the lrs it sets are the schedule's, as over a torch optimizer.
    torch.manual_seed(0)
    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN, backend=backend)
    [optimizer] = pyembed.apply_optimizer_in_backward(torch.optim.SGD, [layer.token_embedding.weight], {"lr": 1.0})
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    plain = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    plain_scheduler = torch.optim.lr_scheduler.StepLR(plain, step_size=1, gamma=0.5)
    lrs = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            before = layer.token_embedding.weight.detach().clone()
            layer(torch.tensor([[1, 2]])).sum().backward()
            moved = (before - layer.token_embedding.weight.detach())[1]
            lrs.append(moved[0].item())  # lr * d(sum)/dw = lr (one use, positions aside)
            scheduler.step()
            plain.step()
            plain_scheduler.step()
    assert not [w for w in caught if "lr_scheduler" in str(w.message)], [str(w.message) for w in caught]
    assert lrs == pytest.approx([1.0, 0.5, 0.25], rel=1e-6)  # (within the table's fp32 rounding)
    assert optimizer.param_groups[0]["lr"] == plain.param_groups[0]["lr"] == 0.125


# --------------------------------------------------------------------------- errors
def test_what_cannot_be_fused_raises_clearly():
    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN)
    weight = layer.token_embedding.weight
    with pytest.raises(TypeError, match="SGD, Adam, AdamW, Adagrad, SparseAdam"):
        pyembed.apply_optimizer_in_backward(torch.optim.RMSprop, [weight], {"lr": 0.1})
    with pytest.raises(TypeError, match="Parameters of pyembed tables"):
        pyembed.apply_optimizer_in_backward(torch.optim.SGD, [weight.detach()], {"lr": 0.1})
    quantized = torch.nn.Parameter(RowQuantized.quantize(weight.detach()))  # (its own lookup: no fused update)
    with pytest.raises(TypeError, match="tensor subclasses such as quantized tables"):
        pyembed.apply_optimizer_in_backward(torch.optim.SGD, [quantized], {"lr": 0.1})
    with pytest.raises(ValueError, match="amsgrad"):
        pyembed.apply_optimizer_in_backward(torch.optim.Adam, [weight], {"lr": 0.1, "amsgrad": True})
    # A fused positional table beside a quantized token table: that call's lookup is the
    # subclass's own (no fused update), so the forward refuses it, nothing updated, where
    # the backward had blamed "a gradient from outside pyembed's op".
    frozen = pyembed.EmbeddingLayer(V, D, MAX_LEN)
    frozen.token_embedding.weight = torch.nn.Parameter(RowQuantized.quantize(weight.detach()), requires_grad=False)
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, [frozen.pos_embedding], {"lr": 0.1})
    before = frozen.pos_embedding.detach().clone()
    with pytest.raises(TypeError, match=r"fused optimizer .* beside a tensor subclass \(RowQuantized"):
        frozen(torch.randint(0, V, (2, 5)))
    assert torch.equal(frozen.pos_embedding.detach(), before) and frozen.pos_embedding.grad is None
    [fused] = pyembed.apply_optimizer_in_backward(torch.optim.SGD, [weight], {"lr": 0.1})
    with pytest.raises(ValueError, match="already has an optimizer"):
        pyembed.apply_optimizer_in_backward(torch.optim.SGD, [weight], {"lr": 0.1})
    # A GradScaler (fp16 loss scaling) stepping it: the backward has updated the table from
    # the scaled gradient (x 1024 here), so its step says so -- after unscale_ too -- instead
    # of the scaler's "No inf checks were recorded for this optimizer".
    for unscale_first in (False, True):
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        before = weight.detach().clone()
        scaler.scale(layer(torch.tensor([[1, 2]])).sum()).backward()
        assert (before - weight.detach())[1, 0].item() == pytest.approx(0.1 * 1024, rel=1e-3)  # the scaled update
        if unscale_first:
            scaler.unscale_(fused)
        with pytest.raises(ValueError, match="GradScaler stepped an optimizer of apply_optimizer_in_backward"):
            scaler.step(fused)
    # A parameter added to it later would never be updated (its step() does nothing): refused.
    head = nn.Linear(D, 1)
    with pytest.raises(ValueError, match="takes no more parameters"):
        fused.add_param_group({"params": [head.weight]})
    assert len(fused.param_groups) == 1


def test_step_hooks_run_when_the_fused_optimizers_step_is_called():
    # Its step() does nothing, but hooks on it (an EMA, a logger) run as on torch's SGD's.
    from torch.optim.optimizer import register_optimizer_step_post_hook

    calls = []
    emb, plain = pyembed.FusedEmbedding(V, D), nn.Embedding(V, D)
    [fused] = pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    sgd = torch.optim.SGD(plain.parameters(), lr=0.1)
    handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: calls.append(("global", opt)))
    try:
        for opt in (fused, sgd):
            opt.register_step_pre_hook(lambda o, args, kwargs: calls.append(("pre", o)))
            opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o)))
        for model, opt in ((emb, fused), (plain, sgd)):
            model(torch.tensor([1, 2])).sum().backward()
            opt.step()
    finally:
        handle.remove()
    assert calls == [("pre", fused), ("post", fused), ("global", fused), ("pre", sgd), ("post", sgd), ("global", sgd)]


def test_a_torch_optimizer_stepping_a_fused_table_raises():
    emb = pyembed.FusedEmbedding(V, D)
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    other = torch.optim.AdamW(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(ValueError, match="leave that table out"):
        other.step()


def test_a_tied_output_layer_gradient_raises_instead_of_being_lost():
    emb = pyembed.FusedEmbedding(V, D)
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    hidden = emb(torch.tensor([[1, 2, 3]]))
    logits = hidden @ emb.weight.t()  # GPT-2's tied head
    with pytest.raises(ValueError, match="from outside pyembed"):
        logits.sum().backward()


def test_two_uses_in_one_backward_raise():
    emb = pyembed.FusedEmbedding(V, D)
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    before = emb.weight.detach().clone()
    with pytest.raises(ValueError, match="used twice in one backward"):
        (emb(torch.tensor([1])) + emb(torch.tensor([2]))).sum().backward()
    # Two backwards, one use each, are two steps (gradient accumulation is not possible).
    emb(torch.tensor([1])).sum().backward()
    emb(torch.tensor([1])).sum().backward()
    assert not torch.equal(emb.weight.detach()[1], before[1])


@pytest.mark.parametrize("cls, sparse, match", [
    (torch.optim.SparseAdam, False, "SparseAdam needs a sparse gradient"),
    (torch.optim.AdamW, True, "does not support sparse gradients"),
])
def test_an_optimizer_torch_would_refuse_for_this_gradient_is_refused(cls, sparse, match):
    emb = pyembed.FusedEmbedding(V, D, sparse=sparse)
    pyembed.apply_optimizer_in_backward(cls, [emb.weight], {"lr": 0.1})
    with pytest.raises(ValueError, match=match):
        emb(torch.tensor([1, 2]))


def test_create_graph_through_a_fused_table_raises():
    emb = pyembed.FusedEmbedding(V, D)
    pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    with pytest.raises(ValueError, match="create_graph"):
        emb(torch.tensor([1, 2])).pow(2).sum().backward(create_graph=True)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_an_update_in_a_cuda_graph_capture_raises_and_changes_nothing(backend, monkeypatch):
    # The update's scalars (lr, bias correction) come from the host at each backward: a CUDA
    # graph would replay the captured ones, silently not torch's AdamW. Refused, as torch's
    # optimizers refuse capture without capturable=True. Here the capture is stood in for
    # (optim._captured, whose CUDA query tests/gpu/test_gpu_readiness.py makes for real).
    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN, backend=backend)
    tables = [layer.token_embedding.weight, layer.pos_embedding]
    pyembed.apply_optimizer_in_backward(torch.optim.AdamW, tables, {"lr": 0.1})
    before = [t.detach().clone() for t in tables]
    monkeypatch.setattr(optim, "_captured", lambda table: True)
    with pytest.raises(ValueError, match="CUDA graph capture"):
        layer(torch.tensor([[1, 2, 3]])).sum().backward()
    assert all(torch.equal(t, b) for t, b in zip(tables, before))
    monkeypatch.undo()  # outside a capture it trains as before
    layer(torch.tensor([[1, 2, 3]])).sum().backward()
    assert not torch.equal(tables[0][1], before[0][1])


def test_a_warning_under_torch_distributed_where_replicas_would_drift():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    emb = pyembed.FusedEmbedding(V, D)
    torch.distributed.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        with pytest.warns(RuntimeWarning, match="no all-reduce"):
            pyembed.apply_optimizer_in_backward(torch.optim.SGD, [emb.weight], {"lr": 0.1})
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.parametrize("rule, held", [(optim.SGD, ()), (optim.ADAGRAD, ("sum",))], ids=["SGD", "Adagrad"])
def test_unused_state_tensors_are_on_the_tables_device(rule, held):
    # The C++ ops refuse tensors on two devices: on an H100, SGD and Adagrad on CUDA tables
    # failed with CPU placeholders for the state they do not have (meta stands in here).
    table = torch.empty(V, D, device="meta")
    state = {name: torch.empty_like(table) for name in held}
    assert all(t.device == table.device for t in optim.state_tensors(rule, state, table))


def test_a_cpu_step_is_counted_in_the_tensor_torch_keeps():
    """A group neither fused nor capturable keeps its step as torch does: one float32 CPU
    tensor, incremented in place (optim._cpu_step writes it through a view of its memory,
    not with a torch op). The count is the tensor's: a change a user makes to it, or a new
    tensor put in its place (a checkpoint), is what the next step counts from -- seen in the
    bias correction the step uses, 1 - beta1**step."""
    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN, backend="cpu")  # the reference's update makes a new step tensor
    [optimizer] = pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [layer.token_embedding.weight],
                                                      {"betas": (0.5, 0.75)})
    table = layer.token_embedding.weight
    ids = torch.randint(0, V, (BATCH, SEQ))
    for _ in range(3):
        layer(ids).sum().backward()
    step = optimizer.state[table]["step"]
    assert (step.dtype, step.device, float(step)) == (torch.float32, torch.device("cpu"), 3.0)
    layer(ids).sum().backward()
    assert optimizer.state[table]["step"] is step and float(step) == 4.0

    def bias_correction() -> float:
        with torch.no_grad():
            return optim.prepare(table)[2].hyper[7]

    step.fill_(9.0)
    assert bias_correction() == 1 - 0.5**10 and float(step) == 10.0
    optimizer.state[table]["step"] = torch.tensor(20.0)
    assert bias_correction() == 1 - 0.5**21 and float(optimizer.state[table]["step"]) == 21.0
    assert float(step) == 10.0  # the tensor no longer the state's is left as it was


def test_a_forward_on_fused_tables_compares_no_tensors():
    """The host code of a forward whose tables have their optimizer in the backward runs no
    tensor comparison: a Python ``==`` / ``!=`` involving a tensor goes through torch's
    function dispatch (~9 us a call, as ``optim.fused_tables`` once paid on every forward).
    Recorded at the torch-function level, where such a call shows; the step still trains
    (the tables change)."""
    from torch.overrides import TorchFunctionMode

    class Comparisons(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if getattr(func, "__name__", "") in ("__eq__", "__ne__", "eq", "ne"):
                self.seen.append(func)
            return func(*args, **(kwargs or {}))

    layer = pyembed.EmbeddingLayer(V, D, MAX_LEN, backend="cpu")
    pyembed.apply_optimizer_in_backward(torch.optim.AdamW, layer.parameters(), {"lr": 0.1})
    before = [p.detach().clone() for p in layer.parameters()]
    ids = torch.randint(0, V, (BATCH, SEQ))
    with Comparisons() as mode:
        out = layer(ids)
    assert mode.seen == []
    out.sum().backward()
    assert all(not torch.equal(p, b) for p, b in zip(layer.parameters(), before))


def test_the_fused_update_builds_no_row_map(request):
    """AdamW updates every row of a table: the token table's kernel finds each row's
    gradient among the touched rows by a binary search (they are ascending), and the
    learned positions' dense gradient has a row for every position, taken as given -- no
    (V,) or (P,) map, no arange, no int tensor made per step at all. ATen ops of a second
    step's backward recorded (the triton backend's host code under the interpreter; a
    batch within FEW_TOKENS, whose touched rows and update are two launches); the result
    is the torch optimizer's (test_fused_training_equals_torch_optimizer)."""
    from test_host_sync import HostSyncRecorder

    if "triton" not in CPU_BACKENDS:
        pytest.skip("the triton backend is not available on CPU tensors here")

    class Made(HostSyncRecorder):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if func._schema.name in ("aten::full", "aten::arange", "aten::arange.start_step"):
                self.calls[-1] = (func._schema.name, out.dtype, out.numel())
            return out

    vocab, positions = 40, 24
    layer = pyembed.EmbeddingLayer(vocab, D, positions, backend="triton")
    pyembed.apply_optimizer_in_backward(torch.optim.AdamW, layer.parameters(), {"lr": 0.1})
    ids = torch.randint(0, vocab, (BATCH, SEQ))
    layer(ids).sum().backward()  # the first step creates the state
    out = layer(ids).sum()
    with Made() as made:
        out.backward()
    int_tensors_made = [(name, numel) for name, dtype, numel in made.calls
                        if name.startswith(("aten::full", "aten::arange")) and dtype == torch.long]
    assert int_tensors_made == [], int_tensors_made


def test_a_dropped_fused_table_is_freed_by_the_cycle_collector():
    """The table and its in-backward optimizer refer to each other (as with
    torch.distributed.optim), so dropping them frees nothing until gc.collect() (README;
    the benchmark collects between cases) -- and then everything, the state included."""
    import gc
    import weakref

    layer = pyembed.FusedEmbedding(100, 8)
    [opt] = pyembed.apply_optimizer_in_backward(torch.optim.AdamW, [layer.weight], {"lr": 1e-3})
    layer(torch.randint(0, 100, (2, 5))).sum().backward()
    table, state = weakref.ref(layer.weight), weakref.ref(opt.state[layer.weight]["exp_avg"])
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        del layer, opt
        assert table() is not None and state() is not None
        gc.collect()
        assert table() is None and state() is None
    finally:
        if was_enabled:
            gc.enable()
