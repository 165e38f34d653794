"""What the HF switch honours beyond q, k, v and a boolean mask, each against a formula written here: BEiT's and
Swin's masks taken apart into mask and score bias (positive, negative and all-negative biases), Gemma 2's soft
cap, T5's position bias and unscaled scores, GPT-OSS's sinks, the default probe of every modality, the refusals,
gradients (Falcon's ALiBi, Gemma 2, GPT-OSS, T5) and Falcon's cached generation. The other families switched by
the project's adapters, and PyTorch's nn.MultiheadAttention, are checked against the float64 reference in
``test_hf_adapters.py``."""
from __future__ import annotations

import pytest
import torch
from references import phi, reference_twin
from torch import nn

from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.attention.switch.hf import probe_inputs
from polyattn_lightning.attention.switch.hf.extras import softcapped_attention
from polyattn_lightning.attention.switch.hf.interface import polyattn_attention
from polyattn_lightning.attention.switch.hf.masks import interface_masks
from polyattn_lightning.bench.hf_support import build, family, model_class, run
from polyattn_lightning.errors import ConfigError


def _relative_error(out, expected):
    return ((out - expected).abs().max() / expected.abs().max()).item()


def _signed_tables(model, sign):
    """Every relative-position table drawn again, all positive, all negative or of either sign."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "relative_position_bias_table" in name:
                draw = torch.randn(p.shape, generator=generator)
                p.copy_({"positive": draw.abs() + 0.1, "negative": -draw.abs() - 0.1, "mixed": draw}[sign])


def _captured(model):
    """Run the model's default probe forward with a capture on every switched layer: {name: AttentionInputs}."""
    seen = {}
    for name, module in attention_modules(model):
        module.capture = lambda m, inputs, name=name: seen.setdefault(name, inputs)
    with torch.no_grad():
        model(**probe_inputs(model))
    for _, module in attention_modules(model):
        module.capture = None
    return seen


# --------------------------------------------------------------------------- BEiT and Swin: mask vs score bias


@pytest.mark.parametrize("sign", ["positive", "negative", "mixed"])
def test_beit_float_mask_is_its_bias_and_finfo_min_masks(sign):
    model = build(family("beit"))
    _signed_tables(model, sign)
    module = model.layers[0].attention
    bias = model.layers[0].relative_position_bias((4, 4), dim_size=17)  # (1, H, 17, 17)
    padding = torch.zeros(2, 1, 1, 17)
    padding[1, ..., -3:] = torch.finfo(torch.float32).min
    causal, masks = interface_masks(module, bias + padding)
    keep = (padding == 0).expand(2, 4, 17, 17)
    assert not causal and torch.equal(masks["attn_mask"], keep)
    torch.testing.assert_close(masks["attn_bias"], torch.where(keep, bias, 0.0), rtol=0, atol=0)
    _, alone = interface_masks(module, bias)
    assert set(alone) == {"attn_bias"} and torch.equal(alone["attn_bias"], bias)  # nothing masked


