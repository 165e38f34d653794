"""The diagnostics on this project's own models (LRA encoder, XCiT detection backbone) through the same capture
hook, and Swin's windows put back in place."""
from __future__ import annotations

import math

import pytest
import timm
import torch
from timm.models.swin_transformer import SwinTransformerBlock, window_partition

from polyattn_lightning.attention import set_attention
from polyattn_lightning.callbacks import AttentionNorms
from polyattn_lightning.diagnostics import maps as map_module
from polyattn_lightning.diagnostics.figures import attention_pictures
from polyattn_lightning.diagnostics.maps import collect_maps, stitch_windows
from polyattn_lightning.diagnostics.probe import probe_batch
from polyattn_lightning.models.lra_encoder import LRAClassifier
from polyattn_lightning.models.xcit_detection import XCiTBackbone
from polyattn_lightning.tasks import LRAModule


def test_lra_encoder_norms_and_per_token_strips():
    torch.manual_seed(0)
    model = LRAClassifier(vocab_size=16, max_length=32, num_classes=10, attention="relu")
    ids = torch.randint(1, 16, (3, 20))
    mask = torch.ones(3, 20, dtype=torch.bool)
    mask[2, 12:] = False  # padding
    metrics = AttentionNorms().measure(model, (ids, mask))
    assert len(metrics) == 3 * 2 * (2 + 1)  # 3 norms x 2 layers x (2 heads + mean)
    assert all(math.isfinite(v) for v in metrics.values())

    maps = collect_maps(model, (ids, mask))
    assert [m.tokens.shape for m in maps] == [(3, 20), (3, 20)]
    for m in maps:
        assert (m.tokens[2, 12:] == 0).all() and (m.tokens[2, :12] > 0).any()  # padding receives nothing
    assert set(attention_pictures(model, (ids, mask))) == {"heatmaps", "overlay"}


def test_xcit_detection_backbone_channel_maps():
    torch.manual_seed(0)
    backbone = XCiTBackbone("xcit_nano_12_p16_224", attention="poly3", out_indices=(0, 1, 2, 3), depth=4, img_size=32)
    images = torch.randn(2, 3, 32, 64)
    metrics = AttentionNorms(layers=[1, 4]).measure(backbone, images)
    assert all(math.isfinite(v) for v in metrics.values()) and len(metrics) == 3 * 2 * (4 + 1)
    maps = collect_maps(backbone, images, layers=[1])
    assert maps[0].channels and maps[0].heat.shape == (4, 32, 32) and maps[0].tokens is None
    assert set(attention_pictures(backbone, images, layers=[1])) == {"heatmaps"}  # no token map for XCA


def test_swin_windows_are_put_back_where_the_block_took_them_from():
    """Windows cut the way timm's block cuts them (shift, then window_partition) stitch back to the feature map."""
    model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=3, img_size=56, embed_dim=24, depths=(2, 2),
                              num_heads=(1, 2))
    shifted = [b for b in model.modules() if isinstance(b, SwinTransformerBlock) and any(b.shift_size)]
    assert shifted
    for block in shifted:
        rows, cols = block.input_resolution
        grid = torch.arange(2 * rows * cols, dtype=torch.float32).reshape(2, rows, cols)  # each position its own value
        rolled = torch.roll(grid, shifts=tuple(-s for s in block.shift_size), dims=(1, 2))
        windows = window_partition(rolled[..., None], block.window_size).flatten(1)  # (B * windows, wh * ww)
        torch.testing.assert_close(stitch_windows(windows, block), grid, rtol=0, atol=0)


def test_swin_and_xcit_class_attention_token_maps():
    torch.manual_seed(0)
    swin = timm.create_model("swin_tiny_patch4_window7_224", num_classes=3, img_size=56, embed_dim=24, depths=(2, 2),
                             num_heads=(1, 2))
    set_attention(swin, "relu")
    maps = collect_maps(swin, torch.randn(2, 3, 56, 56))
    assert [tuple(m.tokens.shape) for m in maps] == [(2, 14, 14), (2, 14, 14), (2, 7, 7), (2, 7, 7)]
    xcit = timm.create_model("xcit_nano_12_p16_224", num_classes=3, img_size=32, depth=2)
    set_attention(xcit, "softmax")
    maps = collect_maps(xcit, torch.randn(2, 3, 32, 32))
    assert [m.what for m in maps][2:] == ["class-token attention"] * 2  # the two class-attention layers
    rows = [m.tokens.flatten(1).sum(1) for m in maps[2:]]
    assert all(((r > 0) & (r < 1)).all() for r in rows)  # softmax row over cls + patches, patches take a part


def test_probe_of_a_dict_batch_follows_forward_parameter_names():
    module = LRAModule("poly3", vocab_size=16, num_classes=10, max_length=32, two_tower=False)
    batch = {"label": torch.zeros(6, dtype=torch.long), "mask": torch.ones(6, 20, dtype=torch.bool),
             "input_ids": torch.randint(1, 16, (6, 20))}
    ids, mask = probe_batch(module, batch, 4)
    assert torch.equal(ids, batch["input_ids"][:4]) and torch.equal(mask, batch["mask"][:4])
    assert len(AttentionNorms().measure(module, (ids, mask))) == 3 * 2 * 3
    with pytest.raises(TypeError, match="define attention_probe"):
        probe_batch(module, {"tokens": batch["input_ids"]}, 4)


@pytest.mark.parametrize("family", ["swin", "lra"])
def test_maps_made_a_few_rows_at_a_time_equal_the_whole_batch(family, monkeypatch):
    """Swin's shifted-window mask has a row per window, its bias one for all; LRA's padding mask one per sequence."""
    torch.manual_seed(0)
    if family == "swin":
        model = timm.create_model("swin_tiny_patch4_window7_224", num_classes=3, img_size=56, embed_dim=24,
                                  depths=(2, 2), num_heads=(1, 2))
        set_attention(model, "relu")
        probe = torch.randn(2, 3, 56, 56)
    else:
        model = LRAClassifier(vocab_size=16, max_length=32, num_classes=10, attention="softmax")
        mask = torch.ones(3, 20, dtype=torch.bool)
        mask[1, 9:] = False
        probe = (torch.randint(1, 16, (3, 20)), mask)
    whole = collect_maps(model, probe)
    monkeypatch.setattr(map_module, "MAP_ELEMENTS", 1)  # one row at a time
    for a, b in zip(whole, collect_maps(model, probe)):
        torch.testing.assert_close(a.heat, b.heat)
        torch.testing.assert_close(a.tokens, b.tokens)
