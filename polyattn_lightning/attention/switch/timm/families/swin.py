"""Swin V1 (``swin_transformer.WindowAttention``): shifted-window attention with a relative-position bias.

timm adds its 0/-100 shift mask to the position bias before the softmax, and ``x^3`` would not zero a -100:
the bias goes to ``attention()`` as ``attn_bias`` and the mask as ``attn_mask``, so a masked pair contributes
exactly nothing and N counts the window's unmasked keys.
"""

from __future__ import annotations

from timm.models.swin_transformer import WindowAttention
from torch import Tensor

from ...base import SwitchedAttention, register_adapter
from ._common import window_mask


@register_adapter(WindowAttention)
class SwinWindowAttention(SwitchedAttention, WindowAttention):
    """Swin (shifted) window attention: relative-position bias as ``attn_bias``, window mask as ``attn_mask``."""

    map_layout = "shifted_windows"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x: ``(B * num_windows, N, C)``; mask: 0/-100 ``(num_windows, N, N)`` or None."""
        B_, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        x = self._attend(q, k, v, self.scale, attn_mask=window_mask(mask, B_), attn_bias=self._get_rel_pos_bias())
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B_, N, -1)))