@pytest.mark.parametrize("sign", ["positive", "negative", "mixed"])
def test_swin_bias_is_recomputed_and_the_shift_mask_is_what_remains(sign):
    model = build(family("swin"))
    _signed_tables(model, sign)
    set_attention(model, "poly3")
    seen = _captured(model)
    assert len(seen) == 3
    for name, module in attention_modules(model):
        layer = model.get_submodule(name.rsplit(".", 1)[0])
        side = 8 // 2 ** int(name.split(".")[2])  # the stage's grid: 8x8, then 4x4
        shift = layer.get_attn_mask(side, side, torch.float32, torch.device("cpu"))
        inputs = seen[name]
        torch.testing.assert_close(inputs.attn_bias, module.relative_position_bias(), rtol=0, atol=0)
        if shift is None:
            assert inputs.attn_mask is None
        else:  # row b * windows + w has window w's mask; -100 is masked, 0 kept, whatever the bias
            expected = (shift == 0).repeat(inputs.q.shape[0] // shift.shape[0], 1, 1).unsqueeze(1)
            assert torch.equal(inputs.attn_mask, expected) and not expected.all()


@pytest.mark.parametrize("key", ["beit", "swin", "data2vec-vision"])
@pytest.mark.parametrize("sign", ["positive", "negative"])
def test_position_biases_of_one_sign_equal_the_reference(key, sign):
    """A bias <= 0 everywhere was once taken for masked keys: each sign against the reference."""
    model = build(family(key))
    _signed_tables(model, sign)
    inputs = probe_inputs(model)
    expected = run(reference_twin(model), inputs)
    set_attention(model, "poly3")
    assert _relative_error(run(model, inputs), expected) <= 1e-4


# --------------------------------------------------------------------------- softcap, position_bias, sinks


class _Module(nn.Module):
    def __init__(self, spec, is_causal=False):
        super().__init__()
        self.activation_spec, self.is_causal, self.capture = spec, is_causal, None


def _qkv(heads=2, kv_heads=2, queries=5, keys=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, queries, 8, generator=g)
    k, v = (torch.randn(2, kv_heads, keys, 8, generator=g) for _ in range(2))
    return q, k, v


def _padding_mask(keys=5, queries=5, causal=False):
    """HF's boolean mask (B, 1, Q, K): row 1's last two keys are padding; bottom-right causal if asked."""
    keep = torch.ones(2, 1, queries, keys, dtype=torch.bool)
    keep[1, ..., -2:] = False
    return keep & torch.ones(queries, keys, dtype=torch.bool).tril(keys - queries) if causal else keep


@pytest.mark.parametrize("causal", [False, True])
def test_softcap_is_c_tanh_s_over_c_before_the_mask_and_phi(causal):
    q, k, v = _qkv()
    keep = _padding_mask(causal=causal)
    scores = q @ k.transpose(-1, -2) * 0.5
    capped = 2.0 * torch.tanh(scores / 2.0)
    for spec in ("softmax", "poly3", "sigmoid"):
        out, _ = polyattn_attention(_Module(spec), q, k, v, keep, scaling=0.5, softcap=2.0)
        if spec == "softmax":
            weights = capped.masked_fill(~keep, float("-inf")).softmax(-1)
        elif spec == "poly3":
            weights = phi(capped, keep).float()
        else:  # sigmoid(S - log N)
            n = keep.sum(-1, keepdim=True)
            weights = torch.where(keep, torch.sigmoid(capped - n.log()), 0.0)
        torch.testing.assert_close(out, (weights @ v).transpose(1, 2), atol=1e-5, rtol=1e-5, msg=spec)


def test_softcap_materialised_path_has_attentions_gradients():
    q, k, v = (x.requires_grad_() for x in _qkv())
    out = softcapped_attention(q, k, v, "poly3", 0.5, 2.0, 0.0, True, {})
    out.square().sum().backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in (q, k, v))


def test_t5_attends_unscaled_with_its_position_bias():
    model = build(family("t5"))
    set_attention(model, "poly3")
    seen = _captured(model)
    assert len(seen) == 6
    for name, inputs in seen.items():
        assert inputs.temperature == 1.0, name  # T5 has no 1/sqrt(d): its projections are initialised for it
        if "EncDecAttention" not in name:  # cross attention passes a bias of zeros
            assert inputs.attn_bias.abs().max() > 0.1, name


