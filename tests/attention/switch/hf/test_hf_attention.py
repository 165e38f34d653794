"""set_attention on Hugging Face models: parity with HF's SDPA, an independent poly3 reference, masks, GQA,
the KV cache, refusals, diagnostics through the capture contract, saving and loading."""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from hf_models import tiny_bert, tiny_llama, tiny_vit, token_batch, with_reference
from transformers import MistralConfig, MistralModel
from transformers.models.bert.modeling_bert import BertSelfAttention

from polyattn_lightning.diagnostics.norms import probe_attention, select_layers
from polyattn_lightning.attention.switch.hf import IMPLEMENTATION, load_pretrained
from polyattn_lightning.attention.switch.base import attention_map
from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.errors import ConfigError


def run(model, ids=None, mask=None, pixels=None, **kwargs):
    if pixels is not None:
        return model(pixel_values=pixels).last_hidden_state
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def inputs_for(name):
    if name == "vit":
        return {"pixels": torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(2))}
    ids, mask = token_batch()
    return {"ids": ids, "mask": mask}


BUILDERS = {"bert": tiny_bert, "vit": tiny_vit, "llama": tiny_llama}


def real_rows(out, inputs):
    """The outputs of real (unpadded) tokens only, flattened: padded positions' outputs are not defined."""
    mask = inputs.get("mask")
    return out.reshape(-1, out.shape[-1]) if mask is None else out[mask.bool()]


@pytest.mark.parametrize("name", BUILDERS)
def test_softmax_through_the_interface_equals_hf_sdpa(name):
    model, inputs = BUILDERS[name](), inputs_for(name)
    expected = run(model, **inputs)
    assert set_attention(model, "softmax") == 2
    assert model.config._attn_implementation == IMPLEMENTATION
    torch.testing.assert_close(real_rows(run(model, **inputs), inputs), real_rows(expected, inputs), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", BUILDERS)
def test_poly3_equals_an_independent_reference(name):
    model, inputs = BUILDERS[name](), inputs_for(name)
    reference, softmax = with_reference(model), run(model, **inputs)
    set_attention(model, "poly3")
    out = run(model, **inputs)
    torch.testing.assert_close(real_rows(out, inputs), real_rows(run(reference, **inputs), inputs), atol=2e-5, rtol=1e-4)
    assert (out - softmax).abs().max() > 1e-3  # the activation changed something


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_grouped_query_attention(kv_heads):
    model = tiny_llama(num_key_value_heads=kv_heads)
    ids, mask = token_batch()
    reference = with_reference(model)
    set_attention(model, "poly3")
    torch.testing.assert_close(run(model, ids, mask)[mask.bool()], run(reference, ids, mask)[mask.bool()],
                               atol=2e-5, rtol=1e-4)


def test_padded_encoder_batch_equals_the_unpadded_sequences():
    model = tiny_bert()
    set_attention(model, "poly3")
    ids, mask = token_batch()
    batch = run(model, ids, mask)
    for row in range(2):
        length = int(mask[row].sum())
        alone = run(model, ids[row : row + 1, :length], mask[row : row + 1, :length])
        torch.testing.assert_close(batch[row, :length], alone[0], atol=1e-5, rtol=1e-5)


def test_left_padded_decoder_batch_equals_the_unpadded_sequences():
    """Left padding, as generate() pads: causal and padding masks combined; positions follow the real tokens."""
    model = tiny_llama()
    set_attention(model, "poly3")
    ids, _ = token_batch()
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    batch = run(model, ids, mask, position_ids=positions)
    torch.testing.assert_close(batch[0], run(model, ids[:1])[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(batch[1, 3:], run(model, ids[1:, 3:])[0], atol=1e-5, rtol=1e-5)


def test_future_tokens_change_nothing_before_them():
    model = tiny_llama()
    set_attention(model, "poly3")
    ids, _ = token_batch()
    changed = ids.clone()
    changed[:, 5:] = (changed[:, 5:] + 7) % 64
    before, after = run(model, ids), run(model, changed)
    torch.testing.assert_close(after[:, :5], before[:, :5], atol=0, rtol=0)
    assert (after[:, 5:] - before[:, 5:]).abs().max() > 1e-3


def test_sliding_window_arrives_through_the_mask():
    """One Mistral layer with a window of 3: position 5 sees tokens 3..5 only, so changing token 0 leaves it alone."""
    torch.manual_seed(0)
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa")
    model = MistralModel(config).eval()
    set_attention(model, "poly3")
    ids, _ = token_batch()
    changed = ids.clone()
    changed[:, 0] = (changed[:, 0] + 1) % 64
    before, after = run(model, ids), run(model, changed)
    torch.testing.assert_close(after[:, 3:], before[:, 3:], atol=0, rtol=0)
    assert (after[:, :3] - before[:, :3]).abs().max() > 1e-4


def test_generation_with_the_kv_cache_matches_without():
    """At every step the logits with the cache (one query row, all cached keys) equal those without."""
    model = tiny_llama()
    set_attention(model, "poly3")
    prompt = token_batch()[0][:1, :5]
    runs = [
        model.generate(prompt, max_new_tokens=8, do_sample=False, use_cache=cache, output_logits=True,
                       return_dict_in_generate=True, pad_token_id=0)
        for cache in (True, False)
    ]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for cached, uncached in zip(runs[0].logits, runs[1].logits, strict=True):
        torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=0)


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_cached_decoding_steps_equal_the_independent_reference(kv_heads):
    """Each cached step (one query row, no mask, no gradient: :func:`decode_step`, the cache not repeated per
    head) against the tests' own function generating with its own cache."""
    model = tiny_llama(num_key_value_heads=kv_heads)
    reference = with_reference(model)
    set_attention(model, "poly3")
    prompt = token_batch()[0][:1, :5]
    runs = [
        m.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, output_logits=True,
                   return_dict_in_generate=True, pad_token_id=0)
        for m in (model, reference)
    ]
    for step, (ours, theirs) in enumerate(zip(runs[0].logits, runs[1].logits, strict=True)):
        torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=2e-5, rtol=1e-4, msg=f"step {step}")


