"""set_attention on tiny timm models: softmax parity, poly3 behaviour, weights, capture hook."""
from __future__ import annotations

import pickle

import pytest
import timm
import torch
from timm.layers import Attention, AttentionRope
from timm.models.cait import ClassAttn
from timm.models.swin_transformer import WindowAttention
from timm.models.xcit import XCA
from torch import nn

from polyattn_lightning.attention import attention
from polyattn_lightning.attention.switch.timm.sdpa import (
    Switched_cait_ClassAttn as ClassAttention,
    Switched_xcit_XCA as XCiTAttention,
)
from polyattn_lightning.attention.switch.timm.families.swin import SwinWindowAttention
from polyattn_lightning.attention.switch.base import attention_map
from polyattn_lightning.attention import attention_modules, set_attention

TIMM_ATTENTION = (Attention, WindowAttention, XCA, ClassAttn)

# Small enough for CPU; each still runs its family's attention classes.
FAMILIES = {
    "vit": ("vit_small_patch16_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, qk_norm=True)),
    "deit": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, depth=2)),
    # 14 x 14 tokens in 7 x 7 windows: the second block of stage 1 uses shifted windows.
    "swin": ("swin_tiny_patch4_window7_224", dict(img_size=56, embed_dim=24, depths=(2, 2), num_heads=(1, 2))),
    "xcit": ("xcit_nano_12_p16_224", dict(img_size=32, depth=2)),
}
NUM_CLASSES = 5


def make(family: str) -> nn.Module:
    name, kwargs = FAMILIES[family]
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=NUM_CLASSES, **kwargs).eval()


