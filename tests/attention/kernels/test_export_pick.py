"""``pick()`` while ``torch.export`` traces: ``auto`` takes a decomposable form (no C++ op, no Triton) that takes a
dynamic batch, and the exported switched model equals eager at another batch."""
from __future__ import annotations

import timm
import torch

from polyattn_lightning.attention import set_attention
from polyattn_lightning.attention.kernels import BACKENDS, KernelInputs, pick
from polyattn_lightning.attention.masks import Masks
from polyattn_lightning.attention.registry import get_activation


def test_eager_auto_picks_a_kernel_export_cannot_decompose():
    q = torch.randn(2, 2, 17, 8)
    choice = pick(KernelInputs(q, q, q, get_activation("poly3"), 8**-0.5, Masks(None, None, None), None,
                               torch.full((1, 1, 1, 1), 17.0), 0.0))
    assert not BACKENDS[choice.kernel].decomposable  # what the export below must not hold


def test_export_with_a_dynamic_batch_equals_eager_at_another_batch():
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, embed_dim=32, num_heads=2,
                              num_classes=5).eval()
    set_attention(model, "poly3")
    batch = torch.export.Dim("batch", min=1, max=1024)
    program = torch.export.export(model, (torch.randn(2, 3, 32, 32),), dynamic_shapes=({0: batch},))
    assert "polyattn" not in program.graph_module.code  # standard operators only
    x = torch.randn(5, 3, 32, 32)
    with torch.no_grad():
        expected = model(x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(program.module()(x), expected, atol=1e-5, rtol=0)


def test_export_with_a_dynamic_batch_and_sequence_equals_eager():
    torch.manual_seed(0)
    block = timm.models.vision_transformer.Block(32, num_heads=2).eval()
    set_attention(block, "poly3")
    dims = {0: torch.export.Dim("batch", min=1, max=64), 1: torch.export.Dim("tokens", min=2, max=512)}
    program = torch.export.export(block, (torch.randn(2, 9, 32),), dynamic_shapes=(dims,))
    x = torch.randn(3, 21, 32)
    with torch.no_grad():
        expected = block(x)
    torch.testing.assert_close(program.module()(x), expected, atol=1e-5, rtol=0)
