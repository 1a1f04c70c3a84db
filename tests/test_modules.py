"""The drop-in modules against nn.Embedding and against closed forms."""

import copy
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn.utils import prune

import pyembed
from helpers import CPU_BACKENDS, assert_within, eager_embedding, run_with_grads, sinusoid_atol


# --------------------------------------------------------------------------- FusedEmbedding
def test_fused_embedding_is_an_nn_embedding_with_the_same_init_and_state_dict():
    torch.manual_seed(0)
    ref = nn.Embedding(50, 16, padding_idx=-2)
    torch.manual_seed(0)
    ours = pyembed.FusedEmbedding(50, 16, padding_idx=-2)
    assert isinstance(ours, nn.Embedding)
    assert (ours.num_embeddings, ours.embedding_dim, ours.padding_idx) == (50, 16, 48)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)  # N(0, 1), padding row zeroed
    assert torch.all(ours.weight[48] == 0)
    assert list(ours.state_dict()) == ["weight"]
    ref.load_state_dict(ours.state_dict())
    ours.load_state_dict(ref.state_dict())
    assert "padding_idx=48" in repr(ours)
    assert "scale=2" in repr(pyembed.FusedEmbedding(5, 4, scale=2.0, backend="reference"))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("sparse", [False, True])
def test_fused_embedding_matches_nn_embedding_forward_and_backward(backend, sparse):
    torch.manual_seed(1)
    by_freq = not sparse  # nn.Embedding refuses scale_grad_by_freq with sparse gradients
    ref = nn.Embedding(30, 12, padding_idx=3, scale_grad_by_freq=by_freq, sparse=sparse)
    ours = pyembed.FusedEmbedding(30, 12, padding_idx=3, scale_grad_by_freq=by_freq, sparse=sparse, backend=backend)
    ours.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 30, (4, 9))
    ids[0, 0] = 3
    dout = torch.randn(4, 9, 12)
    ref(ids).backward(dout)
    out = ours(ids)
    out.backward(dout)
    torch.testing.assert_close(out, ref(ids), rtol=0, atol=0)
    assert ours.weight.grad.is_sparse == sparse
    torch.testing.assert_close(ours.weight.grad.to_dense(), ref.weight.grad.to_dense(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_max_norm_renormalises_like_nn_embedding(backend):
    torch.manual_seed(2)
    ref = nn.Embedding(20, 6, max_norm=1.0, norm_type=1.5)
    ours = pyembed.FusedEmbedding(20, 6, max_norm=1.0, norm_type=1.5, backend=backend)
    ours.load_state_dict(ref.state_dict())
    ids = torch.tensor([[1, 2, 2, 7], [7, 0, 19, 1]])
    torch.testing.assert_close(ours(ids), ref(ids), rtol=0, atol=0)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)  # same rows renormed in place
    assert torch.linalg.vector_norm(ours.weight[ids.unique()], ord=1.5, dim=1).max() <= 1.0 + 1e-6
    assert torch.linalg.vector_norm(ours.weight[3], ord=1.5) > 1.0  # untouched rows untouched


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_max_norm_compiles_fullgraph_like_nn_embedding(backend):
    # nn.Embedding(max_norm=...) compiles with fullgraph=True; the renorm's range check read
    # the ids' values while Dynamo traced (a data-dependent guard) and failed the compile.
    # Compiled: the same output, gradient and renormed table as compiled nn.Embedding, and
    # an out-of-range id still raises, with nothing renormed.
    torch.manual_seed(2)
    ref = nn.Embedding(20, 6, max_norm=1.0, norm_type=1.5, padding_idx=-2)
    ours = pyembed.FusedEmbedding(20, 6, max_norm=1.0, norm_type=1.5, padding_idx=-2, backend=backend)
    ours.load_state_dict(ref.state_dict())
    ids = torch.tensor([[1, 2, 2, 7], [7, 18, 19, 1]])
    torch._dynamo.reset()
    got, want = torch.compile(ours, fullgraph=True)(ids), torch.compile(ref, fullgraph=True)(ids)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.pow(2).sum().backward()
    want.pow(2).sum().backward()
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.weight, ref.weight, rtol=0, atol=0)
    before = ours.weight.detach().clone()
    with pytest.raises(IndexError, match="V=20"):
        torch.compile(ours, fullgraph=True)(torch.tensor([[3, 20]]))
    torch.testing.assert_close(ours.weight, before, rtol=0, atol=0)
    torch._dynamo.reset()


