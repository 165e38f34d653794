"""method="transfer": the per-layer error falls (below the closed-form start, below the factor-only ablation) on
separate, fused and q-normed projections; the start is the least-squares gain; what cannot fold is refused; the
report (JSON, figure) says what happened."""

from __future__ import annotations

import json
import zipfile

import conversion_models as cm
import pytest
import torch

from polyattn_lightning import convert
from polyattn_lightning.attention import attention_modules, set_attention
from polyattn_lightning.checkpoint import load_checkpoint
from polyattn_lightning.conversion import ConvertRecipe, attention_layers
from polyattn_lightning.conversion.transfer import Student, TransferOptions, homogeneous_degree
from polyattn_lightning.diagnostics.norms import probe_attention, select_layers
from polyattn_lightning.errors import ConfigError, UnknownOptionError

STEPS = 40


def converted(make, samples, spec="poly3", **options):
    """``make()`` converted on all of ``samples`` (what trains and how is tested here; the held-out part that
    stops it, in test_holdout.py)."""
    model = make()
    keys = list(model.state_dict())
    report = convert(model, spec, samples, "transfer", **{"steps": STEPS, "holdout": 0, **options})
    assert list(model.state_dict()) == keys
    return model, report


@pytest.mark.parametrize(
    "layout, samples",
    [
        ("llama", cm.token_samples),
        ("gpt2", cm.token_samples),
        ("vit", lambda: cm.image_samples(16)),
        ("qwen3", cm.token_samples),
    ],
    ids=["separate", "fused-conv1d", "fused-linear", "q-normed"],
)
def test_transfer_lowers_every_layers_error_below_its_closed_form_start(layout, samples):
    samples = samples()
    _, report = converted(getattr(cm, layout), samples)
    before, start, after = (torch.tensor(e) for e in (report.error_before, report.error_start, report.error_after))
    assert (start < before).all() and (start < 1.0).all()  # the least-squares gain: nearer than a zero output
    assert (after < 0.97 * start).all(), (start, after)
    assert report.transfer["steps"] <= STEPS and report.transfer["trainable"] > 0


def test_training_the_query_and_key_projections_beats_the_factor_only_ablation():
    samples = cm.token_samples()
    _, factor_only = converted(cm.llama, samples, qk="none")
    _, lora = converted(cm.llama, samples)
    _, full = converted(cm.llama, samples, qk="full")
    assert sum(lora.error_after) < sum(factor_only.error_after)
    assert sum(full.error_after) < sum(factor_only.error_after)
    assert factor_only.transfer["trainable"] == 2 * 4  # one gain per head and layer
    # LoRA r=8 on q (32 rows) and k (16 rows) of 32 inputs, per layer, plus the gains
    assert lora.transfer["trainable"] == 2 * (8 * (32 + 32) + 8 * (16 + 32) + 4)


def test_the_query_and_key_biases_train_where_the_projections_have_them():
    """A key bias adds ``q . b_k`` to every score of a query: softmax ignores that shift, x^3 does not (it mixes in
    lower powers of the scores), so the transfer trains it; the value rows of the fused bias stay as they were."""
    samples = cm.image_samples(16)
    original = cm.vit().state_dict()
    with_bias, report = converted(cm.vit, samples)
    without, plain = converted(cm.vit, samples, bias=False)
    width = 32  # embed_dim: q, k and v have 32 rows each in the fused qkv
    assert report.transfer["trainable"] == plain.transfer["trainable"] + 2 * 2 * width  # q and k rows, 2 layers
    for model, trained in ((with_bias, True), (without, False)):
        bias = model.state_dict()["blocks.0.attn.qkv.bias"]
        reference = original["blocks.0.attn.qkv.bias"]
        # the key rows change only when trained (the query rows also take each head's temperature)
        assert torch.equal(bias[width : 2 * width], reference[width : 2 * width]) != trained
        assert torch.equal(bias[2 * width :], reference[2 * width :])
    assert sum(report.error_after) < sum(plain.error_after)


def test_the_start_is_each_heads_least_squares_gain():
    samples = cm.token_samples(batches=1)
    model = cm.llama()
    set_attention(model, "poly3", probe=samples[0])
    layers, projections = attention_layers(model, samples[0])
    student = Student(model, layers, projections, "poly3", TransferOptions(), samples)
    [first] = select_layers(model, [1])
    student.set_enabled(False)  # the teacher's queries: the start gain lives on them, as a temperature
    with torch.no_grad():
        first.module.activation_spec = "softmax"
        [(inputs,)] = probe_attention([first], lambda: model(**samples[0])).values()
        first.module.activation_spec = "poly3"
    q, k, v = (x.double() for x in (inputs.q, inputs.k, inputs.v))
    s = q @ k.transpose(-1, -2) * inputs.temperature
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    softmax = s.masked_fill(~causal, float("-inf")).softmax(-1) @ v
    cubic = torch.where(causal, s**3 / causal.sum(-1, keepdim=True).sqrt(), 0.0) @ v
    expected = (cubic * softmax).sum((0, 2, 3)) / (cubic**2).sum((0, 2, 3))
    torch.testing.assert_close(student.gains[0]().double(), expected, rtol=1e-4, atol=1e-6)


