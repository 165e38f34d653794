"""CSATv2 (``timm.models.csatv2``): the one-channel attention of its spatial gate.

timm 1.0.31's ``SpatialTransformerBlock`` unbinds q, k, v as ``(B, N)`` tensors (one scalar per
position), so ``q @ k^T`` is ``(B, B)``: each sample's N-vector of queries is scored against every
sample's keys and the softmax runs over the samples of the batch, not over positions (its comment says
``(B, N, N)``). The switch keeps timm's computation (a switched ``softmax`` must give timm's outputs and
its weights were trained that way): one head, the B samples are the tokens, the N positions the feature
dimension, no score scale (temperature 1), and N in the length scale is the batch size.
"""

from __future__ import annotations

from timm.models.csatv2 import SpatialTransformerBlock
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(SpatialTransformerBlock)
class CSATv2SpatialAttention(SwitchedWithoutDropout, SpatialTransformerBlock):
    """``timm.models.csatv2.SpatialTransformerBlock``; timm computes the attention and the MLP in this one
    ``forward``, so both are here, only the attention product changed."""

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        shortcut = x
        x_t = self.pos_embed(self.norm1(x.flatten(2).transpose(1, 2)), (H, W))
        q, k, v = (t[None, None] for t in self.qkv(x_t).unbind(-1))  # (1, 1 head, B, N), as timm's (B, N)
        x_t = self._attend(q, k, v, 1.0)[0, 0].unsqueeze(-1)
        x = shortcut + x_t.transpose(1, 2).reshape(B, C, H, W)
        shortcut = x
        x_t = self.mlp(self.norm2(x.flatten(2).transpose(1, 2)))
        return shortcut + x_t.transpose(1, 2).reshape(B, C, H, W)
