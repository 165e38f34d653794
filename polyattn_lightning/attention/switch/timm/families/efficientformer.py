"""EfficientFormer (``timm.models.efficientformer``): the last stage's attention with learned biases."""

from __future__ import annotations

from timm.models.efficientformer import Attention
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(Attention)
class EfficientFormerAttention(SwitchedWithoutDropout, Attention):
    """``timm.models.efficientformer.Attention``: ``attention_biases[:, idxs]`` as ``attn_bias``, N = the tokens."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, self.num_heads, -1).permute(0, 2, 1, 3)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.val_dim], dim=3)
        x = self._attend(q, k, v, self.scale, attn_bias=self.get_attention_biases(x.device)[None])
        return self.proj(x.transpose(1, 2).reshape(B, N, self.val_attn_dim))
