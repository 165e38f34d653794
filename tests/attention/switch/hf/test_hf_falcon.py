"""Falcon in each of its configurations (ALiBi or rotary; multi-query, grouped (new_decoder_architecture) or one
key/value head per query head) against the tests' own reference, which follows the installed transformers
release: 5.24's FalconAttention computes attention itself (the switch's adapter; ``references.RefFalconAttention``),
5.25's calls the AttentionInterface with ALiBi in the float mask (``references.attention_reference``). Outputs,
gradients and a cached generation; softmax through the switch equals HF's own model."""
from __future__ import annotations

import copy

import pytest
import torch
from references import FALCON_THROUGH_THE_INTERFACE, reference_twin
from transformers import FalconConfig, FalconForCausalLM

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf.families import adapter_for
from polyattn_lightning.attention.switch.hf.families.alibi import FalconAttention as FalconAdapter

CONFIGS = {
    "alibi-multi-query": dict(alibi=True, multi_query=True),
    "alibi-grouped": dict(alibi=True, new_decoder_architecture=True, num_kv_heads=2),
    "alibi-per-head": dict(alibi=True, multi_query=False),
    "rotary-multi-query": dict(alibi=False, multi_query=True),
    "rotary-grouped": dict(alibi=False, new_decoder_architecture=True, num_kv_heads=2),
}


def tiny_falcon(**overrides) -> FalconForCausalLM:
    torch.manual_seed(0)
    config = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, initializer_range=0.2,
                  max_position_embeddings=64, pad_token_id=0)
    return FalconForCausalLM(FalconConfig(**{**config, **overrides})).eval()


def padded_batch():
    """Two rows of 9 ids; the second row's last 3 positions are padding."""
    ids = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, -3:] = 0
    return ids, mask


def real_logits(model, ids, mask):
    return model(input_ids=ids, attention_mask=mask).logits[mask.bool()]


@pytest.mark.parametrize("name", CONFIGS)
def test_softmax_is_hf_falcon_and_poly3_outputs_and_gradients_equal_the_reference(name):
    model = tiny_falcon(**CONFIGS[name])
    ids, mask = padded_batch()
    softmax = copy.deepcopy(model)
    set_attention(softmax, "softmax")
    with torch.no_grad():
        softmax_expected = real_logits(model, ids, mask)
        torch.testing.assert_close(real_logits(softmax, ids, mask), softmax_expected, atol=1e-5, rtol=1e-5)
    reference = reference_twin(model)
    assert set_attention(model, "poly3") == 2
    routes = {adapter_for(m) is not None for _, m in attention_modules(model)}
    assert routes == {not FALCON_THROUGH_THE_INTERFACE}  # 5.24: the adapter; 5.25: the interface
    outs = []
    for m in (model, reference):
        m.zero_grad()
        logits = real_logits(m, ids, mask)
        logits.square().mean().backward()
        outs.append(logits.detach())
    scale = outs[1].abs().max()
    assert (outs[0] - outs[1]).abs().max() / scale <= 1e-4
    assert (outs[0] - softmax_expected).abs().max() / scale > 1e-2  # poly3 is not softmax
    grads = [{n: p.grad for n, p in m.named_parameters() if p.grad is not None} for m in (model, reference)]
    assert grads[0].keys() == grads[1].keys() and grads[0]
    top = max(g.abs().max() for g in grads[1].values())
    for n, g in grads[1].items():
        assert (grads[0][n] - g).abs().max() / top <= 1e-4, n


@pytest.mark.parametrize("name", ["alibi-multi-query", "alibi-grouped", "rotary-grouped"])
def test_cached_generation_equals_the_reference(name):
    """Each generated step (HF's cache: one query row over the cached keys, ALiBi's bias relative to that row's
    position) against the reference's forward over the whole sequence, without a cache."""
    model = tiny_falcon(**CONFIGS[name])
    reference = reference_twin(model)
    set_attention(model, "poly3")
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, use_cache=True, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        expected = reference(input_ids=out.sequences, use_cache=False).logits[0, prompt.shape[1] - 1 : -1]
    generated = torch.cat(out.logits)
    assert (generated - expected).abs().max() / expected.abs().max() <= 1e-4


def test_the_adapter_is_for_5_24_and_the_interface_for_5_25():
    """The recorded fingerprints say which route each reviewed release's FalconAttention takes."""
    from polyattn_lightning.attention.switch.reviewed import records

    recorded = records()["transformers"]["transformers.models.falcon.modeling_falcon.FalconAttention"]
    routes = {release: entry["route"] for entry in recorded.values() for release in entry["releases"]}
    assert routes == {"5.24.0": "adapter", "5.25.0": "interface"}
    module = tiny_falcon(**CONFIGS["alibi-multi-query"]).transformer.h[0].self_attention
    assert adapter_for(module) is (None if FALCON_THROUGH_THE_INTERFACE else FalconAdapter)
