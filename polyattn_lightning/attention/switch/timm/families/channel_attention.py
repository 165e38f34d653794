"""Attention over channels (a ``d x d`` map per head, N = the head's channels), as XCiT's ``XCA`` (generic switch).

* DaViT (``timm.models.davit``) ``ChannelAttention``: timm's roles are ``softmax(k^T v * scale) @ q^T``,
  so the channels of k query the channels of v and q is the value; ``ChannelAttentionV2``:
  ``softmax(q^T k * s) @ v^T`` with ``s = N_tokens^-0.5`` (``dynamic_scale``) or ``head_dim^-0.5``.
* EdgeNeXt (``timm.models.edgenext``) ``CrossCovarianceAttn``: XCA, L2-normalised q and k, the learned
  per-head temperature folded into q (``attention()`` gets 1, so it keeps its gradient).
"""

from __future__ import annotations

import torch.nn.functional as F
from timm.models.davit import ChannelAttention, ChannelAttentionV2
from timm.models.edgenext import CrossCovarianceAttn
from torch import Tensor

from ...base import SwitchedAttention, register_adapter
from ._common import SwitchedWithoutDropout


def _per_head_channels(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, N, 3 * C)`` -> q, k, v of ``(B, heads, C / heads, N)``: one row per channel of a head."""
    B, N, C3 = qkv.shape
    return qkv.reshape(B, N, 3, heads, C3 // (3 * heads)).permute(2, 0, 3, 4, 1).unbind(0)


def _tokens(x: Tensor) -> Tensor:
    """``(B, heads, C / heads, N)`` -> ``(B, N, C)``: the heads' channels back side by side per token."""
    B, heads, d, N = x.shape
    return x.permute(0, 3, 1, 2).reshape(B, N, heads * d)


class DaViTChannels(SwitchedWithoutDropout):
    """DaViT's two channel attentions: the per-head channel rows of ``qkv(x)`` in the :meth:`roles` timm gives
    them, attended, projected."""

    heads: int
    map_layout = "channels"

    def roles(self, q: Tensor, k: Tensor, v: Tensor, tokens: int) -> tuple[Tensor, Tensor, Tensor, float]:
        """``(query, key, value, temperature)`` of ``attention()`` from timm's q, k, v."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = _per_head_channels(self.qkv(x), self.heads)
        return self.proj(_tokens(self._attend(*self.roles(q, k, v, x.shape[1]))))


@register_adapter(ChannelAttention)
class DaViTChannelAttention(DaViTChannels, ChannelAttention):
    """``timm.models.davit.ChannelAttention``: the channels of k query those of v; q is the value."""

    heads = property(lambda self: self.num_heads)
    qkv_roles = "kvq"

    def roles(self, q, k, v, tokens):
        return k, v, q, self.scale


@register_adapter(ChannelAttentionV2)
class DaViTChannelAttentionV2(DaViTChannels, ChannelAttentionV2):
    """``timm.models.davit.ChannelAttentionV2``."""

    heads = property(lambda self: self.groups)

    def roles(self, q, k, v, tokens):
        return q, k, v, tokens**-0.5 if self.dynamic_scale else self.head_dim**-0.5


@register_adapter(CrossCovarianceAttn)
class EdgeNeXtChannelAttention(SwitchedAttention, CrossCovarianceAttn):
    """``timm.models.edgenext.CrossCovarianceAttn``."""

    map_layout = "channels"

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = _per_head_channels(self.qkv(x), self.num_heads)
        q, k = F.normalize(q, dim=-1) * self.temperature, F.normalize(k, dim=-1)
        return self.proj_drop(self.proj(_tokens(self._attend(q, k, v, 1.0))))