def test_from_pretrained_freezes_and_shares():
    table = torch.randn(7, 4)
    frozen = pyembed.FusedEmbedding.from_pretrained(table, padding_idx=0, scale=3.0)
    assert not frozen.weight.requires_grad and frozen.padding_idx == 0
    torch.testing.assert_close(frozen(torch.tensor([2, 5])), table[[2, 5]] * 3.0, rtol=0, atol=0)
    trainable = pyembed.FusedEmbedding.from_pretrained(table, freeze=False)
    assert trainable.weight.requires_grad and trainable.weight.data_ptr() == table.data_ptr()


# --------------------------------------------------------------------------- EmbeddingLayer
def test_embedding_layer_attributes_and_init():
    torch.manual_seed(3)
    layer = pyembed.EmbeddingLayer(1000, 64, max_seq_len=256, padding_idx=0)
    assert layer.token_embedding.weight.shape == (1000, 64)
    assert layer.pos_embedding.shape == (256, 64) and isinstance(layer.pos_embedding, nn.Parameter)
    assert torch.all(layer.token_embedding.weight[0] == 0)
    assert abs(layer.token_embedding.weight.std().item() - 1.0) < 0.05  # N(0, 1), as nn.Embedding
    assert abs(layer.pos_embedding.std().item() - 0.02) < 0.002
    assert set(dict(layer.named_parameters())) == {"token_embedding.weight", "pos_embedding"}
    sinus = pyembed.EmbeddingLayer(100, 32, pos_encoding="sinusoidal")
    assert sinus.pos_embedding is None and set(dict(sinus.named_parameters())) == {"token_embedding.weight"}
    with pytest.raises(ValueError, match="d=7"):
        pyembed.EmbeddingLayer(10, 7, pos_encoding="sinusoidal")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("pos_encoding", [None, "learned", "sinusoidal"])
def test_embedding_layer_matches_the_unfused_seed_code(backend, pos_encoding):
    torch.manual_seed(4)
    layer = pyembed.EmbeddingLayer(300, 48, 64, pos_encoding=pos_encoding, scale_embeddings=True, backend=backend)
    ids = torch.randint(0, 300, (3, 40))
    dout = torch.randn(3, 40, 48)
    weight = layer.token_embedding.weight
    for offset in (0, 24):
        kwargs = dict(pos_encoding=pos_encoding, scale=math.sqrt(48), offset=offset)
        out, dw, dp = run_with_grads(lambda i, w, p, **kw: pyembed.fused_embedding(i, w, p, backend=backend, **kw),
                                     ids, weight, layer.pos_embedding, dout, **kwargs)
        layer.zero_grad()
        got = layer(ids, offset=offset)
        got.backward(dout)
        torch.testing.assert_close(got, out, rtol=0, atol=0)
        torch.testing.assert_close(weight.grad, dw, rtol=0, atol=0)
        eager = eager_embedding(ids, weight, layer.pos_embedding, **kwargs)
        atol = 1e-6 + (sinusoid_atol(ids, offset=offset) if pos_encoding == "sinusoidal" else 0)
        assert_within(got, eager, atol, 1e-6, what="layer vs eager")


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_embedding_layer_single_sequence_position_ids_and_dropout(backend):
    torch.manual_seed(5)
    layer = pyembed.EmbeddingLayer(50, 16, 32, dropout=0.5, backend=backend).eval()  # eval: dropout off
    ids = torch.randint(0, 50, (10,))
    single = layer(ids)
    assert single.shape == (10, 16)
    torch.testing.assert_close(single, layer(ids[None])[0], rtol=0, atol=0)
    position_ids = torch.arange(5, 15)
    torch.testing.assert_close(layer(ids, position_ids=position_ids), layer(ids, offset=5), rtol=0, atol=0)
    layer.train()
    dropped = layer(ids[None])
    assert 0.2 < (dropped == 0).float().mean().item() < 0.8


def test_sinusoidal_layer_accepts_any_length():
    layer = pyembed.EmbeddingLayer(10, 8, max_seq_len=4, pos_encoding="sinusoidal")
    assert layer(torch.zeros(1, 600, dtype=torch.long)).shape == (1, 600, 8)


