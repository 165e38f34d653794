"""Attention over channels (a ``d x d`` map per head, N = the head's channels), as XCiT's ``XCA`` in ``timm_patch``.

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

from ..switched import SwitchedAttention, _adapts
from ._common import SwitchedWithoutDropout


def _per_head_channels(qkv: Tensor, heads: int) -> tuple[Tensor, Tensor, Tensor]:
    """``(B, N, 3 * C)`` -> q, k, v of ``(B, heads, C / heads, N)``: one row per channel of a head."""
    B, N, C3 = qkv.shape
    return qkv.reshape(B, N, 3, heads, C3 // (3 * heads)).permute(2, 0, 3, 4, 1).unbind(0)


@_adapts(ChannelAttention)
class DaViTChannelAttention(SwitchedWithoutDropout, ChannelAttention):
    """``timm.models.davit.ChannelAttention``."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = _per_head_channels(self.qkv(x), self.num_heads)
        x = self._attend(k, v, q, self.scale)  # (B, heads, d, N)
        return self.proj(x.permute(0, 3, 1, 2).reshape(B, N, C))


@_adapts(ChannelAttentionV2)
class DaViTChannelAttentionV2(SwitchedWithoutDropout, ChannelAttentionV2):
    """``timm.models.davit.ChannelAttentionV2``."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = _per_head_channels(self.qkv(x), self.groups)
        x = self._attend(q, k, v, N**-0.5 if self.dynamic_scale else self.head_dim**-0.5)
        return self.proj(x.permute(0, 3, 1, 2).reshape(B, N, C))


@_adapts(CrossCovarianceAttn)
class EdgeNeXtChannelAttention(SwitchedAttention, CrossCovarianceAttn):
    """``timm.models.edgenext.CrossCovarianceAttn``."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = _per_head_channels(self.qkv(x), self.num_heads)
        q, k = F.normalize(q, dim=-1) * self.temperature, F.normalize(k, dim=-1)
        x = self._attend(q, k, v, 1.0)
        return self.proj_drop(self.proj(x.permute(0, 3, 1, 2).reshape(B, N, C)))
