"""Every row of DESIGN §3: the exception type, a message naming the values, and no
change to any table."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch

import pyembed
from helpers import CPU_BACKENDS

V, D, P = 10, 8, 6


def _tables():
    return torch.randn(V, D), torch.randn(P, D)


CASES = [
    # (id, kwargs builder, exception, message fragment)
    ("float ids", lambda w, p: dict(ids=torch.zeros(2, 3), weight=w), TypeError, "torch.float32"),
    ("bool ids", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.bool), weight=w), TypeError, "torch.bool"),
    ("list ids", lambda w, p: dict(ids=[[1, 2]], weight=w, pos_weight=p), TypeError, "tensor, got list"),
    ("array ids", lambda w, p: dict(ids=np.zeros((2, 3), dtype=np.int64), weight=w), TypeError, "got ndarray"),
    ("list weight", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w.tolist()),
     TypeError, "tensor, got list"),
    # (arguments the C++ backends' typed call cannot take: pyembed's checks name them, as for the reference)
    ("list position_ids", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p,
                                            position_ids=[[0, 1, 2]] * 2), TypeError, "position_ids must be"),
    ("pos_encoding not a string", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w,
                                                    pos_encoding=5), ValueError, "got 5"),
    ("id too large", lambda w, p: dict(ids=torch.tensor([[1, 10, 3]]), weight=w), IndexError, "max id 10"),
    ("negative id", lambda w, p: dict(ids=torch.tensor([[-1, 2]]), weight=w), IndexError, "min id -1"),
    ("V in message", lambda w, p: dict(ids=torch.tensor([[12]]), weight=w), IndexError, "V=10"),
    ("learned position past max", lambda w, p: dict(ids=torch.zeros(2, 7, dtype=torch.long), weight=w, pos_weight=p),
     ValueError, "max_seq_len=6"),
    ("offset past max", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p, offset=4),
     ValueError, "offset 4"),
    ("position_ids past max", lambda w, p: dict(ids=torch.zeros(1, 3, dtype=torch.long), weight=w, pos_weight=p,
                                                position_ids=torch.tensor([[0, 6, 1]])), ValueError, "position 6"),
    ("position_ids shape", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p,
                                             position_ids=torch.zeros(2, 4, dtype=torch.long)), ValueError, "(2, 4)"),
    ("negative position_ids", lambda w, p: dict(ids=torch.zeros(1, 3, dtype=torch.long), weight=w,
                                                pos_encoding="sinusoidal", position_ids=torch.tensor([[0, -2, 1]])),
     ValueError, "-2"),
    ("dim mismatch", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=torch.randn(P, 4)),
     ValueError, "embedding dimension mismatch"),
    ("odd d sinusoidal", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=torch.randn(V, 7),
                                           pos_encoding="sinusoidal"), ValueError, "d=7"),
    ("rank 3 with PE", lambda w, p: dict(ids=torch.zeros(2, 3, 4, dtype=torch.long), weight=w,
                                         pos_encoding="sinusoidal"), ValueError, "(2, 3, 4)"),
    ("rank 0 with PE", lambda w, p: dict(ids=torch.tensor(1), weight=w, pos_weight=p), ValueError, "()"),
    ("devices", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long, device="meta"), weight=w),
     ValueError, "meta"),
    ("negative offset", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p, offset=-1),
     ValueError, "offset"),
    ("unknown pos_encoding", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w,
                                               pos_encoding="rotary"), ValueError, "rotary"),
    ("padding_idx out of range", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, padding_idx=10),
     ValueError, "padding_idx=10"),
    ("integer weight with positions", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long),
                                                        weight=torch.ones(V, D, dtype=torch.long), pos_weight=p),
     TypeError, "torch.int64"),
    ("weight not 2-D", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=torch.randn(V)),
     ValueError, "2-D"),
    ("pos_weight with a sinusoid", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p,
                                                     pos_encoding="sinusoidal"), ValueError, "pos_weight was given"),
    ("position_ids without PE", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w,
                                                  position_ids=torch.zeros(2, 3, dtype=torch.long)),
     ValueError, "no positional encoding"),
    ("float position_ids", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p,
                                             position_ids=torch.zeros(2, 3)), TypeError, "torch.float32"),
    ("position_ids and offset", lambda w, p: dict(ids=torch.zeros(2, 3, dtype=torch.long), weight=w, pos_weight=p,
                                                  position_ids=torch.zeros(2, 3, dtype=torch.long), offset=1),
     ValueError, "not both"),
]


# Arguments of a Python type no op's schema holds (a list for a tensor, an int for a string):
# refused before any op runs, by pyembed's Python checks.
PYTHON_TYPE_CASES = ("list ids", "array ids", "list weight", "list position_ids", "pos_encoding not a string")


def _pytorch_class(ids, weight, **_):
    """The class PyTorch itself raises for the same lookup: F.embedding's error, or the
    RuntimeError it raises for any argument it refuses."""
    try:
        torch.nn.functional.embedding(ids, weight)
    except Exception as exc:  # noqa: BLE001 - whatever PyTorch raises is the answer
        return type(exc)
    return RuntimeError


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_clear_error_and_corrupts_nothing(backend, case):
    _, build, exc, fragment = case
    weight, pos_weight = _tables()
    kwargs = build(weight, pos_weight)
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.device.type != "meta"}
    with pytest.raises(exc) as info:
        pyembed.fused_embedding(backend=backend, **kwargs)
    assert fragment in str(info.value), str(info.value)
    # Code written for nn.Embedding catches what PyTorch raises: ours is that class too.
    assert isinstance(info.value, _pytorch_class(**kwargs)), (type(info.value).__mro__, _pytorch_class(**kwargs))
    for k, v in before.items():
        assert torch.equal(kwargs[k], v), f"{k} changed"


# The checks of values (a sequence longer than the learned table is a shape, refused when traced).
RANGE_CASES = [c for c in CASES if c[0] in ("id too large", "negative id", "V in message", "position_ids past max",
                                            "negative position_ids")]


@pytest.mark.parametrize("case", RANGE_CASES, ids=[c[0] for c in RANGE_CASES])
def test_compiled_range_checks_raise_the_eager_errors(case):
    """Under torch.compile the ranges are checked by the pyembed::check_ranges op the graph
    holds (its C++ kernel where the extension is built): the same class and message as
    the eager call, and no table changed."""
    _, build, exc, fragment = case
    weight, pos_weight = _tables()
    kwargs = build(weight, pos_weight)
    ids = kwargs.pop("ids")
    before = {k: v.clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    torch._dynamo.reset()
    compiled = torch.compile(lambda ids: pyembed.fused_embedding(ids, **kwargs), fullgraph=True, backend="aot_eager")
    with pytest.raises(exc) as info:
        compiled(ids)
    assert fragment in str(info.value), str(info.value)
    with pytest.raises(exc) as eager:
        pyembed.fused_embedding(ids, **kwargs)
    assert str(info.value) == str(eager.value)
    for k, v in before.items():
        assert torch.equal(kwargs[k], v), f"{k} changed"


def test_compiled_range_check_raises_where_torchs_compiled_lookup_aborts():
    """Inductor's C++ kernels check an index with a throw inside the loop; once a batch is
    large enough for the loop to run in parallel (OpenMP), the throw escapes the parallel
    region and the process aborts (SIGABRT; pytorch/pytorch#195402, open on torch 2.14.1:
    a compiled nn.Embedding, 64x512 ids, one bad). pyembed's check is an op of its own
    before the lookup: the compiled layer, an Inductor kernel after it, raises the eager
    IndexError at that size, and with validate=False gives the bad id its zero row."""
    weight = torch.randn(V, D)
    ids = torch.randint(0, V, (64, 512), generator=torch.Generator().manual_seed(0))
    ids[37, 300] = V
    torch._dynamo.reset()
    for validate in (True, False):
        compiled = torch.compile(lambda ids: pyembed.fused_embedding(ids, weight, validate=validate) * 2.0 + 1.0)
        compiled(ids.clamp(max=V - 1))
        if validate:
            with pytest.raises(IndexError, match=f"max id {V}, but the embedding table has V={V} rows"):
                compiled(ids)
        else:
            out = compiled(ids)
            assert torch.equal(out[37, 300], torch.ones(D))
            good = ids != V
            assert torch.equal(out[good], torch.nn.functional.embedding(ids[good], weight) * 2.0 + 1.0)


# Refused while Dynamo traces (types and shapes; the ranges are the op's, above).
TRACED_CASES = [c for c in CASES if c[0] in ("float ids", "learned position past max", "offset past max",
                                             "position_ids shape", "negative offset", "rank 3 with PE")]


@pytest.mark.parametrize("case", TRACED_CASES, ids=[c[0] for c in TRACED_CASES])
def test_compiled_call_refused_while_traced_raises_the_eager_error_and_warns_nothing(case):
    """A compiled call that pyembed refuses while Dynamo traces it raises the eager call's
    error and nothing else: Dynamo runs the refused frame again eagerly, compiling each
    function it calls on its own, and one of those once read torch.func's interpreter
    stack, which Dynamo cannot trace -- a warning asking the user to report a PyTorch bug,
    printed before pyembed's error (a learned table's too-long sequence did that)."""
    _, build, exc, fragment = case
    weight, pos_weight = _tables()
    kwargs = build(weight, pos_weight)
    torch._dynamo.reset()
    compiled = torch.compile(pyembed.fused_embedding, backend="aot_eager")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(exc) as info:
            compiled(**kwargs)
    with pytest.raises(exc) as eager:
        pyembed.fused_embedding(**kwargs)
    assert str(info.value) == str(eager.value) and fragment in str(info.value)
    assert not caught, [str(w.message)[:200] for w in caught]


@pytest.mark.parametrize("ids, positions, max_seq_len", [
    ([[1, 10, 3]], None, -1), ([[-1, 2]], None, -1), ([[3]], None, -1), ([[12]], None, -1),
    ([[0, 1, 2]], [[0, 6, 1]], 6), ([[0, 1, 2]], [[0, -2, 1]], -1), ([[0, 1, 2]], [[0, 5, 1]], 6),
    ([[0]], [[0]], 1), ([[]], [[]], 3)])
def test_range_check_kernel_agrees_with_the_python_body(ids, positions, max_seq_len):
    """The op's C++ kernel (what a compiled graph on a CPU runs) and its Python body (what
    runs without the extension) accept and refuse the same inputs with the same message;
    the accepted ids come back as a copy."""
    from pyembed import checks

    ids = torch.tensor(ids, dtype=torch.long)
    positions = None if positions is None else torch.tensor(positions, dtype=torch.long)
    outcomes = []
    for run in (torch.ops.pyembed.check_ranges.default, checks._check_ranges_body):
        try:
            out = run(ids, V, positions, max_seq_len)
        except (IndexError, ValueError) as error:
            outcomes.append((IndexError if isinstance(error, IndexError) else ValueError, str(error)))
        else:
            assert torch.equal(out, ids) and (out.numel() == 0 or out.data_ptr() != ids.data_ptr())
            outcomes.append(None)
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_any_shape_without_positional_encoding(backend):
    weight = torch.randn(V, D)
    ids = torch.randint(0, V, (2, 3, 4))
    torch.testing.assert_close(pyembed.fused_embedding(ids, weight, backend=backend), weight[ids], rtol=0, atol=0)
    scalar = torch.tensor(4)
    torch.testing.assert_close(pyembed.fused_embedding(scalar, weight, backend=backend), weight[4], rtol=0, atol=0)


def test_max_norm_checks_ids_before_renormalising():
    emb = pyembed.FusedEmbedding(V, D, max_norm=0.1)
    before = emb.weight.detach().clone()
    with pytest.raises(IndexError, match="max id 10"):
        emb(torch.tensor([1, 10]))
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("sizes", [(1, None), (64, 3), (65, 64), (5000, 1), (0, 7), (300, 300)], ids=str)
def test_gpu_range_check_transfer_gives_each_tensors_extremes(sizes):
    # On a GPU the range check copies small tensors as they are and larger ones as their
    # device-side aminmax, in one transfer; run here on CPU tensors, the split back into
    # per-tensor extremes must equal torch's own min / max (int32 ids beside int64 positions).
    from pyembed.checks import transferred_bounds

    gen = torch.Generator().manual_seed(sum(s or 0 for s in sizes))
    n_ids, n_pos = sizes
    ids = torch.randint(-10**6, 10**6, (n_ids,), generator=gen, dtype=torch.int32)
    positions = None if n_pos is None else torch.randint(0, 2**40, (n_pos,), generator=gen)
    tensors = [ids if n_ids else None, positions]
    expected = [None if t is None else [int(t.min()), int(t.max())] for t in tensors]
    assert transferred_bounds(tensors) == expected


def test_validate_modes_choose_where_the_ranges_are_checked(monkeypatch):
    """True: in the kernel on a GPU backend's CUDA tensors (the record's address goes to
    the kernel, nothing runs before it), before the call everywhere else; "sync": before the
    call everywhere; False: nowhere; anything else: ValueError."""
    from pyembed import checks, dispatch
    from pyembed.functional import range_checks

    in_kernel = dispatch.Backend("gpu-like", None, None, None, lambda device: None, checks_in_kernel=True)
    host_only = dispatch.Backend("host-like", None, None, None, lambda device: None)
    monkeypatch.setattr(checks, "error_record_address", lambda device: 4096)  # no CUDA memory here
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert range_checks(True, in_kernel, cuda) == (False, 4096)
    assert range_checks(True, host_only, cuda) == (True, 0)
    assert range_checks(True, in_kernel, cpu) == (True, 0)
    assert range_checks("sync", in_kernel, cuda) == (True, 0)
    assert range_checks(False, in_kernel, cuda) == (False, 0)
    # A traced program outlives the process, and the record's address with it: in the call.
    seen = []

    def traced(x):
        seen.append(range_checks(True, in_kernel, cuda))
        return x + 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # "torch.jit.trace is deprecated"
        torch.jit.trace(traced, torch.zeros(1), check_trace=False)
    assert seen == [(True, 0)]
    for backend in CPU_BACKENDS:
        with pytest.raises(ValueError, match="validate must be True, False or 'sync', got 'yes'") as raised:
            pyembed.fused_embedding(torch.tensor([[1]]), torch.randn(V, D), validate="yes", backend=backend)
        assert isinstance(raised.value, RuntimeError)


def test_layer_construction_errors_are_also_runtime_errors():
    """As promised for every pyembed ValueError (DESIGN §3): nn.Embedding code catching
    RuntimeError keeps working."""
    cases = [lambda: pyembed.EmbeddingLayer(10, 7, pos_encoding="sinusoidal"),
             lambda: pyembed.EmbeddingLayer(10, 8, pos_encoding="rotary"),
             lambda: pyembed.EmbeddingLayer.from_modules(torch.nn.Embedding(10, 8), torch.nn.Embedding(6, 4)),
             lambda: pyembed.EmbeddingLayer(10, 8, dropout=1.5)]
    for make in cases:
        with pytest.raises(ValueError) as raised:
            make()
        assert isinstance(raised.value, RuntimeError), raised.value


def test_integer_tables_do_not_call_f_embedding(monkeypatch):
    """A program that routes F.embedding to pyembed (a test harness, a profiler) must not
    recurse through an integer table's lookup."""
    table = torch.arange(12).reshape(6, 2)
    ids = torch.tensor([[1, 5, 0]])

    def routed(input, weight, padding_idx=None, *args, **kwargs):
        return pyembed.fused_embedding(input, weight, padding_idx=padding_idx)

    expected = torch.nn.functional.embedding(ids, table)
    monkeypatch.setattr(torch.nn.functional, "embedding", routed)
    assert torch.equal(torch.nn.functional.embedding(ids, table), expected)
    assert torch.equal(pyembed.fused_embedding(ids, table, padding_idx=-1), table[ids])


def test_a_failure_of_the_cpp_fast_path_is_raised_as_it_is_not_retried(monkeypatch):
    # Out of memory, a CUDA error: not bad input. It reaches the caller unchanged, and the
    # Python checks do not run the call a second time (one path per call).
    if "cpu" not in CPU_BACKENDS:
        pytest.skip("the cpu backend is not built")
    from pyembed import checks, dispatch

    def out_of_memory(*args):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setitem(dispatch._registry, "cpu", dataclasses.replace(dispatch.get("cpu"), autograd_op=out_of_memory))
    monkeypatch.setattr(dispatch, "_resolved", {})
    monkeypatch.setattr(checks, "check_inputs", lambda *a: pytest.fail("the slow path ran"))
    weight, _ = _tables()
    with pytest.raises(RuntimeError, match="not enough memory") as info:
        pyembed.fused_embedding(torch.tensor([1, 2]), weight, backend="cpu")
    assert type(info.value) is RuntimeError