# --------------------------------------------------------------------------- sinusoid
def _closed_form(positions, dim):
    """PE(p, 2i) = sin(p w_i), PE(p, 2i+1) = cos(p w_i), w_i = 10000^(-2i/d), in numpy float64."""
    p = np.asarray(positions, dtype=np.float64)[:, None]
    w = 10000.0 ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    table = np.empty((p.shape[0], dim))
    table[:, 0::2], table[:, 1::2] = np.sin(p * w), np.cos(p * w)
    return torch.from_numpy(table)


def test_sinusoidal_table_is_the_closed_form():
    table = pyembed.sinusoidal_table(5001, 64, dtype=torch.float64)
    torch.testing.assert_close(table, _closed_form(range(5001), 64), rtol=0, atol=1e-12)
    assert torch.equal(table[0], torch.tensor([0.0, 1.0] * 32, dtype=torch.float64))
    assert pyembed.sinusoidal_table(3, 10).dtype == torch.float32
    with pytest.raises(ValueError, match="even"):
        pyembed.sinusoidal_table(3, 9)
    assert pyembed.sinusoidal_table(0, 4).shape == (0, 4) and pyembed.sinusoidal_table(3, 0).shape == (3, 0)
    for length, dim in ((-1, 4), (3, -2)):
        with pytest.raises(ValueError, match=">= 0"):  # not torch.arange's message
            pyembed.sinusoidal_table(length, dim)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_fused_sinusoid_values_up_to_position_5000(backend, dtype):
    dim = 96
    position_ids = torch.tensor([[0, 1, 2, 7, 100, 511, 512, 1000, 2047, 4095, 4999, 5000]])
    ids = torch.zeros_like(position_ids)
    zero_table = torch.zeros(1, dim, dtype=dtype)
    out = pyembed.fused_embedding(ids, zero_table, pos_encoding="sinusoidal", position_ids=position_ids, backend=backend)
    exact = _closed_form(position_ids[0].tolist(), dim)[None]
    atol = sinusoid_atol(ids, position_ids=position_ids) if dtype == torch.float32 else 1e-12
    assert_within(out, exact, atol, what=f"{backend} sinusoid")


