"""CrossViT (``timm.models.crossvit``): cross attention, the class token of one branch queries the other's tokens."""

from __future__ import annotations

from timm.models.crossvit import CrossAttention
from torch import Tensor

from ...base import SwitchedAttention, register_adapter


@register_adapter(CrossAttention)
class CrossViTCrossAttention(SwitchedAttention, CrossAttention):
    """``timm.models.crossvit.CrossAttention``: one query (the class token), N = every token of the row."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        heads = (self.num_heads, C // self.num_heads)
        q = self.wq(x[:, 0:1]).reshape(B, 1, *heads).transpose(1, 2)
        k = self.wk(x).reshape(B, N, *heads).transpose(1, 2)
        v = self.wv(x).reshape(B, N, *heads).transpose(1, 2)
        x = self._attend(q, k, v, self.scale)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, 1, C)))
