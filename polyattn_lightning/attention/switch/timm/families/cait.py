"""CaiT (``timm.models.cait``): talking-heads self-attention (its class attention is the generic switch's)."""

from __future__ import annotations

from timm.models.cait import TalkingHeadAttn
from torch import Tensor, nn

from ...base import SwitchedAttention, register_adapter
from ._common import talking_heads


def mix_heads(linear: nn.Linear, attn: Tensor) -> Tensor:
    """timm's head mixing: ``linear`` over the head axis of ``(B, H, Nq, Nk)``."""
    return linear(attn.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


@register_adapter(TalkingHeadAttn)
class CaiTTalkingHeadAttention(SwitchedAttention, TalkingHeadAttn):
    """``timm.models.cait.TalkingHeadAttn``: ``proj_w(phi(proj_l(q k^T * scale))) @ v``, N = the tokens."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = talking_heads(
            self,
            q,
            k,
            v,
            self.scale,
            self.proj_l.weight,
            mix_before=lambda a: mix_heads(self.proj_l, a),
            mix_after=lambda a: mix_heads(self.proj_w, a),
        )
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
