"""SHViT (``timm.models.shvit``): single-head self-attention on a slice of the channels."""

from __future__ import annotations

import torch
from timm.models.shvit import SHSA
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(SHSA)
class SHViTAttention(SwitchedWithoutDropout, SHSA):
    """``timm.models.shvit.SHSA``: one head over the ``H * W`` positions (N of them)."""

    def forward(self, x: Tensor) -> Tensor:
        B, _, H, W = x.shape
        x1, x2 = torch.split(x, [self.pdim, self.dim - self.pdim], dim=1)
        q, k, v = torch.split(self.qkv(self.pre_norm(x1)), [self.qk_dim, self.qk_dim, self.pdim], dim=1)
        q, k, v = (t.flatten(2).transpose(1, 2)[:, None] for t in (q, k, v))  # (B, 1 head, HW, d)
        x1 = self._attend(q, k, v, self.scale)[:, 0].transpose(1, 2).reshape(B, self.pdim, H, W)
        return self.proj(torch.cat([x1, x2], dim=1))
