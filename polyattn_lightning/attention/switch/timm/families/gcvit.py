"""GCViT (``timm.models.gcvit``): window attention, local or with the stage's global query."""

from __future__ import annotations

from timm.models.gcvit import WindowAttentionGlobal
from torch import Tensor

from ...base import SwitchedAttention, register_adapter


@register_adapter(WindowAttentionGlobal)
class GCViTWindowAttention(SwitchedAttention, WindowAttentionGlobal):
    """``timm.models.gcvit.WindowAttentionGlobal``: the relative-position bias (``rel_pos.get_bias()``) is
    ``attn_bias``, N = the window's tokens; no mask (GCViT does not shift windows)."""

    def forward(self, x: Tensor, q_global: Tensor | None = None) -> Tensor:
        B, N, C = x.shape
        heads = (self.num_heads, self.head_dim)
        if self.use_global and q_global is not None:
            k, v = self.qkv(x).reshape(B, N, 2, *heads).permute(2, 0, 3, 1, 4).unbind(0)
            # windows are image-major: each image's global query stays with its windows (as in timm)
            q = q_global.repeat_interleave(B // q_global.shape[0], dim=0).reshape(B, N, *heads).transpose(1, 2)
        else:
            q, k, v = self.qkv(x).reshape(B, N, 3, *heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = self._attend(q, k, v, self.scale, attn_bias=self.rel_pos.get_bias())
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