# --------------------------------------------------------------------------- replace_embeddings
class TinyLM(nn.Module):
    def __init__(self, vocab=64, dim=32, max_len=16):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim, padding_idx=0)
        self.pos = nn.Embedding(max_len, dim)
        layer = nn.TransformerEncoderLayer(dim, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input/output embeddings

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.head(self.encoder(x))


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_replace_embeddings_gives_identical_outputs_and_gradients(backend):
    torch.manual_seed(6)
    model = TinyLM()
    swapped = TinyLM()
    swapped.load_state_dict(model.state_dict())
    tok_param = swapped.tok.weight
    assert pyembed.replace_embeddings(swapped, backend=backend) is swapped
    assert type(swapped.tok) is pyembed.FusedEmbedding and type(swapped.pos) is pyembed.FusedEmbedding
    assert swapped.tok.weight is tok_param and swapped.head.weight is swapped.tok.weight  # still tied
    assert swapped.tok.padding_idx == 0
    assert list(swapped.state_dict()) == list(model.state_dict())

    ids = torch.randint(0, 64, (3, 16))
    for m in (model, swapped):
        m(ids).pow(2).mean().backward()
    torch.testing.assert_close(swapped(ids), model(ids), rtol=0, atol=0)
    for (name, a), (_, b) in zip(model.named_parameters(), swapped.named_parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.filterwarnings("ignore:Full backward hook is firing")  # (ids need no gradient: as nn.Embedding's)
def test_replace_embeddings_keeps_the_hooks_registered_on_a_swapped_module(backend):
    """Hooks registered on an nn.Embedding before the swap (Hugging Face's
    enable_input_require_grads puts a forward hook on the input embeddings) run on its
    FusedEmbedding as on the unswapped model -- what they see and return, in their order --
    and the caller's handles remove them from it. Before, the swap dropped them."""
    torch.manual_seed(9)
    models = [TinyLM(), TinyLM()]
    models[1].load_state_dict(models[0].state_dict())
    ids = torch.randint(0, 64, (2, 16))
    seen = [[], []]

    def register(model, log):
        def doubled(module, args, kwargs, out):
            log.append(("fwd", kwargs))
            return out * 2

        return [model.tok.register_forward_pre_hook(lambda m, args: log.append(("pre", args[0].sum().item()))),
                model.tok.register_forward_hook(doubled, with_kwargs=True),
                model.tok.register_full_backward_hook(lambda m, gin, gout: log.append(("bwd", gout[0].sum().item()))),
                model.pos.register_forward_hook(lambda m, args, out: log.append(("pos", out.sum().item()))),
                model.tok.register_state_dict_post_hook(lambda m, state, prefix, meta: log.append(("state", prefix)))]

    handles = [register(model, log) for model, log in zip(models, seen)]
    pyembed.replace_embeddings(models[1], backend=backend)
    assert type(models[1].tok) is pyembed.FusedEmbedding
    for model in models:
        model(ids).sum().backward()
        model.state_dict()
    assert seen[1] == seen[0] and [entry[0] for entry in seen[0]] == ["pre", "fwd", "pos", "bwd", "state"]
    torch.testing.assert_close(models[1].tok.weight.grad, models[0].tok.weight.grad)  # the hook's x2 in both
    for k, model in enumerate(models):
        for handle in handles[k]:
            handle.remove()
        seen[k].clear()
        model(ids).sum().backward()
    assert seen == [[], []]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("method", ["prune", "spectral_norm"])
def test_replace_embeddings_swaps_a_table_computed_by_a_pre_hook(backend, method):
    """torch.nn.utils.prune (and the hook-based spectral_norm) turn `weight` into a plain
    attribute that a forward pre-hook computes from parameters and buffers of other names
    (weight_orig, weight_mask / weight_u ...). Swapped, the module keeps them and the hook:
    state_dict keys, outputs and gradients as the unswapped model's, over two training calls
    (spectral_norm updates its buffers in each); `prune.remove` works on it. Before, the swap
    raised TypeError (the computed weight is no Parameter)."""
    def build():
        torch.manual_seed(10)
        model = nn.Sequential(nn.Embedding(20, 8, padding_idx=0))
        if method == "prune":
            prune.l1_unstructured(model[0], "weight", amount=0.5)
        else:
            nn.utils.spectral_norm(model[0], "weight")
        return model

    model, swapped = build(), build()
    pyembed.replace_embeddings(swapped, backend=backend)
    assert type(swapped[0]) is pyembed.FusedEmbedding and list(swapped.state_dict()) == list(model.state_dict())
    ids = torch.randint(0, 20, (3, 6))
    for _ in range(2):
        outs = [m(ids) for m in (model, swapped)]
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=0)
        for out in outs:
            out.pow(2).sum().backward()
        for a, b in zip(model.parameters(), swapped.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-6, atol=1e-6)
    if method == "prune":
        for m in (model, swapped):
            prune.remove(m[0], "weight")
        assert isinstance(swapped[0].weight, nn.Parameter) and list(swapped.state_dict()) == ["0.weight"]
        torch.testing.assert_close(swapped(ids), model(ids), rtol=0, atol=0)


class _Scaled(nn.Embedding):  # Hugging Face's form (Bart's)
    def __init__(self, vocab, dim, embed_scale):
        super().__init__(vocab, dim, padding_idx=1)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale


class _ScaledInDtype(nn.Embedding):  # Gemma's: the scale a buffer, cast to the table's dtype
    def __init__(self, vocab, dim, embed_scale):
        super().__init__(vocab, dim, padding_idx=1)
        self.scalar_embed_scale = embed_scale
        self.embed_scale = nn.Buffer(torch.tensor(embed_scale), persistent=False)

    def forward(self, input_ids):
        return super().forward(input_ids) * self.embed_scale.to(self.weight.dtype)


# A forward that does more than scale (T5Gemma2's writes a row). A class of nn.Embedding's own,
# not _Scaled's: the rule then reads its forward's source, not only its base.
class _ScaledAndMore(nn.Embedding):
    def __init__(self, vocab, dim, embed_scale):
        super().__init__(vocab, dim, padding_idx=1)
        self.embed_scale = embed_scale

    def forward(self, input_ids):
        out = super().forward(input_ids) * self.embed_scale
        return out + 1


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_replace_embeddings_fuses_scaled_word_embeddings_and_leaves_other_subclasses(backend, dtype):
    """An nn.Embedding subclass whose forward is exactly `super().forward(input_ids) *
    self.embed_scale` (with or without `.to(self.weight.dtype)`) is swapped, its scale in the
    fused op: the same output bit for bit, the same Parameter; one whose forward does more is
    not (its class, base and source are all the rule reads)."""
    torch.manual_seed(8)
    model = nn.ModuleDict({"bart": _Scaled(40, 16, 32 ** 0.5), "gemma": _ScaledInDtype(40, 16, 48 ** 0.5),
                           "other": _ScaledAndMore(40, 16, 4.0)}).to(dtype)
    ids = torch.randint(0, 40, (3, 7))
    want = {name: m(ids) for name, m in model.items()}
    weights = {name: m.weight for name, m in model.items()}
    pyembed.replace_embeddings(model, backend=backend)
    assert [type(m).__name__ for m in model.values()] == ["FusedEmbedding", "ScaledWordEmbedding", "_ScaledAndMore"]
    for name, m in model.items():
        assert m.weight is weights[name] and m.padding_idx == 1
        torch.testing.assert_close(m(ids), want[name], rtol=0, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_from_modules_fuses_a_models_own_tables(backend):
    torch.manual_seed(7)
    wte, wpe = nn.Embedding(100, 32), nn.Embedding(64, 32)
    layer = pyembed.EmbeddingLayer.from_modules(wte, wpe, scale=2.0, backend=backend)
    assert layer.token_embedding.weight is wte.weight and layer.pos_embedding is wpe.weight  # shared, not copied
    ids = torch.randint(0, 100, (3, 20))
    dout = torch.randn(3, 20, 32)
    out = layer(ids, offset=5)
    out.backward(dout)
    grads = wte.weight.grad.clone(), wpe.weight.grad.clone()
    wte.zero_grad(), wpe.zero_grad()
    expected = wte(ids) * 2.0 + wpe(torch.arange(5, 25))
    expected.backward(dout)
    assert_within(out, expected.detach(), 1e-6, 1e-6, what="from_modules forward")
    torch.testing.assert_close(grads[0], wte.weight.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grads[1], wpe.weight.grad, rtol=1e-6, atol=1e-6)
    token_only = pyembed.EmbeddingLayer.from_modules(wte, backend=backend)
    assert token_only.pos_embedding is None
    torch.testing.assert_close(token_only(ids), wte(ids), rtol=0, atol=0)
    with pytest.raises(ValueError, match="dimension mismatch"):
        pyembed.EmbeddingLayer.from_modules(wte, nn.Embedding(8, 16))
    # The modules stay in their model (unlike replace_embeddings' swap): their hooks stay
    # theirs alone, and a table a pre-hook computes (pruning) is refused, not read once.
    calls = []
    wte.register_forward_hook(lambda m, args, out: calls.append("wte"))
    layer = pyembed.EmbeddingLayer.from_modules(wte, wpe, backend=backend)
    layer(ids), wte(ids)
    assert calls == ["wte"] and not layer.token_embedding._forward_hooks
    prune.l1_unstructured(wte, "weight", amount=0.5)
    with pytest.raises(TypeError, match="parameter 'weight'"):
        pyembed.EmbeddingLayer.from_modules(wte, wpe, backend=backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("token_kind", ["max_norm", "fused scale", "bart", "gemma"])
def test_from_modules_computes_what_the_token_module_does(backend, token_kind):
    """from_modules promises token(ids) * scale + position(positions) for the token lookups
    pyembed knows: a max_norm renormalises the rows a call looks up (the table changes as
    token(ids) changes it), a FusedEmbedding's or a Hugging Face scaled word embedding's
    scale multiplies the layer's. Both were dropped (the rows unrenormalised, unscaled)."""
    torch.manual_seed(5)
    token = {"max_norm": lambda: nn.Embedding(30, 8, max_norm=1.0, norm_type=1.5, padding_idx=2),
             "fused scale": lambda: pyembed.FusedEmbedding(30, 8, scale=1.5, backend=backend),
             "bart": lambda: _Scaled(30, 8, 8 ** 0.5), "gemma": lambda: _ScaledInDtype(30, 8, 7 ** 0.5)}[token_kind]()
    position = nn.Embedding(16, 8)
    with torch.no_grad():
        token.weight.mul_(3.0)  # rows past max_norm
    twin, twin_position = copy.deepcopy(token), copy.deepcopy(position)
    before = token.weight.detach().clone()
    layer = pyembed.EmbeddingLayer.from_modules(token, position, scale=2.0, backend=backend)
    ids = torch.randint(0, 30, (3, 7))
    ids[0, :3] = 2  # the padding row, repeated
    dout = torch.randn(3, 7, 8)
    out = layer(ids, offset=4)
    out.backward(dout)
    want = twin(ids) * 2.0 + twin_position(torch.arange(4, 11))
    want.backward(dout)
    assert_within(out, want.detach(), 1e-6, 1e-6, what=f"from_modules forward, {token_kind} token")
    torch.testing.assert_close(token.weight, twin.weight, rtol=1e-6, atol=1e-7)  # renormalised alike
    assert torch.equal(token.weight, before) == (token_kind != "max_norm")  # (so the renorm was exercised)
    for ours, theirs in ((token, twin), (position, twin_position)):
        torch.testing.assert_close(ours.weight.grad, theirs.weight.grad, rtol=1e-6, atol=1e-6)


class _Offset(nn.Embedding):  # OPT's learned positions: the ids moved by 2 before the lookup
    def forward(self, positions):
        return super().forward(positions + 2)


@pytest.mark.parametrize("position, refused", [
    (lambda: nn.Embedding(16, 8, padding_idx=1), "padding_idx=1"),  # RoBERTa's position table
    (lambda: nn.Embedding(16, 8, max_norm=1.0), "max_norm=1.0"),
    (lambda: nn.Embedding(16, 8, scale_grad_by_freq=True), "scale_grad_by_freq=True"),
    (lambda: pyembed.FusedEmbedding(16, 8, scale=2.0), "scale=2.0"),
    (lambda: _Offset(18, 8), "_Offset, whose forward is not a plain table lookup"),
    (lambda: _Scaled(16, 8, 2.0), "_Scaled, whose forward"),
], ids=["padding_idx", "max_norm", "scale_grad_by_freq", "scale", "its own forward", "a scaled form"])
def test_from_modules_refuses_a_position_module_the_fused_term_cannot_follow(position, refused):
    """The fused positional term adds the rows as they are and trains every one it uses: a
    position module that does more -- a padding row without gradient, a renorm, a frequency
    scale, a scale, a forward of its own -- is refused, naming it (each was dropped silently)."""
    token = nn.Embedding(30, 8)
    with pytest.raises((ValueError, TypeError), match=refused):
        pyembed.EmbeddingLayer.from_modules(token, position())
    with pytest.raises(TypeError, match="_ScaledAndMore, whose forward is not a plain table lookup"):
        pyembed.EmbeddingLayer.from_modules(_ScaledAndMore(30, 8, 2.0))


@pytest.mark.parametrize("pos_encoding", [None, "learned", "sinusoidal"])
@pytest.mark.parametrize("backend", ["auto", *CPU_BACKENDS])
def test_a_layer_built_on_the_meta_device_runs_there_and_initialises_like_one_built_on_the_cpu(backend, pos_encoding):
    # FSDP / torchtitan-style initialisation: build on meta, where the forward and the dense
    # backward give shapes only (no values to check), as nn.Embedding's do; then to_empty and
    # reset_parameters (which FSDP calls on every module owning parameters) draw the
    # constructor's initialisation.
    torch.manual_seed(3)
    on_cpu = pyembed.EmbeddingLayer(50, 8, 16, pos_encoding=pos_encoding, padding_idx=2, backend=backend)
    with torch.device("meta"):
        on_meta = pyembed.EmbeddingLayer(50, 8, 16, pos_encoding=pos_encoding, padding_idx=2, backend=backend)
        ids = torch.randint(0, 50, (2, 16))
        expected = nn.Embedding(50, 8, padding_idx=2)(ids)
    out = on_meta(ids)
    out.sum().backward()
    assert (out.shape, out.dtype, out.device) == (expected.shape, expected.dtype, expected.device)
    for p in on_meta.parameters():
        assert (p.grad.shape, p.grad.device) == (p.shape, p.device)
    on_meta.to_empty(device="cpu")
    torch.manual_seed(3)
    on_meta.reset_parameters()
    for (name, ours), (_, theirs) in zip(on_cpu.named_parameters(), on_meta.named_parameters(), strict=True):
        assert torch.equal(ours, theirs), name