def test_position_bias_sentinels_mask_by_equality():
    """LongT5 adds its local mask into position_bias: finfo.min there masks, every other value is a bias."""
    q, k, v = _qkv()
    bias = torch.randn(1, 2, 5, 5, generator=torch.Generator().manual_seed(4)) - 2.0  # all of either sign
    bias[..., 0, 3:] = torch.finfo(torch.float32).min
    keep = torch.ones(1, 1, 5, 5, dtype=torch.bool)
    keep[..., 0, 3:] = False
    out, _ = polyattn_attention(_Module("poly3"), q, k, v, None, scaling=1.0, position_bias=bias)
    expected = phi(q @ k.transpose(-1, -2) + torch.where(keep, bias, 0.0), keep).float() @ v
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_row", [False, True])
@pytest.mark.parametrize("mask", ["padding", "causal", "none"])
def test_sinks_are_exact_for_softmax_and_a_zero_valued_key_for_poly3(mask, per_row):
    """GPT-OSS's ``s_aux`` (one logit per head) and Inkling 2's ``sinks`` (one per row, (B, H, Q, 1))."""
    q, k, v = _qkv(heads=4, kv_heads=2)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    column = sinks.view(1, 4, 1, 1).expand(2, 4, 5, 1)
    if per_row:
        column = column + torch.randn(2, 4, 5, 1, generator=torch.Generator().manual_seed(8))
    given = {"sinks": column} if per_row else {"s_aux": sinks}
    keep = {"padding": _padding_mask(), "causal": None, "none": None}[mask]
    module = _Module("softmax", is_causal=mask == "causal")
    keys, values = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    scores = q @ keys.transpose(-1, -2) * 8**-0.5
    allowed = keep if keep is not None else torch.ones(5, 5, dtype=torch.bool).tril() if mask == "causal" else \
        torch.ones(1, dtype=torch.bool)
    # GPT-OSS's eager: the sink logit joins each row's softmax and its weight is dropped
    logits = torch.cat([scores.masked_fill(~allowed, float("-inf")), column], -1)
    expected = logits.softmax(-1)[..., :-1] @ values
    out, _ = polyattn_attention(module, q, k, v, keep, scaling=8**-0.5, **given)
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)
    module.activation_spec = "poly3"
    out, _ = polyattn_attention(module, q, k, v, keep, scaling=8**-0.5, **given)
    expected = phi(scores, allowed, extra_keys=1).float() @ values  # N counts the sink
    torch.testing.assert_close(out, expected.transpose(1, 2), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the default probe, per modality


@pytest.mark.parametrize("key, expected", [
    ("bert", {"input_ids": (2, 6), "attention_mask": (2, 6)}),
    ("vit", {"pixel_values": (1, 3, 16, 16)}),
    ("videomae", {"pixel_values": (1, 4, 3, 16, 16)}),
    ("wav2vec2", {"input_values": (2, 52)}),  # 6 frames: (6 - 1) * 2 + 3 = 13, (13 - 1) * 4 + 4 = 52
    ("whisper", {"input_features": (2, 8, 16), "decoder_input_ids": (2, 6)}),
    ("clip", {"input_ids": (2, 6), "attention_mask": (2, 6), "pixel_values": (2, 3, 16, 16)}),
    ("t5", {"input_ids": (2, 6), "attention_mask": (2, 6), "decoder_input_ids": (2, 6)}),
])
def test_default_probe_inputs_per_modality(key, expected):
    model = build(family(key))
    inputs = probe_inputs(model)
    assert {name: tuple(x.shape) for name, x in inputs.items()} == expected
    if "attention_mask" in inputs:
        assert inputs["attention_mask"][1, -2:].sum() == 0 and inputs["attention_mask"][0].all()
    assert set_attention(model, "poly3") == len(attention_modules(model)) > 0


def test_no_default_probe_is_one_line_naming_the_model():
    from transformers import Speech2TextConfig, Speech2TextModel

    model = Speech2TextModel(Speech2TextConfig(vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1,
                                               encoder_attention_heads=2, decoder_attention_heads=2,
                                               encoder_ffn_dim=16, decoder_ffn_dim=16)).eval()
    with pytest.raises(ConfigError, match=r"^Speech2TextModel takes 'input_features', .* pass probe=") as error:
        set_attention(model, "poly3")
    assert "\n" not in str(error.value)
    assert model.config._attn_implementation != "polyattn"


def test_a_default_probe_that_fails_is_one_line_naming_the_model():
    model = build(family("vit"))
    model.config.image_size = 20  # the probe's image no longer fits the patch grid the model was built for
    with pytest.raises(ConfigError, match=r"^ViTModel: the default probe forward .* failed .* pass probe="):
        set_attention(model, "poly3")
    assert model.config._attn_implementation == "sdpa" and attention_modules(model) == []


# --------------------------------------------------------------------------- refusals


def test_a_model_without_interface_or_adapter_is_refused_naming_its_layers():
    from transformers import ConvBertConfig, ConvBertModel

    model = ConvBertModel(ConvBertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                         intermediate_size=32, embedding_size=32)).eval()
    with pytest.raises(ConfigError, match=r"^ConvBertModel cannot be switched: encoder\.layer\.0\.attention\.self "
                                          r"\(ConvBertSelfAttention\) did not attend in the probe forward through .*AttentionInterface"):
        set_attention(model, "poly3")
    assert attention_modules(model) == []


