"""What set_attention does not switch: refusals on the probe's evidence, strict=False, pooling heads, masks; a probe
input the model cannot take.

The refused classes are built alone (a ``Sequential`` with one switchable attention in front), each run
by its own probe forward, so the tests stay small.
"""
from __future__ import annotations

import logging
import re

import pytest
import timm
import torch
from timm.layers import Attention
from timm.layers.non_local_attn import NonLocalAttn
from timm.layers.split_attn import SplitAttn
from timm.models.coat import ConvRelPosEnc, FactorAttnConvRelPosEnc
from timm.models.crossvit import CrossAttention
from timm.models.efficientvit_mit import LiteMLA
from timm.models.eva import EvaAttention
from timm.models.gemma4_vit import Gemma4Attention
from timm.models.mobilevit import LinearSelfAttention
from timm.models.swiftformer import EfficientAdditiveAttention
from timm.models.volo import OutlookAttention
from torch import nn

from polyattn_lightning.attention.switch.base import ADAPTERS as _ADAPTERS
from polyattn_lightning.attention.switch.timm.tables import HAND_SOFTMAX
from polyattn_lightning.attention.switch.timm import AttentionRefused, ProbeInputError
from polyattn_lightning.attention import SwitchedAttention, set_attention
from polyattn_lightning.attention.switch.timm.probe import softmax_calls
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.tasks.classification import ClassificationModule
from timm_reference import MaterializedSDPA


class Tokens(nn.Module):
    """(B, N, C) -> (B, C, H, W) for the convolutional attention classes, and back."""

    def __init__(self, inner: nn.Module, side: int):
        super().__init__()
        self.inner, self.side = inner, side

    def forward(self, x):
        B, N, C = x.shape
        y = self.inner(x.transpose(1, 2).reshape(B, C, self.side, self.side))
        return y.flatten(2).transpose(1, 2)


class ChannelsLast(nn.Module):
    def __init__(self, inner: nn.Module, side: int):
        super().__init__()
        self.inner, self.side = inner, side

    def forward(self, x):
        B, N, C = x.shape
        return self.inner(x.reshape(B, self.side, self.side, C)).reshape(B, N, C)


NOT_TOKEN_ATTENTION = {
    "split attention": lambda: Tokens(SplitAttn(16, 16, radix=2), 4),
    "additive attention": lambda: Tokens(EfficientAdditiveAttention(16, 16), 4),
    "factorised attention": lambda: FactorAttnConvRelPosEnc(16, num_heads=2, shared_crpe=ConvRelPosEnc(8, 2, {3: 2})),
    "outlook attention": lambda: ChannelsLast(OutlookAttention(16, num_heads=2), 4),
    "already linear": lambda: Tokens(LiteMLA(16, 16, heads_ratio=1.0, dim=8), 4),
    "separable linear attention": lambda: Tokens(LinearSelfAttention(16), 4),
}
TIMM_NAMES = {
    "split attention": "timm.layers.split_attn.SplitAttn",
    "additive attention": "timm.models.swiftformer.EfficientAdditiveAttention",
    "factorised attention": "timm.models.coat.FactorAttnConvRelPosEnc",
    "outlook attention": "timm.models.volo.OutlookAttention",
    "already linear": "timm.models.efficientvit_mit.LiteMLA",
    "separable linear attention": "timm.models.mobilevit.LinearSelfAttention",
}


def _with_attention(other: nn.Module) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(16, num_heads=2), other)


def _tokens():
    return torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(0))


def _run(model, x, *args):
    if isinstance(model[1], FactorAttnConvRelPosEnc):  # it takes the grid size (and a class token)
        return model[1](torch.cat([x[:, :1], model[0](x)], dim=1), (4, 4))
    return model(x)


@pytest.mark.parametrize("kind", sorted(NOT_TOKEN_ATTENTION))
def test_what_is_not_token_attention_is_named_and_refused(kind):
    model, x = _with_attention(NOT_TOKEN_ATTENTION[kind]()), _tokens()
    with pytest.raises(AttentionRefused, match=re.escape(f"({TIMM_NAMES[kind]}): ")):
        set_attention(model, "poly3", probe=lambda: _run(model, x))
    assert type(model[0]) is Attention  # nothing changed

    caplog_line = []
    handler = logging.Handler()
    handler.emit = lambda record: caplog_line.append(record.getMessage())
    logger = logging.getLogger("polyattn_lightning.attention.switch.timm")
    logger.addHandler(handler)
    try:
        assert set_attention(model, "poly3", strict=False, probe=lambda: _run(model, x)) == 1
    finally:
        logger.removeHandler(handler)
    assert len(caplog_line) == 1 and TIMM_NAMES[kind] in caplog_line[0] and "stays softmax" in caplog_line[0]
    assert isinstance(model[0], SwitchedAttention) and not isinstance(model[1], SwitchedAttention)


def test_pooling_head_stays_softmax_by_decision_and_is_named(caplog):
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, global_pool="map",
                              num_classes=5).eval()
    with caplog.at_level(logging.INFO, logger="polyattn_lightning.attention.switch.timm"):
        assert set_attention(model, "poly3") == 2  # strict: a pooling head is no refusal
    [line] = [r.getMessage() for r in caplog.records if "stays softmax" in r.getMessage()]
    assert "attn_pool (timm.layers.attention_pool.AttentionPoolLatent): attention pooling head" in line
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        calls = softmax_calls(model, lambda: model(x))
    assert calls and all(c.stack[-1][0] == "attn_pool" for c in calls)


