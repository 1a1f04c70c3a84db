"""replace_embeddings on Hugging Face models built from small configs (nothing is
downloaded): identical logits and gradients, tied embeddings stay tied, and
save_pretrained / from_pretrained round-trips into FusedEmbedding."""

import copy

import pytest
import torch
import transformers
from torch import nn
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

import pyembed
from helpers import CPU_BACKENDS, RowQuantized

MODELS = {
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2)),
    "bert": lambda: BertForMaskedLM(BertConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2,
                                               num_attention_heads=2, intermediate_size=64,
                                               max_position_embeddings=32)),
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=2,
                                                  num_key_value_heads=2, max_position_embeddings=32)),
}


def _loss_and_grads(model, ids):
    model.zero_grad()
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_logits_and_grads(swapped, model, ids):
    """The swapped model's logits and every parameter's gradient equal the model's; its logits."""
    logits, grads = _loss_and_grads(model, ids)
    swapped_logits, swapped_grads = _loss_and_grads(swapped, ids)
    torch.testing.assert_close(swapped_logits, logits, rtol=1e-6, atol=1e-6)
    assert swapped_grads.keys() == grads.keys()
    for key in grads:
        torch.testing.assert_close(swapped_grads[key], grads[key], rtol=1e-5, atol=1e-6, msg=key)
    return logits


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_replace_embeddings_in_hf_models(name, backend, tmp_path):
    torch.manual_seed(0)
    model = MODELS[name]().eval()  # eval: no dropout, so both runs are deterministic
    swapped = pyembed.replace_embeddings(copy.deepcopy(model), backend=backend)
    embeddings = [m for m in swapped.modules() if isinstance(m, nn.Embedding)]
    assert embeddings and all(type(m) is pyembed.FusedEmbedding for m in embeddings)
    assert isinstance(swapped.get_input_embeddings(), nn.Embedding)
    if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
        assert swapped.get_output_embeddings().weight is swapped.get_input_embeddings().weight  # still tied

    # Hugging Face's init_weights (what post_init runs, and a composite model's built around
    # this one) skips each module it has initialised, by a mark on the module: the swapped
    # modules keep the mark, so their tables too (they were drawn afresh).
    tables = {name: p.detach().clone() for name, p in swapped.named_parameters()}
    swapped.init_weights()
    assert all(torch.equal(p, tables[name]) for name, p in swapped.named_parameters())

    ids = torch.randint(0, 128, (2, 16))
    logits = _assert_same_logits_and_grads(swapped, model, ids)

    swapped.save_pretrained(tmp_path)
    reloaded = pyembed.replace_embeddings(type(model).from_pretrained(tmp_path).eval(), backend=backend)
    assert type(reloaded.get_input_embeddings()) is pyembed.FusedEmbedding
    torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma3"])
def test_generate_and_resize_token_embeddings_as_the_unswapped_model(name, backend):
    # What users do next with a swapped model: greedy generate() (the prompt, then a token at a
    # time through the KV cache: GPT-2's positions come from its step's offset), and
    # resize_token_embeddings for new tokens, which must keep pyembed's module and the tie;
    # the unswapped model, resized and given the same tables, is the expectation. (Gemma 3:
    # its scaled word embedding swapped for a ScaledWordEmbedding.)
    if name not in {**MODELS, **_scaled_models()}:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    torch.manual_seed(0)
    model = {**MODELS, **_scaled_models(dim=32)}[name]().eval()
    swapped = pyembed.replace_embeddings(copy.deepcopy(model), backend=backend)
    swapped_type = type(swapped.get_input_embeddings())
    assert issubclass(swapped_type, pyembed.FusedEmbedding)
    prompt = torch.randint(0, 128, (2, 5))
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(swapped.generate(prompt, **greedy), model.generate(prompt, **greedy))

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for m in (swapped, model):
        m.resize_token_embeddings(140, mean_resizing=False)
    assert type(swapped.get_input_embeddings()) is swapped_type
    assert swapped.get_input_embeddings().weight.shape == (140, 32)
    assert (swapped.get_output_embeddings().weight is swapped.get_input_embeddings().weight) == tied
    model.load_state_dict(swapped.state_dict())  # the new rows were drawn apart
    ids = torch.randint(0, 140, (2, 16))
    ids[0, :4] = torch.arange(136, 140)  # new tokens among them
    _assert_same_logits_and_grads(swapped, model, ids)


