"""Where the factors go, checked by what they do: per layout (separate and fused projections, Conv1D, a q_bias,
q-norms, heads projected outside the module), a temperature on each head's queries equals, for x^3, the gain
t^3 on that head's output columns; a trained student folds into a model that computes exactly what it did, with
no new parameter and the same state-dict keys."""
from __future__ import annotations

import copy

import conversion_models as cm
import pytest
import torch

from polyattn_lightning.attention import set_attention
from polyattn_lightning.conversion import attention_layers
from polyattn_lightning.conversion.folding import Edits, Factor, fold, scale_queries
from polyattn_lightning.conversion.teacher import run_model
from polyattn_lightning.conversion.transfer import Student, TransferOptions
from polyattn_lightning.errors import ConfigError

TEMPERATURES = torch.tensor([0.5, 1.3, 2.0, 0.8], dtype=torch.float64)  # a different one per head
LAYOUTS = {
    "llama": (cm.llama, cm.token_samples),  # separate Linear, grouped-query heads
    "olmo2": (cm.olmo2, cm.token_samples),  # a q-norm over all heads: the temperature goes on its slices
    "gpt2": (cm.gpt2, cm.token_samples),  # fused Conv1D columns
    "bert": (cm.bert, lambda: cm.token_samples(padded=True)),  # heads projected by the parent's output.dense
    "vit": (cm.vit, lambda: cm.image_samples(16)),  # fused Linear rows
    "eva": (cm.eva, lambda: cm.image_samples(28)),  # fused rows without bias, a separate q_bias
}


def switched(make, samples, spec="poly3"):
    model = make()
    set_attention(model, spec, probe=dict(samples[0]) if isinstance(samples[0], dict) else lambda: model(samples[0]))
    layers, projections = attention_layers(model, samples[0])
    return model, layers, projections


def output(model, batch):
    """The last hidden states (timm: ``forward_features``; HF: the logits or the last hidden state)."""
    with torch.no_grad():
        if isinstance(batch, torch.Tensor):
            return model.forward_features(batch)
        out = run_model(model, batch)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_query_temperature_equals_the_cubed_gain_on_the_heads_output_columns(layout):
    make, samples = LAYOUTS[layout]
    samples = samples()
    by_temperature, _, found_t = switched(make, samples)
    by_gain, _, found_g = switched(make, samples)
    heads = found_t[0].heads
    assert heads in (3, 4) and all(f.temperature_refusal is None for f in found_t)
    t = TEMPERATURES[:heads]
    edits_t, edits_g = Edits(), Edits()
    for a, b in zip(found_t, found_g):
        scale_queries(edits_t, a, Factor(t, positive=True, trainable=False))
        edits_g.on(b.output).add(b.output, scale=(Factor(t**3, positive=False, trainable=False), b.head_dim))
    fold(edits_t)
    fold(edits_g)
    got_t, got_g = output(by_temperature, samples[0]), output(by_gain, samples[0])
    scale = got_g.abs().max()
    torch.testing.assert_close(got_t / scale, got_g / scale, rtol=1e-4, atol=1e-5)
    plain = output(switched(make, samples)[0], samples[0])
    # the factors did something, far beyond the rounding the two folds differ by
    assert (got_t - plain).norm() > 100 * (got_t - got_g).norm() + 1e-3 * plain.norm()


def test_each_layout_names_its_own_projections():
    _, _, [llama, _] = switched(cm.llama, cm.token_samples())
    assert (llama.query.name, llama.query.axis, llama.query.rows, llama.key.rows) == ("weight", 0, 32, 16)
    assert (llama.kv_heads, llama.output.axis, llama.query_bias, llama.key_bias) == (2, 1, None, None)
    model, _, [gpt2, _] = switched(cm.gpt2, cm.token_samples())
    c_attn = model.transformer.h[0].attn.c_attn
    assert gpt2.query.owner is c_attn and (gpt2.query.axis, gpt2.query.start, gpt2.key.start, gpt2.key.stop) == (
        1, 0, 32, 64)
    assert gpt2.output.owner is model.transformer.h[0].attn.c_proj and gpt2.output.axis == 0
    assert gpt2.query_bias.owner is c_attn and (gpt2.query_bias.start, gpt2.query_bias.stop) == (0, 32)
    assert gpt2.key_bias.owner is c_attn and (gpt2.key_bias.name, gpt2.key_bias.start, gpt2.key_bias.stop) == (
        "bias", 32, 64)
    model, _, [bert, _] = switched(cm.bert, cm.token_samples(padded=True))
    assert bert.outer_output is model.encoder.layer[0].attention.output.dense
    model, _, [eva, _] = switched(cm.eva, cm.image_samples(28))
    assert eva.query_bias.owner is model.blocks[0].attn and eva.query_bias.name == "q_bias"
    assert eva.key_bias is None  # EVA's k_bias is a fixed zero buffer
    model, _, [vit, _] = switched(cm.vit, cm.image_samples(16))
    assert vit.query.owner is model.blocks[0].attn.qkv and (vit.key.start, vit.key.stop) == (32, 64)
    assert vit.output.owner is model.blocks[0].attn.proj
    assert vit.key_bias.owner is model.blocks[0].attn.qkv and (vit.key_bias.start, vit.key_bias.stop) == (32, 64)
    model, _, [olmo, _] = switched(cm.olmo2, cm.token_samples())
    assert [b.owner for b in olmo.query_norm] == [model.model.layers[0].self_attn.q_norm]
    _, _, [qwen, _] = switched(cm.qwen3, cm.token_samples())
    assert qwen.temperature_refusal == "Qwen3Attention's q_norm weight (8,) is shared by all heads"
    with pytest.raises(ConfigError, match="Qwen3Attention's q_norm weight .* shared by all heads, so a per-head"):
        scale_queries(Edits(), qwen, Factor(TEMPERATURES, positive=True))


@pytest.mark.parametrize("layout, spec", [("llama", "poly3"), ("gpt2", "relu"), ("olmo2", "softplus"),
                                          ("eva", "poly3")])
def test_the_folded_model_computes_exactly_what_the_trained_student_did(layout, spec):
    make, samples = LAYOUTS[layout]
    samples = samples()
    model, layers, projections = switched(make, samples, spec)
    keys = list(model.state_dict())
    parameters = {name: p for name, p in model.named_parameters()}
    student = Student(model, layers, projections, spec, TransferOptions(steps=4), samples)
    student.fit(samples)
    assert any(float(p.detach().abs().max()) > 0 for p in student.edits.parameters())  # it trained
    trained = output(model, samples[1])
    student.fold()
    assert torch.equal(output(model, samples[1]), trained)
    assert list(model.state_dict()) == keys  # the same keys, in the same order
    assert {name: p for name, p in model.named_parameters()}.keys() == parameters.keys()
    assert all(p is parameters[name] for name, p in model.named_parameters())  # the same tensors, changed in place
    assert all(p.requires_grad for p in model.parameters())


def test_the_teacher_is_the_original_weights_while_the_student_trains():
    """With the edits turned off the model is the teacher: softmax on the weights it was given."""
    samples = cm.token_samples()
    model, layers, projections = switched(cm.llama, samples)
    reference = copy.deepcopy(model)
    student = Student(model, layers, projections, "poly3", TransferOptions(steps=3), samples)
    student.fit(samples)
    student.set_enabled(False)
    torch.testing.assert_close(output(model, samples[0]), output(reference, samples[0]), rtol=0, atol=0)