def test_a_non_homogeneous_activation_trains_a_temperature_folded_into_the_q_norm_slices():
    samples = cm.token_samples()
    model = cm.olmo2()
    norm_before = model.model.layers[0].self_attn.q_norm.weight.detach().clone()
    model, report = converted(lambda: model, samples, spec="softplus")
    assert report.temperatures is not None and len(report.temperatures[0]) == 4
    ratio = model.model.layers[0].self_attn.q_norm.weight.detach() / norm_before
    torch.testing.assert_close(ratio.reshape(4, 8), torch.tensor(report.temperatures[0])[:, None].expand(4, 8))
    assert all(a < s for a, s in zip(report.error_after, report.error_start))


def test_what_cannot_fold_is_refused_before_any_weight_changes():
    model = cm.qwen3()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match="softplus is not homogeneous, so its per-head temperature must fold into "
        "the queries, but Qwen3Attention's q_norm weight .8,. is shared",
    ):
        convert(model, "softplus", cm.token_samples(batches=1))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert [homogeneous_degree(s) for s in ("poly3", "poly1", "relu", "softplus", "sigmoid")] == [3, 1, 1, None, None]


def test_layers_trained_a_chunk_at_a_time_end_where_all_at_once_do():
    """The layers are independent (each runs on the teacher's inputs; Adam is per parameter): one at a time, each
    for the same steps, they end as they do trained together."""
    samples = cm.token_samples()
    _, together = converted(cm.llama, samples, patience=10**6)
    _, one_by_one = converted(cm.llama, samples, patience=10**6, layers_per_pass=1)
    assert together.transfer["steps"] == STEPS and one_by_one.transfer["steps"] == 2 * STEPS
    torch.testing.assert_close(one_by_one.error_after, together.error_after, rtol=1e-4, atol=0)
    assert all(a < 0.97 * s for a, s in zip(together.error_after, together.error_start))


def test_the_report_is_plain_values_a_summary_and_a_figure(tmp_path):
    _, report = converted(cm.bert, cm.token_samples(padded=True), steps=5)
    data, figure = report.write(tmp_path)
    assert json.loads(data.read_text()) == report.as_dict()
    assert report.layers == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    assert figure.stat().st_size > 1000 and figure.read_bytes()[:4] == b"\x89PNG"
    assert "convert transfer to poly3: 2 layers, median layer error" in report.summary()
    torch.save({"conversion": report.as_dict()}, tmp_path / "x.pt")
    assert torch.load(tmp_path / "x.pt", weights_only=True)["conversion"]["error_after"] == report.error_after


def test_a_channel_attention_whose_projections_play_other_roles_is_refused():
    """DaViT's ChannelAttention attends timm's k with v as keys and q as values: the [q; k; v] rows the conversions
    edit are not its query and key, so it is refused (before any weight changes); its V2 (roles in order) converts."""
    from timm.models import davit

    torch.manual_seed(0)
    tokens = [torch.randn(2, 10, 16)]
    first = davit.ChannelAttention(16, num_heads=2)
    before = {k: v.clone() for k, v in first.state_dict().items()}
    with pytest.raises(
        ConfigError,
        match=r"ChannelAttention attends with its projections' \[q; k; v\] blocks in the "
        r"roles kvq",
    ):
        convert(first, "poly3", tokens, "calibrate")
    assert all(torch.equal(before[k], v) for k, v in first.state_dict().items())
    report = convert(davit.ChannelAttentionV2(16, num_heads=2), "poly3", tokens, "transfer", steps=STEPS)
    assert report.error_after[0] < report.error_before[0]


def test_an_unknown_option_is_refused_in_one_line_naming_the_closest_and_all_before_any_change():
    model = cm.llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnknownOptionError) as refused:
        convert(model, "poly3", cm.token_samples(batches=1), "transfer", step=50)
    assert str(refused.value) == (
        "convert has no option 'step' (did you mean 'steps'?); its options: method, qk, rank, lr, steps, patience, "
        "min_delta, holdout, check_every, layers_per_pass, seed, bias"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert attention_modules(model) == []  # not even switched
    # the task's recipe, built from a config's mapping, says the same of its own options
    with pytest.raises(
        UnknownOptionError,
        match=r"^convert has no option 'hold_out' \(did you mean 'holdout'\?\); "
        r"its options: qk, .*, method, samples, batch_size$",
    ):
        ConvertRecipe(**{"method": "transfer", "hold_out": 0.2})
    with pytest.raises(
        ConfigError,
        match=r"convert.holdout is the fraction of the samples held out, in \[0, 1\), "
        r"got 1.5",
    ):
        convert(model, "poly3", cm.token_samples(batches=1), "transfer", holdout=1.5)


def test_a_checkpoint_naming_the_recipe_by_its_package_still_loads(tmp_path, monkeypatch):
    """Checkpoints written while ``ConvertRecipe`` lived in ``conversion/__init__.py`` name it
    ``polyattn_lightning.conversion.ConvertRecipe``; a ``weights_only`` load still takes them."""
    recipe = ConvertRecipe(method="transfer", samples=8, steps=12)
    monkeypatch.setattr(ConvertRecipe, "__module__", "polyattn_lightning.conversion")  # the name pickle wrote then
    torch.save({"hyper_parameters": {"convert": recipe}}, tmp_path / "old.ckpt")
    monkeypatch.undo()
    with zipfile.ZipFile(tmp_path / "old.ckpt") as archive:
        pickled = archive.read(next(name for name in archive.namelist() if name.endswith("data.pkl")))
    assert b"polyattn_lightning.conversion\nConvertRecipe" in pickled
    assert ConvertRecipe.__module__ == "polyattn_lightning.conversion.recipe"
    loaded = load_checkpoint(tmp_path / "old.ckpt")
    assert loaded["hyper_parameters"]["convert"] == recipe