def _scaled_models(dim: int = 48):
    """Small Hugging Face models whose token embedding is a scaled word embedding: Gemma 3's
    (the scale cast to the table's dtype; d=48: sqrt(d) rounds apart in bfloat16), Bart's (a
    float scale); those this transformers has."""
    models = {}
    if hasattr(transformers, "Gemma3ForCausalLM"):
        models["gemma3"] = lambda: transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
            vocab_size=128, hidden_size=dim, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=dim // 2, max_position_embeddings=64, sliding_window=16))
    models["bart"] = lambda: transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=128, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        scale_embedding=True))
    return models


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", sorted(_scaled_models()))
def test_replace_embeddings_fuses_hf_scaled_word_embeddings(name, backend):
    """The lookup * sqrt(d) of Gemma's and Bart's scaled word embeddings, fused: the swapped
    model's embeddings are bit for bit the model's, in float32 and in bfloat16 (a model cast
    after the swap too: Gemma's scale is rounded to the table's dtype at each call, as its
    cast rounds it), logits equal; the token table's bfloat16 gradient, summed in float32 and
    rounded once, is within the unswapped model's error of the exact one. A subclass whose
    forward does more (Bart's learned positions) is left alone."""
    torch.manual_seed(0)
    model = _scaled_models()[name]().eval()
    swapped = pyembed.replace_embeddings(copy.deepcopy(model), backend=backend)
    assert type(swapped.get_input_embeddings()).__name__ == ("ScaledWordEmbedding" if name == "gemma3"
                                                              else "FusedEmbedding")
    assert {type(m).__name__ for m in swapped.modules() if "Positional" in type(m).__name__} == \
        {type(m).__name__ for m in model.modules() if "Positional" in type(m).__name__}
    ids = torch.randint(0, 128, (2, 12))
    extra = dict(decoder_input_ids=ids) if name == "bart" else {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype), swapped.to(dtype)
        embeddings = [m.get_input_embeddings()(ids) for m in (model, swapped)]
        torch.testing.assert_close(embeddings[1], embeddings[0], rtol=0, atol=0)
        logits = [m(input_ids=ids, **extra).logits for m in (model, swapped)]
        torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)

    dout = torch.randn(2, 12, model.get_input_embeddings().embedding_dim, dtype=torch.bfloat16)
    scale = swapped.get_input_embeddings().scale  # the bfloat16 scale (Gemma's rounded, Bart's as given)
    exact = torch.zeros(128, dout.shape[-1], dtype=torch.float64).index_add_(
        0, ids.reshape(-1), dout.reshape(-1, dout.shape[-1]).double()) * scale
    exact[model.get_input_embeddings().padding_idx] = 0
    errors = []
    for m in (model, swapped):
        table = m.get_input_embeddings()
        table.weight.grad = None
        table(ids).backward(dout)
        errors.append((table.weight.grad.double() - exact).abs().max().item())
    assert errors[1] <= errors[0], errors


def _logits_unswapped_and_swapped(name: str, backend: str, prepare):
    """The logits of a small model (GPT-2, or one of _scaled_models) made ready by
    ``prepare(copy_of_the_model, swap)`` -> the model to run, unswapped and then swapped by
    replace_embeddings after prepare; and the swapped model."""
    torch.manual_seed(0)
    model = (MODELS if name == "gpt2" else _scaled_models())[name]().eval()
    ids = torch.randint(0, 128, (2, 12))
    extra = dict(decoder_input_ids=ids) if name == "bart" else {}
    logits = []
    for swap in (False, True):
        ready = prepare(copy.deepcopy(model), swap)
        if swap:
            pyembed.replace_embeddings(ready, backend=backend)
            assert isinstance(ready.get_input_embeddings(), pyembed.FusedEmbedding)
        with torch.no_grad():
            logits.append(ready(input_ids=ids, **extra).logits)
    return logits, ready


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["gpt2"] + sorted(_scaled_models()))
@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_a_model_offloaded_by_accelerate_then_swapped_runs_as_before(name, backend, offload, tmp_path):
    """A model too big for the device is offloaded by accelerate (``cpu_offload`` /
    ``disk_offload``, what ``from_pretrained(device_map=...)`` does past its memory): each
    module's weights wait on the meta device and a hook of accelerate's, wrapping its forward,
    brings them in for the call. Swapped after that, the FusedEmbedding carries the hook: the
    logits of the offloaded unswapped model, bit for bit (before, its weight stayed on the
    meta device: "ids is on cpu but weight is on meta"). GPT-2's table is tied to its head."""
    accelerate = pytest.importorskip("accelerate")

    def offloaded(model, swap):
        if offload == "cpu":
            model = accelerate.cpu_offload(model, execution_device=torch.device("cpu"))
        else:
            model = accelerate.disk_offload(model, tmp_path / f"swap{swap}", execution_device=torch.device("cpu"))
        assert model.get_input_embeddings().weight.device.type == "meta"
        return model

    logits, _ = _logits_unswapped_and_swapped(name, backend, offloaded)
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["gpt2"] + sorted(_scaled_models()))
def test_a_model_whose_embedding_is_quantized_then_swapped_runs_as_before(name, backend):
    """A model whose input embedding was quantized (torchao's quantize_ with an embedding
    filter gives it a weight-only quantized tensor subclass; here tests/helpers.py's
    RowQuantized), then swapped -- into a FusedEmbedding, or Gemma's into a
    ScaledWordEmbedding, its scale in the call --: the quantized model's logits, bit for bit
    (with torchao 0.18 by hand too: Gemma 3, int8 group-32, either order)."""
    def quantized(model, swap):
        table = model.get_input_embeddings().weight
        weight = nn.Parameter(RowQuantized.quantize(table.detach()), requires_grad=False)
        for module in model.modules():  # every module on that table (Bart's encoder and decoder)
            if isinstance(module, nn.Embedding) and module.weight is table:
                module.weight = weight
        return model

    logits, swapped = _logits_unswapped_and_swapped(name, backend, quantized)
    assert type(swapped.get_input_embeddings().weight) is RowQuantized
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=0)
