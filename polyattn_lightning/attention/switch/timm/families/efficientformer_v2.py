"""EfficientFormerV2 (``timm.models.efficientformer_v2``): talking-heads attention with attention biases.

``Attention2d``: ``talking_head2(phi(talking_head1(q k^T * scale + biases))) @ v`` (1x1 convolutions over
the head axis), N = the tokens of the (strided) feature map. ``Attention2dDownsample``: queries on the
half-resolution grid attend every token of the full one (Nq = N / 4, N = Nk), biases as ``attn_bias``.
"""

from __future__ import annotations

from timm.models.efficientformer_v2 import Attention2d, Attention2dDownsample
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout, talking_heads


def _heads(x: Tensor, heads: int, tokens: int) -> Tensor:
    """``(B, heads * d, h, w)`` -> ``(B, heads, tokens, d)``, timm's split into heads."""
    return x.reshape(x.shape[0], heads, -1, tokens).transpose(2, 3)


@register_adapter(Attention2d)
class EfficientFormerV2Attention(SwitchedWithoutDropout, Attention2d):
    """``timm.models.efficientformer_v2.Attention2d``."""

    def forward(self, x: Tensor) -> Tensor:
        B = x.shape[0]
        if self.stride_conv is not None:
            x = self.stride_conv(x)
        q, k = (_heads(proj(x), self.num_heads, self.N) for proj in (self.q, self.k))
        v = self.v(x)
        v_local, v = self.v_local(v), _heads(v, self.num_heads, self.N)
        x = talking_heads(
            self,
            q,
            k,
            v,
            self.scale,
            self.talking_head1.weight[:, :, 0, 0],
            mix_before=self.talking_head1,
            mix_after=self.talking_head2,
            attn_bias=self.get_attention_biases(x.device)[None],
        )
        x = x.transpose(2, 3).reshape(B, self.dh, self.resolution[0], self.resolution[1]) + v_local
        if self.upsample is not None:
            x = self.upsample(x)
        return self.proj(self.act(x))


@register_adapter(Attention2dDownsample)
class EfficientFormerV2DownsampleAttention(SwitchedWithoutDropout, Attention2dDownsample):
    """``timm.models.efficientformer_v2.Attention2dDownsample``: Nq = the half-resolution grid, Nk = the input's."""

    def forward(self, x: Tensor) -> Tensor:
        B = x.shape[0]
        q = _heads(self.q(x), self.num_heads, self.N2)
        k, v = _heads(self.k(x), self.num_heads, self.N), self.v(x)
        v_local, v = self.v_local(v), _heads(v, self.num_heads, self.N)
        x = self._attend(q, k, v, self.scale, attn_bias=self.get_attention_biases(x.device)[None])
        x = x.transpose(2, 3).reshape(B, self.dh, self.resolution2[0], self.resolution2[1]) + v_local
        return self.proj(self.act(x))
