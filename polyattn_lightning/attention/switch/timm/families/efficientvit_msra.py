"""EfficientViT-MSRA (``timm.models.efficientvit_msra``): cascaded group attention in local windows.

Each head attends on its own (head ``i`` sees head ``i - 1``'s output), so ``attention()`` runs once per
head and ``capture`` is called once per head, each with one head. The bias ``attention_biases[i, idxs]``
is ``attn_bias``. N = the window's tokens: timm's ``LocalWindowAttention`` zero-pads the feature map to
whole windows and attends the padding too (softmax counts it), and so does the switched layer.
"""

from __future__ import annotations

import torch
from timm.models.efficientvit_msra import CascadedGroupAttention
from torch import Tensor

from ...base import register_adapter
from ._common import SwitchedWithoutDropout


@register_adapter(CascadedGroupAttention)
class EfficientViTMSRAAttention(SwitchedWithoutDropout, CascadedGroupAttention):
    """``timm.models.efficientvit_msra.CascadedGroupAttention``."""

    def forward(self, x: Tensor) -> Tensor:
        B, C, H, W = x.shape
        feats_in = x.chunk(len(self.qkvs), dim=1)
        feats_out = []
        feat = feats_in[0]
        attn_bias = self.get_attention_biases(x.device)
        for head_idx, (qkv, dws) in enumerate(zip(self.qkvs, self.dws)):
            if head_idx > 0:
                feat = feat + feats_in[head_idx]
            q, k, v = qkv(feat).view(B, -1, H, W).split([self.key_dim, self.key_dim, self.val_dim], dim=1)
            q, k, v = (t.flatten(2).transpose(1, 2)[:, None] for t in (dws(q), k, v))  # (B, 1, HW, d)
            feat = self._attend(q, k, v, self.scale, attn_bias=attn_bias[head_idx][None, None])
            feat = feat[:, 0].transpose(1, 2).reshape(B, self.val_dim, H, W)
            feats_out.append(feat)
        return self.proj(torch.cat(feats_out, 1))
