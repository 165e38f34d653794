"""The explicit adapters of timm's hand-computed attention (``attention/switch/timm/families``) on tiny models.

The reference for a non-softmax activation is timm's own, unmodified forward run under
:class:`SoftmaxAs`, a ``TorchFunctionMode`` that replaces its softmax by the tests' ``phi`` (masked keys
zero, N = the unmasked keys), so no family's forward is copied here. Classes that do more than a
softmax of ``q k^T`` (talking heads, ConViT's gate, Swin V2's cosine attention with a shift mask) get a
reference written from the formula as well.
"""
from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers.bottleneck_attn import BottleneckAttn
from timm.layers.halo_attn import HaloAttn
from timm.models import convit, davit, gcvit, mvitv2, swin_transformer_v2, volo
from torch import nn
from torch.overrides import TorchFunctionMode

from polyattn_lightning.attention import attention
from polyattn_lightning.diagnostics.norms import attention_norms
from polyattn_lightning.attention.switch.base import ADAPTERS as _ADAPTERS, attention_map
from polyattn_lightning.attention import SwitchedAttention, set_attention
from polyattn_lightning.attention.switch.timm.probe import built_size  # importing switch.timm registers every adapter
from polyattn_lightning.callbacks import AttentionNorms
from polyattn_lightning.diagnostics.maps import collect_maps

import timm_families
from attention_reference import FORMULAS

NUM_CLASSES = 5


def _mvit():
    cfg = mvitv2.MultiScaleVitCfg(depths=(1, 2), embed_dim=16, num_heads=(1, 2), use_cls_token=True)
    return mvitv2.MultiScaleVit(cfg, img_size=(32, 32), num_classes=NUM_CLASSES)


def _gcvit():
    return gcvit.GlobalContextVit(
        img_size=64, window_ratio=(8, 16, 16, 32), embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 2, 2),
        num_classes=NUM_CLASSES,
    )


def _volo_class_attention():
    """VOLO's class attention alone (its self-attention is the generic SDPA switch's, its outlook attention
    no dot-product attention)."""
    return nn.Sequential(volo.ClassAttention(16, num_heads=2))


def _davit_channels():
    """DaViT's two channel attentions alone (its window attention is the generic SDPA switch's)."""
    return nn.Sequential(davit.ChannelAttention(16, num_heads=2), davit.ChannelAttentionV2(16, num_heads=2))


def _byoanet_layers():
    """BoTNet's and HaloNet's attention layers (``timm.layers``), the second with ``scale_pos_embed``."""
    return nn.Sequential(
        BottleneckAttn(8, 16, feat_size=(4, 4), num_heads=2),
        HaloAttn(16, 16, num_heads=2, block_size=2, halo_size=1, scale_pos_embed=True),
    )


def _timm(name, **kwargs):
    return lambda: timm.create_model(name, num_classes=NUM_CLASSES, **kwargs)


