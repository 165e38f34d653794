"""TNT (``timm.models.tnt``): the same attention class for the inner (pixel) and outer (patch) transformers."""

from __future__ import annotations

from timm.models.tnt import Attention
from torch import Tensor

from ...base import SwitchedAttention, register_adapter


@register_adapter(Attention)
class TNTAttention(SwitchedAttention, Attention):
    """``timm.models.tnt.Attention``: q and k of ``hidden_dim``, v of ``dim``; N = the pixels of a patch
    (inner) or the patches plus the class token (outer)."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k = self.qk(x).reshape(B, N, 2, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        v = self.v(x).reshape(B, N, self.num_heads, -1).transpose(1, 2)
        x = self._attend(q, k, v, self.scale)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, -1)))