def images(family: str) -> torch.Tensor:
    size = FAMILIES[family][1]["img_size"]
    return torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_matches_timm_and_counts_every_attention(family):
    model, x = make(family), images(family)
    expected = sum(isinstance(m, TIMM_ATTENTION) for m in model.modules())
    with torch.no_grad():
        reference = model(x)
        assert set_attention(model, "softmax") == expected == len(attention_modules(model))
        assert (model(x) - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_poly3_trains_and_softmax_restores(family):
    model, x = make(family), images(family)
    with torch.no_grad():
        reference = model(x)
    set_attention(model, "poly3")
    assert all(m.activation.name == "poly3" for _, m in attention_modules(model))
    out = model(x)
    assert torch.isfinite(out).all() and (out - reference).abs().max() > 1e-3
    out.square().mean().backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    if family == "xcit":  # the learnable temperature is folded into q, not cut from the graph
        assert all(m.temperature.grad.abs().sum() > 0 for m in model.modules() if isinstance(m, XCA))

    set_attention(model, "softmax")
    with torch.no_grad():
        assert (model(x) - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_load_from_a_local_pretrained_file(family, tmp_path):
    """Keys unchanged by the switch; timm's pretrained path (file overlay, no network) then switch keeps weights."""
    original = make(family).state_dict()
    path = tmp_path / "weights.pth"
    torch.save(original, path)
    name, kwargs = FAMILIES[family]
    overlay = dict(file=str(path), num_classes=NUM_CLASSES)  # num_classes kept, or timm drops the head
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=NUM_CLASSES, **kwargs)
    set_attention(model, "poly3")
    switched = model.state_dict()
    assert list(switched) == list(original)
    assert all(torch.equal(switched[k], original[k]) for k in original)
    model.load_state_dict(original, strict=True)


def test_switched_model_pickles():
    """The module keeps the activation spec (registry activations hold lambdas), so whole-model saves work."""
    model, x = make("vit"), images("vit")
    set_attention(model, {"name": "poly3", "scale": 1 / 14})
    with torch.no_grad():
        assert torch.equal(pickle.loads(pickle.dumps(model))(x), model(x))


def test_swin_masked_pairs_contribute_nothing():
    """One shifted WindowAttention with poly3 against a reference written out here."""
    block = next(b for b in make("swin").modules() if type(b).__name__ == "SwinTransformerBlock" and any(b.shift_size))
    module, mask = block.attn, block.attn_mask  # mask: (num_windows, N, N), 0 or -100
    assert (mask != 0).any()
    num_windows, N, _ = mask.shape
    x = torch.randn(2 * num_windows, N, module.dim)

    heads = module.num_heads
    q, k, v = module.qkv(x).reshape(2 * num_windows, N, 3, heads, -1).permute(2, 0, 3, 1, 4)
    table = module.relative_position_bias_table[module.relative_position_index.view(-1)]
    bias = table.view(N, N, heads).permute(2, 0, 1)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5 + bias
    allowed = (mask == 0).repeat(2, 1, 1)[:, None]  # window b * num_windows + w uses mask[w]
    weights = scores.pow(3) * allowed / allowed.sum(-1, keepdim=True).sqrt()
    expected = module.proj((weights @ v).transpose(1, 2).reshape(2 * num_windows, N, -1))

    set_attention(module, "poly3")
    with torch.no_grad():
        assert torch.allclose(module(x, mask), expected, atol=1e-5)


def test_vit_attention_masks_and_causal_match_timm():
    torch.manual_seed(0)
    module = Attention(16, num_heads=2, qkv_bias=True).eval()
    x = torch.randn(2, 5, 16)
    keep = torch.rand(2, 1, 5, 5) > 0.3
    keep[..., 0] = True  # every query keeps a key
    with torch.no_grad():
        references = [module(x, attn_mask=keep), module(x, is_causal=True)]
        set_attention(module, "softmax")
        outputs = [module(x, attn_mask=keep), module(x, is_causal=True)]
        assert all((o - r).abs().max() <= 1e-5 for o, r in zip(outputs, references))

        set_attention(module, "poly3")  # causal: later tokens cannot change earlier outputs
        changed = torch.cat([x[:, :3], torch.randn(2, 2, 16)], dim=1)
        assert torch.allclose(module(x, is_causal=True)[:, :3], module(changed, is_causal=True)[:, :3])


def test_attention_dropout_only_in_training():
    module = Attention(16, num_heads=2, attn_drop=0.5)
    set_attention(module, "poly3")
    x = torch.randn(2, 5, 16)
    assert not torch.equal(module(x), module(x))
    module.eval()
    assert torch.equal(module(x), module(x))


def test_models_without_supported_attention_are_refused():
    with pytest.raises(ValueError, match="ResNet has no attention"):
        set_attention(timm.create_model("resnet10t", num_classes=NUM_CLASSES), "poly3")
    with pytest.raises(ValueError, match="Sequential has no attention"):
        set_attention(nn.Sequential(nn.Linear(4, 4)), "poly3")
    # A half-switched model would silently keep softmax somewhere: refused, and nothing is changed.
    mixed = nn.Sequential(Attention(16, num_heads=2), AttentionRope(16, num_heads=2), Unreviewed())
    with pytest.raises(ValueError, match=r"2 \(test_set_attention.Unreviewed\): runs softmax attention \(timm's fused_attn"):
        set_attention(mixed, "poly3")
    assert type(mixed[0]) is Attention and type(mixed[1]) is AttentionRope


class Unreviewed(nn.Module):
    """An attention with timm's ``fused_attn`` flag that no switch covers."""

    fused_attn = True

    def forward(self, x):
        return nn.functional.scaled_dot_product_attention(x[:, None], x[:, None], x[:, None])[:, 0]


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_hook_sees_what_is_attended(family):
    model, x = make(family), images(family)
    set_attention(model, "poly3")
    captured = []
    for _, module in attention_modules(model):
        module.capture = lambda module, inputs: captured.append((type(module), inputs))
    with torch.no_grad():
        model(x)
        set_attention(model, "softmax")  # re-switching keeps the hooks
        model(x)
    assert len(captured) == 2 * len(attention_modules(model))

    for kind, inputs in captured[: len(captured) // 2]:
        q, k, v = inputs.q, inputs.k, inputs.v
        assert q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]
        if kind is SwinWindowAttention:  # a batch of windows; the bias is per head, the mask per window
            B_, heads, N, _ = q.shape
            assert B_ % len(x) == 0 and inputs.attn_bias.shape == (1, heads, N, N)
            assert inputs.attn_mask is None or inputs.attn_mask.shape == (B_, 1, N, N)
        else:
            assert q.shape[0] == len(x)
        if kind is XCiTAttention:  # the d x d channel map: one "token" per channel of a head
            assert q.shape[1] * q.shape[2] == model.embed_dim and inputs.temperature == 1.0
        if kind is ClassAttention:
            assert q.shape[2] == 1
        weights = attention_map(inputs, "poly3")
        assert weights.shape[-2:] == (q.shape[-2], k.shape[-2])
        expected = attention(
            q, k, v, "poly3", temperature=inputs.temperature, attn_mask=inputs.attn_mask, attn_bias=inputs.attn_bias
        )
        assert torch.allclose(weights @ v, expected, atol=1e-5)
    for _, inputs in captured[len(captured) // 2 :]:
        assert torch.allclose(attention_map(inputs, "softmax").sum(-1), torch.ones(()), atol=1e-5)