@pytest.mark.parametrize("kv_heads", [4, 2, 1])  # multi-head, grouped-query, multi-query
def test_the_cpp_decoding_step_generates_the_tokens_of_the_pytorch_step_and_the_reference(kv_heads, monkeypatch):
    """40 greedy tokens: the one-call C++ step (taken by the interface's one-row path and by the 5-token prompt's
    causal prefill), the materialized PyTorch step it replaced (what runs without a C++ build) and the tests'
    own fp64 reference generate the same tokens."""
    from polyattn_lightning.attention.kernels import dispatch, fused_cpu

    model = tiny_llama(num_key_value_heads=kv_heads)
    reference = with_reference(model)
    set_attention(model, "poly3")
    prompt = token_batch()[0][:1, :5]

    def generate(m):
        return m.generate(prompt, max_new_tokens=40, min_new_tokens=40, do_sample=False, use_cache=True,
                          output_logits=True, return_dict_in_generate=True, pad_token_id=0)

    steps, plan = [], fused_cpu.decode_plan

    def counted(act):  # the C++ op of the plan, counting its calls
        op, form, power = plan(act)
        return (lambda *args: steps.append(op(*args)) or steps[-1]), form, power

    monkeypatch.setattr(dispatch, "_STEPS", {})
    monkeypatch.setattr(fused_cpu, "decode_plan", counted)
    cpp, theirs = generate(model), generate(reference)
    assert len(steps) == 2 * 40  # 2 layers x (the prompt + 39 cached steps), each one C++ call
    monkeypatch.setattr(dispatch, "_STEPS", {})
    monkeypatch.setattr(fused_cpu, "load", lambda: False)  # no C++ build: the materialized kernel
    pytorch = generate(model)
    assert torch.equal(cpp.sequences, pytorch.sequences) and torch.equal(cpp.sequences, theirs.sequences)
    for ours, old in zip(cpp.logits, pytorch.logits, strict=True):
        torch.testing.assert_close(ours, old, atol=1e-5, rtol=1e-5)


