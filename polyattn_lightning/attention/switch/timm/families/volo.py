"""VOLO (``timm.models.volo``): its class-attention blocks (the outlook attention is no dot-product attention)."""

from __future__ import annotations

from timm.models.volo import ClassAttention
from torch import Tensor

from ...base import SwitchedAttention, register_adapter


@register_adapter(ClassAttention)
class VOLOClassAttention(SwitchedAttention, ClassAttention):
    """``timm.models.volo.ClassAttention``: the class token queries every token (N of them)."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        k, v = self.kv(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q = self.q(x[:, :1, :]).reshape(B, self.num_heads, 1, self.head_dim)
        x = self._attend(q, k, v, self.scale)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, 1, self.head_dim * self.num_heads)))
