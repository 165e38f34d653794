"""Softmax dispatches to SDPA, with the same masks, and is finite on fully masked rows."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from attention_reference import make_qkv

from polyattn_lightning.attention import attention


def test_softmax_equals_sdpa_with_masks_and_bias():
    q, k, v = make_qkv(dv=4)
    swin = torch.zeros(9, 11)
    swin[:3, 8:] = -100.0
    bias = torch.randn(3, 9, 11, dtype=q.dtype)
    out = attention(q, k, v, "softmax", attn_mask=swin, attn_bias=bias, temperature=0.3)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=(swin + bias).to(q.dtype), scale=0.3)
    torch.testing.assert_close(out, expected)


def test_softmax_key_padding_and_fully_masked_rows_give_zeros():
    q, k, v = make_qkv()
    padding = torch.zeros(2, 11, dtype=torch.bool)
    padding[1] = True  # batch 1 has no key at all
    keep = torch.ones(9, 11, dtype=torch.bool)
    keep[2] = False  # query 2 attends to nothing
    out = attention(q, k, v, "softmax", key_padding_mask=padding, attn_mask=keep)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.equal(out[0, :, 2], torch.zeros_like(out[0, :, 2]))
    expected = F.scaled_dot_product_attention(q[:1], k[:1], v[:1], attn_mask=keep)
    torch.testing.assert_close(out[0, :, keep.any(-1)], expected[0, :, keep.any(-1)])
    out.sum().backward()
    assert all(x.grad.isfinite().all() for x in (q, k, v))


def test_additive_mask_of_another_float_dtype_is_accepted_like_on_the_other_kernels():
    """Regression: SDPA refused an additive mask whose dtype was neither fp32 nor q's (an fp64 mask
    with fp32 q, an fp16 mask with bf16 q, an fp64 mask under autocast); the other kernels take it."""
    q, k, v = make_qkv(dtype=torch.float32)
    swin = torch.zeros(9, 11, dtype=torch.float64)
    swin[:, 8:] = -100.0
    s = q @ k.transpose(-2, -1) / 2 + swin.float()
    expected = s.softmax(-1) @ v
    torch.testing.assert_close(attention(q, k, v, "softmax", attn_mask=swin), expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, "softmax", attn_mask=swin)
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
    half = [x.detach().bfloat16() for x in (q, k, v)]
    out = attention(*half, "softmax", attn_mask=swin.half())
    torch.testing.assert_close(out.float(), expected, rtol=0.05, atol=0.05)