def test_the_one_row_path_equals_the_general_path_and_follows_a_new_spec():
    """The interface's one-row step (no gradient) against the same call with a gradient (the general
    ``attention()`` path): grouped heads, a mapping spec with its own scale, and the module switched again to
    another activation (the cached plan is the spec's, not the module's)."""
    from polyattn_lightning.attention.switch.hf.interface import polyattn_attention

    model = tiny_llama(num_key_value_heads=2)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 1, 16, generator=generator)
    k, v = (torch.randn(1, 2, 13, 16, generator=generator) for _ in range(2))
    for spec in ({"name": "poly3", "scale": 0.07}, "relu", "softplus"):
        set_attention(model, spec)
        module = model.model.layers[0].self_attn
        with torch.no_grad():
            fast = polyattn_attention(module, q, k, v, None, scaling=0.3)[0]
        general = polyattn_attention(module, q.requires_grad_(), k, v, None, scaling=0.3)[0]
        q = q.detach()
        torch.testing.assert_close(fast, general.detach(), atol=1e-6, rtol=1e-5, msg=str(spec))


@pytest.mark.parametrize("causal", [False, True], ids=["step", "causal-prefill"])
def test_decode_step_is_the_general_path_on_its_inputs(causal):
    """The short path (the C++ op and the materialized PyTorch step) and ``attention()`` agree for up to
    DECODE_ROWS rows, causal or not, grouped heads, other activations."""
    from polyattn_lightning.attention.functional import attention
    from polyattn_lightning.attention.kernels.base.contract import STEP_ROWS as DECODE_ROWS
    from polyattn_lightning.attention.kernels.materialized import materialized_step
    from polyattn_lightning.attention.switch.hf.interface import decode_step
    from polyattn_lightning.attention.registry import get_activation

    generator = torch.Generator().manual_seed(0)
    for rows, heads, kv_heads, name in ((1, 4, 2, "poly3"), (DECODE_ROWS, 6, 3, "relu"), (3, 2, 1, "softplus")):
        q = torch.randn(2, heads, rows, 8, generator=generator)
        k, v = (torch.randn(2, kv_heads, 11, 8, generator=generator) for _ in range(2))
        groups = heads // kv_heads
        repeated = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))
        expected = attention(q, *repeated, name, temperature=0.3, is_causal=causal, kernel="blocked").transpose(1, 2)
        for step in (decode_step, lambda *args: materialized_step(*args).transpose(1, 2)):
            out = step(q, k, v, get_activation(name), 0.3, causal)
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=f"{step} {name}")


def test_a_short_causal_prompt_takes_one_cpp_call_equal_to_the_general_path(monkeypatch):
    """An 8-token prompt (no mask: HF's ``sdpa_mask`` leaves causality to ``is_causal``) is one C++ call per
    layer, and the prompt's logits are those of the general path (the same call with a gradient)."""
    from polyattn_lightning.attention.kernels import dispatch, fused_cpu

    model = tiny_llama(num_key_value_heads=2)
    set_attention(model, "poly3")
    prompt = token_batch()[0][:1, :8]
    calls, plan = [], fused_cpu.decode_plan

    def counted(act):  # the C++ op of the plan, recording whether each call is causal
        op, form, power = plan(act)
        return (lambda *args: calls.append(args[-1]) or op(*args)), form, power

    monkeypatch.setattr(dispatch, "_STEPS", {})
    monkeypatch.setattr(fused_cpu, "decode_plan", counted)
    with torch.no_grad():
        fast = model(prompt).logits
    assert calls == [True, True]  # 2 layers, each one causal call
    general = model(prompt).logits  # with a gradient: attention()'s causal kernel
    torch.testing.assert_close(fast, general.detach(), atol=1e-5, rtol=1e-5)