def test_hand_softmax_found_by_the_probe_refuses_with_the_class_path(monkeypatch):
    """CrossViT's CrossAttention computes softmax by hand; without its adapter only the probe sees it."""
    monkeypatch.delitem(_ADAPTERS, CrossAttention, raising=False)
    kwargs = dict(patch_size=[8, 16], embed_dim=[16, 32], depth=[[1, 1, 0]], num_heads=[2, 2], mlp_ratio=[1, 1, 1])
    with pytest.raises(ConfigError, match=r"\(timm\.models\.crossvit\.CrossAttention\): .*softmax.*attention_strict"):
        ClassificationModule("crossvit_tiny_240", num_classes=5, attention="poly3", img_size=32, model_kwargs=kwargs)
    module = ClassificationModule("crossvit_tiny_240", num_classes=5, attention="poly3", img_size=32,
                                  model_kwargs=kwargs, attention_strict=False)
    kinds = {type(m) for m in module.model.modules()}
    assert CrossAttention in kinds and any(issubclass(k, SwitchedAttention) for k in kinds)


def test_beit_attention_is_named_with_its_module_path():
    """A BEiT model switches; a class nobody reviewed would be named ``timm.models.beit.Attention``, not "Attention"."""
    from timm_families import images, make

    model, x = make("beit"), images("beit")
    removed = _ADAPTERS.pop(timm.models.beit.Attention)
    try:
        with pytest.raises(AttentionRefused, match=r"blocks\.0\.attn, blocks\.1\.attn \(timm\.models\.beit\.Attention\)"):
            set_attention(model, "poly3", probe=lambda: model(x))
    finally:
        _ADAPTERS[timm.models.beit.Attention] = removed
    assert set_attention(model, "poly3", probe=lambda: model(x)) == 2


@pytest.mark.parametrize("mask_kind", ["-inf", "finfo.min", "bool"])
def test_masked_keys_contribute_nothing_and_are_not_counted(mask_kind):
    """EVA attention with a padding mask: N = unmasked keys; what a masked key holds cannot change the output."""
    torch.manual_seed(0)
    module = EvaAttention(16, num_heads=2, num_prefix_tokens=0, scale_norm=False).eval()
    x = torch.randn(2, 6, 16)
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[1, ..., 4:] = False
    if mask_kind == "bool":
        mask = keep
    else:
        fill = float("-inf") if mask_kind == "-inf" else torch.finfo(torch.float32).min
        mask = torch.zeros(2, 1, 1, 6).masked_fill(~keep, fill)
    mode = MaterializedSDPA("poly3")
    with torch.no_grad(), mode:
        expected = module(x, attn_mask=mask)
    set_attention(module, "poly3")
    changed = x.clone()
    changed[1, 4:] = torch.randn(2, 16)  # the masked keys (and their queries' rows, which are not compared)
    with torch.no_grad():
        out, out_changed = module(x, attn_mask=mask), module(changed, attn_mask=mask)
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(out[1, :4], out_changed[1, :4])


def test_a_mask_kind_off_the_reviewed_list_is_an_error():
    torch.manual_seed(0)
    module = Gemma4Attention(16, num_heads=2, head_dim=8).eval()  # reviewed with 0/-inf padding masks only
    set_attention(module, "poly3")
    x = torch.randn(1, 4, 16)
    cos, sin = torch.ones(1, 4, 8), torch.zeros(1, 4, 8)
    with pytest.raises(TypeError, match="bool attn_mask.*review the class again"):
        module(x, cos, sin, attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.bool))


def test_hand_softmax_lists_only_classes_without_an_adapter_and_refuses_them_unprobed():
    """An adapted class is switched before the table is read, so an entry for it would be stale."""
    assert HAND_SOFTMAX and not set(HAND_SOFTMAX) & set(_ADAPTERS)
    torch.manual_seed(0)
    model = nn.Sequential(Attention(16, num_heads=2), NonLocalAttn(16))
    refusal = r"1 \(timm\.layers\.non_local_attn\.NonLocalAttn\): computes softmax by hand"
    with pytest.raises(AttentionRefused, match=refusal):
        set_attention(model, "poly3", probe=False)
    assert type(model[0]) is Attention


def tiny_vit(img_size: int = 32) -> nn.Module:
    return timm.create_model("vit_tiny_patch16_224", img_size=img_size, patch_size=8, depth=1, embed_dim=16,
                             num_heads=1, num_classes=2)


def test_a_given_probe_that_fails_on_the_model_as_built_is_an_error_naming_the_class_and_why():
    model = tiny_vit(32)
    wrong_size = torch.randn(1, 3, 48, 48)
    with pytest.raises(ProbeInputError, match=r"^VisionTransformer cannot run one forward on the probe input, "
                                              r"switched or not \(AssertionError: Input height \(48\)"):
        set_attention(model, "poly3", probe=lambda: model(wrong_size))
    assert not any(isinstance(module, SwitchedAttention) for module in model.modules())  # nothing changed


def test_a_probe_that_fails_only_on_the_switched_model_keeps_its_own_error():
    """Then a switch is to blame, not the input: the error is not made a config error."""
    model = tiny_vit(32)

    def probe():
        if any(isinstance(module, SwitchedAttention) for module in model.modules()):
            raise RuntimeError("an adapter's bug")
        return model(torch.randn(1, 3, 32, 32))

    with pytest.raises(RuntimeError, match="an adapter's bug") as raised:
        set_attention(model, "poly3", probe=probe)
    assert not isinstance(raised.value, ConfigError)
