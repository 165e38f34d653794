"""set_attention(..., calibrate=True) and the probe through the one door: per-head temperatures against a closed
form, folded into the query rows only, a model with large (pretrained-like) scores brought near its softmax
outputs, refusals that leave the model as it was."""
from __future__ import annotations

import copy

import pytest
import timm
import torch
from hf_models import tiny_bert, tiny_llama, token_batch
from transformers import Qwen3Config, Qwen3Model

from polyattn_lightning.diagnostics.norms import probe_attention, select_layers
from polyattn_lightning.attention.switch.hf.calibration import best_temperatures
from polyattn_lightning.attention.switch.base import AttentionInputs
from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.errors import ConfigError

GRID_STEP = 0.05  # log10 of the ratio of neighbouring temperatures


def test_poly3_temperature_is_the_least_squares_one_to_a_grid_step():
    """phi(t S) v = t^3 (S^3 / sqrt(N)) v for poly3, so the best t^3 is <cubic, softmax> / <cubic, cubic> per head."""
    g = torch.Generator().manual_seed(0)
    k, v, noise = (torch.randn(2, 3, 10, 8, generator=g, dtype=torch.float64) for _ in range(3))
    q = (k + 0.5 * noise) * torch.tensor([1.0, 3.0, 8.0], dtype=torch.float64)[:, None, None]  # small to large scores
    padding = torch.zeros(2, 10, dtype=torch.bool)
    padding[1, 7:] = True
    got = best_temperatures(AttentionInputs(q, k, v, 8**-0.5, key_padding_mask=padding), "poly3")

    keep = ~padding[:, None, None, :]
    s = q @ k.transpose(-1, -2) * 8**-0.5
    target = s.masked_fill(~keep, float("-inf")).softmax(-1) @ v
    cubic = torch.where(keep, s**3 / keep.sum(-1, keepdim=True).sqrt(), 0.0) @ v
    t3 = (cubic * target).sum((0, 2, 3)) / (cubic**2).sum((0, 2, 3))
    assert (t3 > 0).all()
    assert (torch.log10(got / t3 ** (1 / 3)).abs() <= GRID_STEP + 1e-9).all(), (got, t3 ** (1 / 3))
    assert got[2] < got[1] < got[0]  # larger scores, smaller temperature


def test_softmax_calibrates_to_temperature_one():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 6, 4, generator=g) for _ in range(3))
    assert torch.equal(best_temperatures(AttentionInputs(q, k, v, 0.5), "softmax"), torch.ones(2, dtype=torch.float64))


def large_score_bert():
    """The tiny BERT with its queries 6x larger (and a query bias): scores of pretrained size (tens), where
    x^3 / sqrt(N) explodes."""
    model = tiny_bert()
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(6)
            layer.attention.self.query.bias.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(5))
    return model


def first_layer_queries(model, batch):
    [layer] = select_layers(model, [1])
    [(inputs,)] = probe_attention([layer], lambda: model(**batch)).values()
    return inputs


def test_calibration_folds_per_head_temperatures_into_the_query_rows_only():
    model = large_score_bert()
    ids, mask = token_batch()
    batch = {"input_ids": ids, "attention_mask": mask}
    softmax = copy.deepcopy(model)
    set_attention(softmax, "softmax", probe=batch)
    expected = best_temperatures(first_layer_queries(softmax, batch), "poly3")
    assert (expected < 1).all()

    calibrated = copy.deepcopy(model)
    set_attention(calibrated, "poly3", probe=batch, calibrate=True)
    before, after = model.state_dict(), calibrated.state_dict()
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    assert changed == [f"encoder.layer.{i}.attention.self.query.{p}" for i in range(2) for p in ("bias", "weight")]
    weight = "encoder.layer.0.attention.self.query.weight"
    rows = after[weight] / before[weight]
    torch.testing.assert_close(rows.reshape(4, -1), expected.float()[:, None].expand(4, 8 * 32))
    # what layer 1 attends: the same queries times each head's temperature
    queries = first_layer_queries(calibrated, batch).q
    torch.testing.assert_close(queries, first_layer_queries(softmax, batch).q * expected.float()[:, None, None])


def test_a_calibrated_layer_with_large_scores_starts_nearer_its_softmax_output_than_no_attention():
    """Layer 1 (the same inputs in every model): x^3 / sqrt(N) is orders of magnitude off softmax at these scores;
    calibrated, it is nearer than no attention at all (a zero output). Random weights have no pattern x^3 can match
    well; the pretrained MiniLM is brought far nearer (tests/hf/test_minilm.py)."""
    model = large_score_bert()
    g = torch.Generator().manual_seed(3)
    batch = {"input_ids": torch.randint(1, 64, (8, 12), generator=g),
             "attention_mask": torch.ones(8, 12, dtype=torch.long)}

    def first_layer_output(m):
        out = []
        hook = m.encoder.layer[0].attention.self.register_forward_hook(lambda mod, args, result: out.append(result[0]))
        with torch.no_grad():
            m(**batch)
        hook.remove()
        return out[0]

    expected = first_layer_output(model)  # HF's own sdpa
    error = {}
    for calibrate in (False, True):
        switched = copy.deepcopy(model)
        set_attention(switched, "poly3", probe=batch, calibrate=calibrate)
        error[calibrate] = ((first_layer_output(switched) - expected).norm() / expected.norm()).item()
    assert error[False] > 100 and error[True] < 1, error  # 1: the error of a zero output


def test_the_probe_given_is_the_forward_run_and_calibration_runs_it_once_more():
    model = tiny_llama()
    ids, mask = token_batch()
    runs = []

    def probe():
        runs.append(1)
        return model(input_ids=ids, attention_mask=mask)

    assert set_attention(model, "poly3", probe=probe) == 2 and len(runs) == 1
    assert set_attention(model, "poly3", probe=probe, calibrate=True) == 2 and len(runs) == 3


def test_calibration_refuses_queries_normalised_after_the_projection_and_leaves_the_model_as_it_was():
    torch.manual_seed(0)
    model = Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   attn_implementation="sdpa")).eval()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"calibrate: Qwen3Attention normalises its queries \(q_norm\)"):
        set_attention(model, "poly3", calibrate=True)
    assert model.config._attn_implementation == "sdpa" and attention_modules(model) == []
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_the_one_door_refuses_options_that_do_not_fit_the_model():
    with pytest.raises(ConfigError, match="calibrate=True is for Hugging Face"):
        set_attention(timm.create_model("vit_tiny_patch16_224", depth=1, img_size=32, patch_size=16), "poly3",
                      calibrate=True)
    with pytest.raises(ConfigError, match="BertModel: a Hugging Face model is switched whole"):
        set_attention(tiny_bert(), "poly3", strict=False)
    with pytest.raises(ConfigError, match="BertModel: probe= must be a mapping"):
        set_attention(tiny_bert(), "poly3", probe=3)