def test_two_models_with_different_activations_in_one_process():
    softmax_model, poly_model = tiny_bert(), tiny_bert()
    ids, mask = token_batch()
    expected_softmax, reference = run(softmax_model, ids, mask), run(with_reference(poly_model), ids, mask)
    set_attention(poly_model, "poly3")
    set_attention(softmax_model, "softmax")
    real = mask.bool()
    torch.testing.assert_close(run(poly_model, ids, mask)[real], reference[real], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(run(softmax_model, ids, mask)[real], expected_softmax[real], atol=1e-5, rtol=1e-5)


def test_attention_dropout_in_training_only():
    model = tiny_bert(attention_probs_dropout_prob=0.5, hidden_dropout_prob=0.0)
    set_attention(model, "poly3")
    ids, mask = token_batch()
    evaluated = [run(model, ids, mask) for _ in range(2)]
    model.train()
    trained = run(model, ids, mask)
    torch.testing.assert_close(evaluated[0], evaluated[1], atol=0, rtol=0)
    assert (trained - evaluated[0]).abs().max() > 1e-3


class SelfComputedAttention(BertSelfAttention):
    """A layer that computes softmax attention itself instead of calling the interface."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        q = self.query(hidden_states)
        weights = (q @ self.key(hidden_states).transpose(1, 2) * q.shape[-1] ** -0.5).softmax(-1)
        return weights @ self.value(hidden_states), None


def test_a_layer_that_bypasses_the_interface_is_refused():
    model = tiny_bert()
    model.encoder.layer[1].attention.self.__class__ = SelfComputedAttention
    with pytest.raises(ConfigError, match=r"BertModel cannot be switched.*encoder\.layer\.1\.attention\.self"):
        set_attention(model, "poly3")
    assert model.config._attn_implementation == "sdpa"  # put back
    assert attention_modules(model) == []


def test_diagnostics_capture_what_each_layer_attends_in_forward_order():
    model = tiny_llama()
    set_attention(model, "poly3")
    layers = select_layers(model)
    assert [layer.name for layer in layers] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    ids, mask = token_batch()
    outputs = {}
    hooks = [layer.module.o_proj.register_forward_hook(lambda m, i, o, n=layer.index: outputs.setdefault(n, i[0]))
             for layer in layers]
    captured = probe_attention(layers, lambda: run(model, ids, mask))
    for hook in hooks:
        hook.remove()
    for index, (inputs,) in captured.items():
        rebuilt = attention_map(inputs, layers[index - 1].module.activation) @ inputs.v.float()
        rebuilt = rebuilt.transpose(1, 2).reshape(outputs[index].shape)
        torch.testing.assert_close(rebuilt[mask.bool()], outputs[index][mask.bool()], atol=1e-5, rtol=1e-4)


def test_a_switched_model_pickles_and_saves_with_its_activation(tmp_path):
    model = tiny_bert()
    set_attention(model, {"name": "poly3", "scale": 0.25})
    ids, mask = token_batch()
    expected = run(model, ids, mask)
    torch.testing.assert_close(run(pickle.loads(pickle.dumps(model)), ids, mask), expected, atol=0, rtol=0)
    model.save_pretrained(tmp_path / "saved")
    loaded = load_pretrained(tmp_path / "saved").eval()
    assert [m.activation_spec for _, m in attention_modules(loaded)] == [{"name": "poly3", "scale": 0.25}] * 2
    torch.testing.assert_close(run(loaded, ids, mask), expected, atol=1e-6, rtol=1e-6)


def test_a_model_built_from_a_switched_config_attends_with_its_activation_and_without_one_is_refused():
    """A model built from a switched model's config (as ``from_pretrained`` builds a saved folder) reads the
    activation from its config; one built with attn_implementation='polyattn' and no activation: a clear error."""
    model = tiny_bert()
    set_attention(model, {"name": "poly3", "scale": 0.25})
    ids, mask = token_batch()
    fresh = type(model)(copy.deepcopy(model.config)).eval()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(run(fresh, ids, mask), run(model, ids, mask), atol=0, rtol=0)
    config = copy.deepcopy(model.config)
    del config.polyattn_attention
    with pytest.raises(ConfigError, match="BertSelfAttention attends through .* not switched by"):
        run(type(model)(config).eval(), ids, mask)


def test_hf_masks_become_is_causal_and_key_padding_where_they_can():
    """HF's own boolean masks: causal + left padding -> is_causal and the padding; an encoder's padding ->
    key_padding_mask; a sliding window stays a dense mask."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask, sliding_window_causal_mask_function

    from polyattn_lightning.attention.switch.hf import split_mask

    padding = torch.tensor([[False, True, True, True, True], [True, True, True, True, True]])
    causal = sdpa_mask(2, 5, 5, attention_mask=padding, mask_function=causal_mask_function)
    is_causal, masks = split_mask(causal)
    assert is_causal and torch.equal(masks["key_padding_mask"], ~padding)
    encoder = sdpa_mask(2, 5, 5, attention_mask=padding, mask_function=lambda b, h, q, kv: q >= 0)
    is_causal, masks = split_mask(encoder)
    assert not is_causal and torch.equal(masks["key_padding_mask"], ~padding)
    window = sdpa_mask(2, 5, 5, attention_mask=padding, mask_function=sliding_window_causal_mask_function(2))
    is_causal, masks = split_mask(window)
    assert not is_causal and masks["attn_mask"] is window