# family: (build, input shape); each runs every adapted class of its family at a tiny size.
FAMILIES = {
    "swin_v2": (_timm("swinv2_tiny_window8_256", img_size=32, embed_dim=24, depths=(2, 2), num_heads=(1, 2), window_size=4), (2, 3, 32, 32)),
    "swin_v2_cr": (_timm("swinv2_cr_tiny_224", img_size=32, embed_dim=24, depths=(2, 2), num_heads=(1, 2), window_size=4), (2, 3, 32, 32)),
    "cait": (_timm("cait_xxs24_224", img_size=32, patch_size=8, depth=2, depth_token_only=1, embed_dim=48, num_heads=4), (2, 3, 32, 32)),
    "efficientformer_v2": (_timm("efficientformerv2_s0", img_size=64, depths=(1, 1, 1, 2), embed_dims=(8, 16, 24, 32), num_vit=2), (2, 3, 64, 64)),
    "crossvit": (_timm("crossvit_tiny_240", img_size=48, img_scale=(1.0, 1.0), patch_size=[12, 16], embed_dim=[24, 48], depth=[[1, 1, 0]], num_heads=[2, 2], mlp_ratio=[2, 2, 1]), (2, 3, 48, 48)),
    "csatv2": (_timm("csatv2", dims=(8, 16, 24, 32), depths=(1, 1, 1, 1), transformer_depths=(0, 0, 1, 1)), (2, 3, 64, 64)),
    "mvitv2": (_mvit, (2, 3, 32, 32)),
    "levit": (_timm("levit_128s", img_size=64, embed_dim=(16, 24, 32), key_dim=8, num_heads=(2, 2, 2), depth=(1, 1, 1)), (2, 3, 64, 64)),
    "levit_conv": (_timm("levit_conv_128s", img_size=64, embed_dim=(16, 24, 32), key_dim=8, num_heads=(2, 2, 2), depth=(1, 1, 1)), (2, 3, 64, 64)),
    "efficientformer": (_timm("efficientformer_l1", depths=(1, 1, 1, 2), embed_dims=(8, 16, 24, 32), num_vit=1), (2, 3, 224, 224)),
    "efficientvit_msra": (_timm("efficientvit_m0", img_size=64, embed_dim=[16, 24, 32], depth=[1, 1, 1], num_heads=[2, 2, 2], window_size=[4, 4, 4]), (2, 3, 64, 64)),
    "convit": (_timm("convit_tiny", img_size=32, patch_size=8, depth=3, local_up_to_layer=2, embed_dim=16, num_heads=4), (2, 3, 32, 32)),
    "gcvit": (_gcvit, (2, 3, 64, 64)),
    "tnt": (_timm("tnt_s_patch16_224", img_size=32, patch_size=8, embed_dim=32, inner_dim=8, depth=2, num_heads_outer=2, num_heads_inner=2), (2, 3, 32, 32)),
    "volo": (_volo_class_attention, (2, 10, 16)),
    "byoanet": (_byoanet_layers, (2, 8, 4, 4)),
    "davit_channels": (_davit_channels, (2, 10, 16)),
    "edgenext": (_timm("edgenext_xx_small", depths=(1, 1, 1, 1), dims=(8, 16, 24, 32), heads=(2, 2, 2, 2)), (2, 3, 64, 64)),
    "shvit": (_timm("shvit_s1", embed_dim=(16, 24, 32), depth=(1, 1, 1), partial_dim=(8, 8, 8)), (2, 3, 64, 64)),
}


def make(family: str, randomize: bool = True) -> nn.Module:
    """The family's tiny model in eval mode; ``randomize``: weights of O(1) activations (timm's init makes some
    attention outputs vanish: zero-initialised biases, layer scales of 1e-5, zero post-norms)."""
    torch.manual_seed(0)
    model = FAMILIES[family][0]().eval()
    if randomize:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() >= 2:
                    p.normal_(0.0, p[0].numel() ** -0.5)
                else:
                    p.add_(0.3 * torch.randn_like(p))
    return model


def inputs(family: str) -> torch.Tensor:
    return torch.randn(FAMILIES[family][1], generator=torch.Generator().manual_seed(1))


def switch(model: nn.Module, activation: str, x: torch.Tensor) -> int:
    """set_attention with a probe forward on ``x`` (the probe's default, timm's pretrained input size, is not
    the tiny test models' size)."""

    def probe():
        with torch.no_grad():
            model(x)

    return set_attention(model, activation, probe=probe)