def test_an_adapter_refuses_a_configuration_it_does_not_express():
    model = build(family("deberta"))
    model.config.talking_head = True
    model = type(model)(model.config).eval()
    with pytest.raises(ConfigError, match=r"DebertaModel cannot be switched: .*talking_head=True"):
        set_attention(model, "poly3")
    assert attention_modules(model) == []


def test_softmax_left_inside_an_attention_layer_is_refused():
    from transformers.models.bert.modeling_bert import BertSelfAttention

    class StillSoftmax(BertSelfAttention):
        def forward(self, hidden_states, *args, **kwargs):
            hidden_states = hidden_states + 0 * hidden_states.softmax(-1)  # a softmax beside the interface call
            return super().forward(hidden_states, *args, **kwargs)

    model = build(family("bert"))
    model.encoder.layer[0].attention.self.__class__ = StillSoftmax
    with pytest.raises(ConfigError, match=r"softmax left in an attention layer: encoder\.layer\.0\.attention\.self"):
        set_attention(model, "poly3")
    assert model.config._attn_implementation == "sdpa"


# --------------------------------------------------------------------------- training and generation


@pytest.mark.parametrize("key", ["falcon-alibi", "gemma-2", "gpt-oss", "t5"])
def test_gradients_equal_the_reference(key):
    """Fine-tuning sees the same gradients as the reference: ALiBi, position tables, sinks and the soft cap carry
    theirs."""
    model = build(family(key))
    reference = reference_twin(model)
    set_attention(model, "poly3")
    inputs = probe_inputs(model)
    grads = []
    for m in (model, reference):
        m.zero_grad()
        run_loss = sum(t.square().mean() for t in _floating(m(**inputs)))
        run_loss.backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    assert grads[1] and grads[1].keys() <= grads[0].keys()
    for name in grads[0].keys() - grads[1].keys():  # GPT-OSS's sinks: a zero-valued key's logit (extras.py)
        assert grads[0][name].abs().max() == 0, name
    scale = max(grad.abs().max() for grad in grads[1].values())
    for name, grad in grads[1].items():
        assert (grads[0][name] - grad).abs().max() / scale <= 1e-4, name


def _floating(out):
    from polyattn_lightning.bench.hf_support import outputs

    return outputs(out)


@pytest.mark.parametrize("key", ["falcon", "falcon-alibi"])
def test_cached_generation_through_an_adapter_matches_without_the_cache(key):
    fam = family(key)
    cls = getattr(__import__("transformers"), fam.model.replace("Model", "ForCausalLM"))
    torch.manual_seed(0)
    model = cls(model_class(fam).config_class(**fam.config)).eval()
    set_attention(model, "poly3")
    prompt = torch.randint(1, 64, (1, 5), generator=torch.Generator().manual_seed(7))
    runs = [model.generate(prompt, max_new_tokens=4, do_sample=False, use_cache=cache, output_logits=True,
                           return_dict_in_generate=True, pad_token_id=0) for cache in (True, False)]
    assert torch.equal(runs[0].sequences, runs[1].sequences)
    for cached, uncached in zip(runs[0].logits, runs[1].logits, strict=True):
        torch.testing.assert_close(cached, uncached, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("key", ["siglip", "deberta-v2", "bert"])
def test_switching_again_changes_the_activation(key):
    """Adapters, nn.MultiheadAttention and interface modules alike: poly3, then softmax gives HF's outputs."""
    model = build(family(key))
    inputs = probe_inputs(model)
    expected = run(model, inputs)
    count = set_attention(model, "poly3")
    assert set_attention(model, "softmax") == count
    assert (run(model, inputs) - expected).abs().max() <= 1e-5


@pytest.mark.parametrize("key", ["siglip", "deberta-v2", "swin"])
def test_a_switched_model_pickles_with_its_adapters(key):
    import pickle

    model = build(family(key))
    set_attention(model, {"name": "poly3", "scale": 0.5})
    inputs = probe_inputs(model)
    loaded = pickle.loads(pickle.dumps(model))
    assert [type(m) for _, m in attention_modules(loaded)] == [type(m) for _, m in attention_modules(model)]
    torch.testing.assert_close(run(loaded, inputs), run(model, inputs), atol=0, rtol=0)
    assert {m.map_layout for _, m in attention_modules(model)} == ({"shifted_windows"} if key == "swin" else {"tokens"})
