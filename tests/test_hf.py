"""replace_embeddings on Hugging Face models built from small configs (nothing is
downloaded): identical logits and gradients, tied embeddings stay tied, and
save_pretrained / from_pretrained round-trips into FusedEmbedding."""

import copy

import pytest
import torch
from torch import nn
from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                          LlamaForCausalLM)

import pyembed
from helpers import CPU_BACKENDS

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

    ids = torch.randint(0, 128, (2, 16))
    logits = _assert_same_logits_and_grads(swapped, model, ids)

    swapped.save_pretrained(tmp_path)
    reloaded = pyembed.replace_embeddings(type(model).from_pretrained(tmp_path).eval(), backend=backend)
    assert type(reloaded.get_input_embeddings()) is pyembed.FusedEmbedding
    torch.testing.assert_close(reloaded(input_ids=ids).logits, logits, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_generate_and_resize_token_embeddings_as_the_unswapped_model(name, backend):
    # What users do next with a swapped model: greedy generate() (the prompt, then a token at a
    # time through the KV cache: GPT-2's positions come from its step's offset), and
    # resize_token_embeddings for new tokens, which must keep pyembed's module and the tie;
    # the unswapped model, resized and given the same tables, is the expectation.
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    swapped = pyembed.replace_embeddings(copy.deepcopy(model), backend=backend)
    prompt = torch.randint(0, 128, (2, 5))
    greedy = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(swapped.generate(prompt, **greedy), model.generate(prompt, **greedy))

    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    for m in (swapped, model):
        m.resize_token_embeddings(140, mean_resizing=False)
    assert type(swapped.get_input_embeddings()) is pyembed.FusedEmbedding
    assert swapped.get_input_embeddings().weight.shape == (140, 32)
    assert (swapped.get_output_embeddings().weight is swapped.get_input_embeddings().weight) == tied
    model.load_state_dict(swapped.state_dict())  # the new rows were drawn apart
    ids = torch.randint(0, 140, (2, 16))
    ids[0, :4] = torch.arange(136, 140)  # new tokens among them
    _assert_same_logits_and_grads(swapped, model, ids)