def output(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = model(x)
    return out[0] if isinstance(out, tuple) else out  # VOLO / LeViT training heads


def adapted(model: nn.Module) -> list[nn.Module]:
    """The modules of the classes adapted by hand in ``switch/timm/families`` (Swin V1 aside, switched elsewhere)."""
    return [m for m in model.modules() if type(m) in _ADAPTERS and _ADAPTERS[type(m)].__module__.startswith(
        "polyattn_lightning.attention.switch.timm.families") and not type(m).__module__.endswith(".swin")]


SOFTMAX = {torch.Tensor.softmax, torch.softmax, F.softmax, torch.special.softmax}


class SoftmaxAs(TorchFunctionMode):
    """Counts softmax and SDPA calls; with ``name``, every softmax of the scores ``S`` returns the tests'
    ``phi(S)`` instead, ``allowed`` (bool, broadcast to ``S``) zeroing masked keys and counting N."""

    def __init__(self, name: str | None = None, allowed: torch.Tensor | None = None):
        super().__init__()
        self.name, self.allowed, self.calls = name, allowed, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in SOFTMAX or func is F.scaled_dot_product_attention:
            self.calls += 1
        if func in SOFTMAX and self.name is not None:
            scores, dim = args[0], kwargs.get("dim", args[1] if len(args) > 1 else None)
            assert dim in (-1, scores.dim() - 1), "a softmax over keys"
            keep = torch.ones_like(scores, dtype=torch.bool) if self.allowed is None else self.allowed.expand(scores.shape)
            return FORMULAS[self.name](scores, keep.sum(-1, keepdim=True).to(scores.dtype)) * keep
        return func(*args, **kwargs)


def recorded_calls(model: nn.Module, x: torch.Tensor) -> list[tuple[nn.Module, tuple, dict]]:
    """``(module, args, kwargs)`` of every adapted module's call in one forward of the unswitched model."""
    calls, hooks = [], []
    for module in adapted(model):
        hook = lambda m, args, kwargs: calls.append((m, args, kwargs))  # noqa: E731
        hooks.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    return calls


def shift_mask_keep(module: nn.Module, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """Swin's 0/-100 window mask as "may attend", for the window rows of this call (batch-major)."""
    mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
    if mask is None:
        return None
    return (mask == 0).repeat(args[0].shape[0] // mask.shape[0], 1, 1)[:, None]


# --------------------------------------------------------------------------- every family


@pytest.mark.parametrize("family", FAMILIES)
def test_softmax_matches_timm_after_switching_back_and_forth(family):
    model, x = make(family), inputs(family)
    assert adapted(model), f"{family}: no adapted class in the test model"
    with torch.no_grad():
        reference = output(model, x)
        switched = switch(model, "relu", x)  # bounded: poly3 overflows LeViT at O(1) weights (no norm)
        assert switched == len([m for m in model.modules() if isinstance(m, SwitchedAttention)])
        assert (output(model, x) - reference).abs().max() > 1e-3
        assert switch(model, "softmax", x) == switched  # switching again re-switches
        assert (output(model, x) - reference).abs().max() <= 1e-5


@pytest.mark.parametrize("name", ["poly3", "relu"])
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "convit"])
def test_phi_matches_timm_forward_with_softmax_replaced(family, name):
    """Every adapted module against timm's own forward, its softmax replaced by the reference phi."""
    model, x = make(family), inputs(family)
    calls = recorded_calls(model, x)
    keep = shift_mask_keep if family.startswith("swin") else (lambda *_: None)
    masked = 0
    for module, args, kwargs in calls:
        allowed = keep(module, args, kwargs)
        masked += allowed is not None and not bool(allowed.all())
        with torch.no_grad(), SoftmaxAs(name, allowed) as mode:
            reference = module(*args, **kwargs)
        assert mode.calls >= 1
        set_attention(module, name)
        with torch.no_grad():
            out = module(*args, **kwargs)
        out, reference = (o[0] if isinstance(o, tuple) else o for o in (out, reference))  # MViT: (x, size)
        torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)
    if family.startswith("swin"):
        assert masked, "the test model should have a shifted-window block"


