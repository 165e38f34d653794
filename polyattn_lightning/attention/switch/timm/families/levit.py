"""LeViT (``timm.models.levit``): attention with learned per-head biases over relative offsets.

The bias ``attention_biases[:, idxs]`` is ``attn_bias``. ``AttentionDownsample``: the queries are the
subsampled grid, the keys the full one (Nq != Nk; N = Nk). Both the linear (``levit_*``) and the
convolutional (``levit_conv_*``, ``use_conv``) layouts are switched.
"""

from __future__ import annotations

from timm.models.levit import Attention, AttentionDownsample
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(Attention)
class LeViTAttention(SwitchedWithoutDropout, Attention):
    """``timm.models.levit.Attention``."""

    def forward(self, x: Tensor) -> Tensor:
        bias = self.get_attention_biases(x.device)[None]
        split = [self.key_dim, self.key_dim, self.val_dim]
        if self.use_conv:
            B, C, H, W = x.shape
            q, k, v = self.qkv(x).view(B, self.num_heads, -1, H * W).transpose(-2, -1).split(split, dim=3)
            x = self._attend(q, k, v, self.scale, attn_bias=bias).transpose(-2, -1).reshape(B, -1, H, W)
        else:
            B, N, C = x.shape
            q, k, v = self.qkv(x).view(B, N, self.num_heads, -1).transpose(1, 2).split(split, dim=3)
            x = self._attend(q, k, v, self.scale, attn_bias=bias).transpose(1, 2).reshape(B, N, self.val_attn_dim)
        return self.proj(x)


@register_adapter(AttentionDownsample)
class LeViTDownsampleAttention(SwitchedWithoutDropout, AttentionDownsample):
    """``timm.models.levit.AttentionDownsample``: Nq = the subsampled grid, Nk = the input grid."""

    def forward(self, x: Tensor) -> Tensor:
        bias = self.get_attention_biases(x.device)[None]
        if self.use_conv:
            B, C, H, W = x.shape
            HH, WW = (H - 1) // self.stride + 1, (W - 1) // self.stride + 1
            kv = self.kv(x).view(B, self.num_heads, -1, H * W).transpose(-2, -1)
            k, v = kv.split([self.key_dim, self.val_dim], dim=3)
            q = self.q(x).view(B, self.num_heads, self.key_dim, -1).transpose(-2, -1)
            x = self._attend(q, k, v, self.scale, attn_bias=bias).transpose(-2, -1).reshape(B, -1, HH, WW)
        else:
            B, N, C = x.shape
            k, v = self.kv(x).view(B, N, self.num_heads, -1).transpose(1, 2).split([self.key_dim, self.val_dim], dim=3)
            q = self.q(x).view(B, -1, self.num_heads, self.key_dim).transpose(1, 2)
            x = self._attend(q, k, v, self.scale, attn_bias=bias).transpose(1, 2).reshape(B, -1, self.val_attn_dim)
        return self.proj(x)
