"""Tiny builds of every timm family the generic switch covers: (timm model name or class, kwargs, image side).

Each keeps its family's attention class and the way it calls SDPA (masks, biases, RoPE, windows,
sub-sampled keys) at a size a CPU runs in well under a second.
"""
from __future__ import annotations

import timm
import torch
from timm.layers.attention2d import Attention2d, MultiQueryAttention2d
from timm.models import metaformer, nest, nextvit, volo
from torch import nn

NUM_CLASSES = 5

GENERIC_FAMILIES = {
    "vit": ("vit_small_patch16_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3, qk_norm=True), 32),
    "vit_diff": ("vit_tiny_patch16_224", dict(img_size=32, patch_size=8, depth=2, attn_layer="diff"), 32),
    "vit_parallel": ("vit_small_patch16_18x2_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3), 32),
    "deit": ("deit_tiny_distilled_patch16_224", dict(img_size=32, patch_size=8, depth=2), 32),
    "xcit": ("xcit_nano_12_p16_224", dict(img_size=32, depth=2), 32),
    "eva02": ("eva02_tiny_patch14_224", dict(img_size=28, depth=2), 28),
    "beit": ("beit_base_patch16_224", dict(img_size=32, patch_size=8, depth=2, embed_dim=48, num_heads=3), 32),
    "maxvit": ("test_maxvit", dict(img_size=64), 64),
    "davit": ("davit_tiny", dict(depths=(1, 1), embed_dims=(16, 32), num_heads=(1, 2), attn_types=("spatial",)), 56),
    "hiera": ("hiera_tiny_224", dict(img_size=(64, 64), embed_dim=16, stages=(1, 1, 1, 1)), 64),
    "pvt_v2": ("pvt_v2_b0", dict(depths=(1, 1, 1, 1), embed_dims=(8, 16, 24, 32), num_heads=(1, 2, 2, 4)), 64),
    "twins": ("twins_svt_small", dict(img_size=64, depths=(1, 1, 1, 1), embed_dims=(16, 32, 48, 64), num_heads=(1, 2, 2, 4), wss=(4, 2, 2, 1)), 64),
    "nest": (nest.Nest, dict(img_size=32, embed_dims=(16, 32, 48), num_heads=(1, 2, 3), depths=(1, 1, 1)), 32),
    "tiny_vit": ("tiny_vit_5m_224", dict(embed_dims=(16, 32, 48, 64), depths=(1, 1, 1, 1), num_heads=(1, 2, 3, 4), window_sizes=(7, 7, 7, 7)), 64),
    "visformer": ("visformer_tiny", dict(img_size=64, embed_dim=48, depth=(1, 1, 1), num_heads=3, init_channels=8), 64),
    "relpos": ("test_vit_relpos", dict(img_size=32, patch_size=8), 32),
    "sam": ("samvit_base_patch16", dict(img_size=64, patch_size=8, depth=2, embed_dim=48, num_heads=3, window_size=4, global_attn_indexes=(1,), num_classes=0), 64),
    "caformer": (metaformer.MetaFormer, dict(depths=(1, 1, 1, 1), dims=(32, 32, 64, 64), token_mixers=[
        metaformer.SepConv, metaformer.SepConv, metaformer.Attention, metaformer.Attention],
        norm_layers=[metaformer.LayerNorm2dNoBias] * 2 + [metaformer.LayerNormNoBias] * 2), 64),
    "cpubone": ("cpubone_nano", dict(width_list=[8, 16, 16, 32, 32]), 64),
    "gemma4": ("gemma4_vit_167m", dict(depth=2, embed_dim=48, num_heads=2), 64),
    "sam2_hiera": ("sam2_hiera_tiny", dict(embed_dim=16, stages=(1, 1, 1, 1), global_att_blocks=(), window_spec=(4, 4, 4, 4)), 64),
    "iformer": ("iformer_t", dict(dims=(16, 32, 48, 64), depths=(1, 1, 3, 3), attn_groups=(0, 0, 1, 1)), 64),
    "lowformer": ("lowformer_b0", dict(width_list=[8, 16, 16, 32, 32], depth_list=[0, 1, 1, 1, 1], head_widths=(32, 32)), 64),
    "fastvit": ("fastvit_sa12", dict(layers=(1, 1, 1, 1), embed_dims=(32, 32, 64, 64)), 64),
    "deepseek": ("deepseek_vit_412m", dict(img_size=56, depth=2, embed_dim=48, num_heads=2, out_features=16), 56),
    "qwen3": ("qwen3_vit_88m", dict(img_size=64, depth=2, embed_dim=48, num_heads=2), 64),
    "naflexvit": ("naflexvit_base_patch16_gap", dict(img_size=32, depth=2, embed_dim=48, num_heads=3), 32),
}

#: Classes whose models are too large to build tiny (NextViT's fixed widths, MobileNetV5) or that sit among
#: attention the generic switch does not cover (VOLO): one module, with its input's shape.
MODULE_FAMILIES = {
    "nextvit": (lambda: nextvit.EfficientAttention(32, head_dim=16, sr_ratio=2), (2, 16, 32)),
    "volo": (lambda: volo.Attention(32, num_heads=2), (2, 4, 4, 32)),  # channels-last (B, H, W, C)
    "mobilenetv5_mqa": (lambda: MultiQueryAttention2d(32, num_heads=4, key_dim=8, value_dim=8, kv_stride=2), (2, 32, 8, 8)),
    "attention2d": (lambda: Attention2d(32, num_heads=4), (2, 32, 4, 4)),
}
FAMILIES = sorted([*GENERIC_FAMILIES, *MODULE_FAMILIES])


def make(family: str) -> nn.Module:
    torch.manual_seed(0)
    if family in MODULE_FAMILIES:
        return MODULE_FAMILIES[family][0]().eval()
    name, kwargs, _ = GENERIC_FAMILIES[family]
    kwargs = {"num_classes": NUM_CLASSES, **kwargs}
    model = timm.create_model(name, pretrained=False, **kwargs) if isinstance(name, str) else name(**kwargs)
    return model.eval()


def images(family: str) -> torch.Tensor:
    """A batch of 2 inputs: images for models, the module's input for module families."""
    shape = MODULE_FAMILIES[family][1] if family in MODULE_FAMILIES else (2, 3, *[GENERIC_FAMILIES[family][2]] * 2)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1))