@pytest.mark.parametrize("family", FAMILIES)
def test_no_softmax_left_weights_kept_and_one_training_step(family):
    model, x = make(family, randomize=False), inputs(family)
    with torch.no_grad(), SoftmaxAs() as before:
        model(x)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    switch(model, "poly3", x)
    state = model.state_dict()
    assert list(state) == list(original) and all(torch.equal(state[k], original[k]) for k in original)
    with torch.no_grad(), SoftmaxAs() as after:
        model(x)
    gated = sum(isinstance(m, convit.GPSA) for m in model.modules())  # its positional softmax stays, by decision
    assert before.calls > 0 and after.calls == gated

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    labels = torch.arange(len(x)) % NUM_CLASSES
    logits = output(model, x)
    loss = F.cross_entropy(logits, labels) if logits.dim() == 2 else logits.square().mean()
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    for module in adapted(model):  # the gradient reaches every switched layer's weights
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters()), type(module)
    optimizer.step()
    assert not all(torch.equal(v, original[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", FAMILIES)
def test_capture_gives_what_the_diagnostics_need(family):
    model, x = make(family), inputs(family)
    switch(model, "poly3", x)
    captured = []
    for module in adapted(model):
        module.capture = lambda module, got: captured.append((module, got))
    with torch.no_grad():
        model(x)
    assert {id(m) for m, _ in captured} == {id(m) for m in adapted(model)}
    for module, got in captured:
        q, k, v = got.q, got.k, got.v
        assert q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[-1] == k.shape[-1] and k.shape[-2] == v.shape[-2]
        weights = attention_map(got, "poly3")
        assert weights.shape[-2:] == (q.shape[-2], k.shape[-2]) and torch.isfinite(weights).all()
        expected = attention(q, k, v, "poly3", temperature=got.temperature, attn_mask=got.attn_mask, attn_bias=got.attn_bias)
        torch.testing.assert_close(weights @ v.float(), expected, atol=1e-4, rtol=1e-4)
        norms = attention_norms(q, k, "poly3", temperature=got.temperature, attn_mask=got.attn_mask, attn_bias=got.attn_bias)
        assert norms.phi.shape == (q.shape[1],) and torch.isfinite(norms.phi).all() and (norms.phi > 0).all()


@pytest.mark.parametrize("family", ["swin_v2", "swin_v2_cr", "mvitv2", "edgenext", "cait"])
def test_norm_and_map_callbacks_read_the_new_layouts(family):
    """Windows are stitched back onto the feature map, channel maps get no token map, pooled keys a map."""
    model, x = make(family), inputs(family)
    switch(model, "relu", x)
    layers = len([m for m in model.modules() if isinstance(m, SwitchedAttention)])
    metrics = AttentionNorms().measure(model, x)
    assert metrics and all(math.isfinite(v) for v in metrics.values())
    maps = collect_maps(model, x)
    assert len(maps) == layers and all(torch.isfinite(m.heat).all() for m in maps)
    if family.startswith("swin"):  # 8 x 8 then 4 x 4 tokens, in 4 x 4 windows
        assert [tuple(m.tokens.shape) for m in maps] == [(2, 8, 8)] * 2 + [(2, 4, 4)] * 2
    if family == "edgenext":
        assert all(m.channels and m.tokens is None for m in maps if m.layer.module.map_layout == "channels")


# --------------------------------------------------------------------------- written references


def test_swin_v2_shifted_windows_from_the_formula():
    """Cosine attention: ``phi(cos(q, k) * tau_h + 16 sigmoid(cpb)) * allowed @ v``, N = unmasked keys."""
    model = make("swin_v2")
    block = next(b for b in model.modules() if isinstance(b, swin_transformer_v2.SwinTransformerV2Block) and any(b.shift_size))
    module, mask = block.attn, block.attn_mask
    windows, N, _ = mask.shape
    assert (mask != 0).any() and (mask == 0).sum(-1).min() < N  # some rows have masked keys
    x = torch.randn(2 * windows, N, module.dim)
    with torch.no_grad():
        qkv = F.linear(x, module.qkv.weight, torch.cat((module.q_bias, module.k_bias, module.v_bias)))
        q, k, v = qkv.reshape(2 * windows, N, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        tau = module.logit_scale.clamp(max=math.log(100)).exp()
        table = module.cpb_mlp(module.relative_coords_table).view(-1, module.num_heads)
        bias = 16 * torch.sigmoid(table[module.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1))
        scores = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1) * tau + bias
        allowed = (mask == 0).repeat(2, 1, 1)[:, None]
        weights = scores.pow(3) * allowed / allowed.sum(-1, keepdim=True).sqrt()
        expected = module.proj((weights @ v).transpose(1, 2).reshape(2 * windows, N, -1))
        set_attention(module, "poly3")
        torch.testing.assert_close(module(x, mask), expected, atol=1e-4, rtol=1e-4)
        # a masked key contributes nothing: in a window split by the shift, changing the tokens of the other
        # regions leaves the outputs of token 0's region alone
        w = int((mask != 0).flatten(1).any(-1).nonzero()[0])
        keep = mask[w, 0] == 0
        changed = x.clone()
        changed[w, ~keep] += torch.randn_like(changed[w, ~keep])
        out, out_changed = module(x, mask), module(changed, mask)
        assert not torch.allclose(out[w, ~keep], out_changed[w, ~keep])
        torch.testing.assert_close(out[w, keep], out_changed[w, keep])


def test_cait_talking_heads_from_the_formula_and_its_capture():
    """``proj_w(phi(proj_l(q k^T * scale))) @ v``, the heads mixed by ``einsum`` here."""
    module = next(m for m in make("cait").modules() if type(m).__name__ == "TalkingHeadAttn")
    x = torch.randn(2, 17, 48)
    with torch.no_grad():
        B, N, C = x.shape
        q, k, v = module.qkv(x).reshape(B, N, 3, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-2, -1) * module.scale
        mixed = torch.einsum("gh,bhij->bgij", module.proj_l.weight, scores) + module.proj_l.bias[:, None, None]
        phi = FORMULAS["poly3"](mixed, torch.tensor(float(N)))
        weights = torch.einsum("gh,bhij->bgij", module.proj_w.weight, phi) + module.proj_w.bias[:, None, None]
        expected = module.proj((weights @ v).transpose(1, 2).reshape(B, N, C))
        set_attention(module, "poly3")
        captured = []
        module.capture = lambda m, got: captured.append(got)
        torch.testing.assert_close(module(x), expected, atol=1e-4, rtol=1e-4)
        # the capture holds the scores phi acts on (after the first head mixing)
        torch.testing.assert_close(attention_map(captured[0], "poly3"), phi, atol=1e-4, rtol=1e-4)


def test_convit_gpsa_switches_the_content_map_and_keeps_the_positional_one():
    """``(1 - g) phi(q k^T * scale) @ v + g softmax(P) @ v``; with softmax timm's renormalised mix."""
    module = next(m for m in make("convit").modules() if isinstance(m, convit.GPSA))
    x = torch.randn(2, 16, module.dim)
    with torch.no_grad():
        module(x)  # timm builds rel_indices on the first call
        B, N, C = x.shape
        q, k = module.qk(x).reshape(B, N, 2, module.num_heads, -1).permute(2, 0, 3, 1, 4)
        v = module.v(x).reshape(B, N, module.num_heads, -1).transpose(1, 2)
        content = FORMULAS["poly3"](q @ k.transpose(-2, -1) * module.scale, torch.tensor(float(N)))
        positional = module.pos_proj(module.rel_indices.expand(B, -1, -1, -1)).permute(0, 3, 1, 2).softmax(-1)
        gate = torch.sigmoid(module.gating_param)[None, :, None, None]
        expected = module.proj((((1 - gate) * content + gate * positional) @ v).transpose(1, 2).reshape(B, N, C))
        set_attention(module, "poly3")
        torch.testing.assert_close(module(x), expected, atol=1e-4, rtol=1e-4)


def test_efficientformer_v2_downsampling_attends_more_keys_than_queries():
    """Nq = the half-resolution grid, N = Nk: poly3's 1/sqrt(N) uses the keys."""
    model = make("efficientformer_v2")
    module = next(m for m in model.modules() if type(m).__name__ == "Attention2dDownsample")
    assert module.N2 < module.N
    switch(model, "poly3", inputs("efficientformer_v2"))
    captured = []
    module.capture = lambda m, got: captured.append(got)
    with torch.no_grad():
        model(inputs("efficientformer_v2"))
    got = captured[0]
    assert got.q.shape[-2] == module.N2 and got.k.shape[-2] == module.N and got.attn_bias.shape[-2:] == (module.N2, module.N)


def test_convit_positional_softmax_is_named_not_refused(caplog):
    model, x = make("convit"), inputs("convit")
    with caplog.at_level("INFO", logger="polyattn_lightning.attention.switch.timm"):
        assert switch(model, "poly3", x) == 3
    assert "blocks.0.attn" in caplog.text and "positional map stays softmax by decision" in caplog.text


@pytest.mark.parametrize("family", ["levit", "levit_conv", "efficientformer_v2", "tnt", "gcvit", "mvitv2", "hiera"])
def test_derived_probe_runs_at_the_size_the_model_was_built_for(family, caplog):
    """Built at another size than timm's default (224), these keep it only in a token grid or in a pixel
    embedding: the probe finds it there, so ``set_attention`` probes (strictly) without falling back.
    (Hiera is a generic family: its tiny build is ``timm_families``'.)"""
    if family in FAMILIES:
        model, size = make(family, randomize=False), FAMILIES[family][1][2:]
    else:
        model, size = timm_families.make(family), tuple(timm_families.images(family).shape[2:])
    assert tuple(built_size(model)) == size != (224, 224)
    expected = sum(type(m) in _ADAPTERS for m in model.modules())
    with caplog.at_level("WARNING", logger="polyattn_lightning.attention.switch.timm"):
        assert set_attention(model, "poly3") == expected > 0
    assert "probe forward" not in caplog.text
