"""The generic SDPA switch on every family of its reviewed list (tiny builds from ``timm_families``).

Per family: softmax gives timm's own outputs; poly3 and relu equal timm's own forward with SDPA
materialized as ``phi(S) @ v`` (``timm_reference``); the probe finds no softmax left; weights and
state_dict keys are unchanged; one AdamW step trains every parameter the forward uses.
"""
from __future__ import annotations

import inspect

import pytest
import timm
import torch

from polyattn_lightning.attention.timm_patch import attention_modules, set_attention
from polyattn_lightning.attention.timm_probe import softmax_calls
from polyattn_lightning.attention.timm_sdpa import GENERIC, REVIEWED
from timm_families import GENERIC_FAMILIES, images, make
from timm_reference import reference_forward

FAMILIES = sorted(GENERIC_FAMILIES)


def switch(model, activation, x):
    """set_attention with the probe run on the test's own images (the model's default size can be large)."""
    return set_attention(model, activation, probe=lambda: model(x))


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_is_timms_own_and_the_probe_finds_no_softmax_left(family):
    model, x = make(family), images(family)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        expected = model(x)
        switched = switch(model, "softmax", x)
        assert switched == len(attention_modules(model)) > 0
        assert torch.allclose(model(x), expected, atol=1e-5, rtol=1e-4)
    state = model.state_dict()
    assert list(state) == list(original) and all(torch.equal(state[k], original[k]) for k in original)

    switch(model, "poly3", x)
    with torch.no_grad():
        assert softmax_calls(model, lambda: model(x)) == []


@pytest.mark.parametrize("activation", ["poly3", "relu"])
@pytest.mark.parametrize("family", FAMILIES)
def test_activation_matches_timms_forward_with_materialized_attention(family, activation):
    x = images(family)
    expected = reference_forward(make(family), x, activation)
    model = make(family)
    switch(model, activation, x)
    with torch.no_grad():
        out = model(x)
    scale = expected.abs().max().clamp_min(1.0)
    assert (out - expected).abs().max() <= 1e-4 * scale, (out - expected).abs().max()


@pytest.mark.parametrize("family", FAMILIES)
def test_one_training_step(family):
    model, x = make(family), images(family)
    switch(model, "poly3", x)
    model.train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = torch.nn.functional.cross_entropy(model(x), torch.tensor([0, 1]))
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert torch.isfinite(loss) and grads and all(torch.isfinite(g).all() for g in grads.values())
    optimizer.step()
    attention_params = {f"{name}.{p}" for name, m in attention_modules(model) for p, _ in m.named_parameters()}
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert attention_params & set(grads) <= moved and attention_params & moved


def test_reviewed_forwards_are_the_sources_read():
    """A timm release that changes a reviewed forward fails here: read it again, then update the digest."""
    import hashlib

    digests = {entry.name: hashlib.sha256(inspect.getsource(entry.cls.forward).encode()).hexdigest()[:12]
               for entry in REVIEWED}
    assert digests == REVIEWED_DIGESTS, {k: v for k, v in digests.items() if REVIEWED_DIGESTS.get(k) != v}
    assert set(GENERIC) == {entry.cls for entry in REVIEWED if entry.covers()}
    assert not any(entry.covers("1.1.0") for entry in REVIEWED)


#: sha256 (first 12 hex digits) of each reviewed class's ``forward`` source in timm 1.0.31.
REVIEWED_DIGESTS: dict[str, str] = {
    "timm.layers.attention.Attention": "37a80e0fdf45",
    "timm.layers.attention.AttentionRope": "3f742ca1632d",
    "timm.layers.diff_attention.DiffAttention": "8cd7d972c9b3",
    "timm.models.vision_transformer.ParallelScalingBlock": "19c3e45701ce",
    "timm.models.vision_transformer.DiffParallelScalingBlock": "a7703a3f0bfd",
    "timm.layers.attention2d.MultiQueryAttention2d": "b83cd9056e1f",
    "timm.layers.attention2d.Attention2d": "f4c6a3147504",
    "timm.models.eva.EvaAttention": "ab5e17e344c3",
    "timm.models.beit.Attention": "0bcb86fe6e1f",
    "timm.models.davit.WindowAttention": "f612770d6f76",
    "timm.models.hiera.MaskUnitAttention": "8cb10f7eac34",
    "timm.models.hieradet_sam2.MultiScaleAttention": "86768a056b44",
    "timm.models.maxxvit.Attention2d": "254089d4c16b",
    "timm.models.maxxvit.AttentionCl": "4213588190ad",
    "timm.models.pvt_v2.Attention": "7e415347d098",
    "timm.models.twins.LocallyGroupedAttn": "06ac705f2065",
    "timm.models.twins.GlobalSubSampleAttn": "daa38e9fe4cd",
    "timm.models.nest.Attention": "5d6e3635838a",
    "timm.models.tiny_vit.Attention": "cf4dd12800fc",
    "timm.models.visformer.Attention": "50555ffecad5",
    "timm.models.vision_transformer_relpos.RelPosAttention": "a38419a4d20b",
    "timm.models.vision_transformer_sam.Attention": "f78e46f655c9",
    "timm.models.metaformer.Attention": "34e7a9fc0fd0",
    "timm.models.nextvit.EfficientAttention": "f715e3ff71a6",
    "timm.models.cait.ClassAttn": "e8bf85de797e",
    "timm.models.volo.Attention": "f4f938bc0913",
    "timm.models.cpubone.ConvAttention": "168832e9d4a5",
    "timm.models.gemma4_vit.Gemma4Attention": "757651502e37",
    "timm.models.iformer.SHMA": "107b2a76063f",
    "timm.models.lowformer.ConvAttention": "74a929e762a6",
    "timm.models.fastvit.Attention": "06e65a430a2a",
    "timm.models.xcit.XCA": "353312bdd2b6",
}


def test_unswitched_instances_keep_sdpa_and_timm_is_not_patched():
    model, other, x = make("eva02"), make("eva02"), images("eva02")
    switch(model, "poly3", x)
    assert torch.nn.functional.scaled_dot_product_attention.__module__ != __name__
    assert timm.models.eva.F is torch.nn.functional
    with torch.no_grad():
        calls = softmax_calls(other, lambda: other(x))
    assert [c.function for c in calls] == ["scaled_dot_product_attention"] * len(other.blocks)
