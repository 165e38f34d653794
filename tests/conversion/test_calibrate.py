"""method="calibrate": per-head temperatures against a closed form, folded into the query rows only, a model with
large (pretrained-like) scores brought near its softmax outputs, refusals that leave the weights as they were, and
the old entry points (set_attention(calibrate=True), the old module path) pointing here."""
from __future__ import annotations

import copy
import importlib
import sys

import conversion_models as cm
import pytest
import torch

from polyattn_lightning import convert
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.attention import set_attention
from polyattn_lightning.attention.switch.base import AttentionInputs
from polyattn_lightning.conversion.calibrate import best_temperatures
from polyattn_lightning.diagnostics.norms import probe_attention, select_layers
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
    model = cm.bert()
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
    samples = cm.token_samples(batches=2, padded=True)
    softmax = copy.deepcopy(model)
    set_attention(softmax, "softmax", probe=samples[0])
    expected = best_temperatures(first_layer_queries(softmax, samples[0]), "poly3")  # calibrate on that batch alone
    calibrated = copy.deepcopy(model)
    report = convert(calibrated, "poly3", samples[:1], method="calibrate")
    torch.testing.assert_close(torch.tensor(report.temperatures[0], dtype=torch.float64), expected)
    assert (expected < 1).all()
    before, after = model.state_dict(), calibrated.state_dict()
    changed = sorted(name for name in before if not torch.equal(before[name], after[name]))
    assert changed == [f"encoder.layer.{i}.attention.self.query.{p}" for i in range(2) for p in ("bias", "weight")]
    weight = "encoder.layer.0.attention.self.query.weight"
    rows = after[weight] / before[weight]
    torch.testing.assert_close(rows.reshape(4, -1), expected.float()[:, None].expand(4, 8 * 32))
    # what layer 1 attends: the same queries times each head's temperature
    queries = first_layer_queries(calibrated, samples[0]).q
    torch.testing.assert_close(queries, first_layer_queries(softmax, samples[0]).q * expected.float()[:, None, None])


def test_a_calibrated_layer_with_large_scores_starts_nearer_its_softmax_output_than_no_attention():
    """x^3 / sqrt(N) is orders of magnitude off softmax at these scores; calibrated, nearer than no attention at all
    (a zero output: error 1). Random weights have no pattern x^3 can match well: the pretrained tiny Llama and the
    MiniLM are brought far nearer (configs/README.md)."""
    samples = cm.token_samples(batches=2, rows=8, padded=True)
    report = convert(large_score_bert(), "poly3", samples, method="calibrate")
    assert min(report.error_before) > 100 and max(report.error_after) < 1, report


def test_calibration_refuses_queries_normalised_by_a_shared_norm_and_leaves_the_weights_as_they_were():
    model = cm.qwen3()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ConfigError, match=r"convert: Qwen3Attention's q_norm weight \(8,\) is shared by all heads"):
        convert(model, "poly3", cm.token_samples(batches=1), method="calibrate")
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())


def test_the_old_entry_points_say_where_calibration_went():
    with pytest.raises(ConfigError, match=r"set_attention\(calibrate=True\) moved: call polyattn_lightning.convert"):
        set_attention(cm.bert(), "poly3", calibrate=True)
    assert attention_modules(cm.bert()) == []
    sys.modules.pop("polyattn_lightning.attention.hf_calibration", None)
    with pytest.warns(FutureWarning, match="moved to polyattn_lightning.conversion.calibrate"):
        old = importlib.import_module("polyattn_lightning.attention.hf_calibration")
    assert old.best_temperatures is best_temperatures


def test_bad_convert_calls_are_short_errors():
    samples = cm.token_samples(batches=1)
    with pytest.raises(ConfigError, match="method 'distill' is not one of none, calibrate, transfer"):
        convert(cm.llama(), "poly3", samples, method="distill")
    with pytest.raises(ConfigError, match="rank are options of method=transfer, not calibrate"):
        convert(cm.llama(), "poly3", samples, method="calibrate", rank=4)
    with pytest.raises(ConfigError, match="samples is empty"):
        convert(cm.llama(), "poly3", [], method="transfer")
    with pytest.raises(ConfigError, match="convert.qk: 'some' is not one of lora, full, none"):
        convert(cm.llama(), "poly3", samples, qk="some")
