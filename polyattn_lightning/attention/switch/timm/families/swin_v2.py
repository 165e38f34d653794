"""Swin Transformer V2 (``swin_transformer_v2``) and V2-CR (``swin_transformer_v2_cr``): scaled cosine attention.

``S = cos(q, k) * tau_h + B``: the clamped, exponentiated logit scale ``tau_h`` is a per-head temperature,
folded into the L2-normalised q (``attention()`` gets ``temperature=1``, the parameter keeps its gradient);
the continuous position bias ``B`` (the meta-MLP's) is ``attn_bias``; the 0/-100 shift mask is
``attn_mask``: for a non-softmax activation a masked pair contributes exactly zero and N counts the
unmasked keys of the window.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models.swin_transformer_v2 import WindowAttention as V2WindowAttention
from timm.models.swin_transformer_v2_cr import WindowMultiHeadAttention
from torch import Tensor

from ...base import SwitchedAttention, register_adapter
from ._common import window_mask

#: timm's clamp of the log logit scale (a temperature of at most 100).
MAX_LOG_SCALE = math.log(1.0 / 0.01)


def cosine_qk(q: Tensor, k: Tensor, logit_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Normalised q times the per-head temperature ``exp(min(logit_scale, log 100))`` (``(1, H, 1, 1)``-able)."""
    temperature = torch.clamp(logit_scale, max=MAX_LOG_SCALE).exp()
    return F.normalize(q, dim=-1) * temperature, F.normalize(k, dim=-1)


@register_adapter(V2WindowAttention)
class SwinV2WindowAttention(SwitchedAttention, V2WindowAttention):
    """``timm.models.swin_transformer_v2.WindowAttention``; the bias is ``16 * sigmoid(cpb_mlp(coords))``."""

    map_layout = "shifted_windows"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B_, N, C = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            qkv_bias = torch.cat((self.q_bias, self.k_bias, self.v_bias))
            if self.qkv_bias_separate:
                qkv = self.qkv(x) + qkv_bias
            else:
                qkv = F.linear(x, weight=self.qkv.weight, bias=qkv_bias)
        q, k, v = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = cosine_qk(q, k, self.logit_scale)
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        x = self._attend(q, k, v, 1.0, attn_mask=window_mask(mask, B_), attn_bias=16 * torch.sigmoid(bias)[None])
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B_, N, C)))


@register_adapter(WindowMultiHeadAttention)
class SwinV2CrWindowAttention(SwitchedAttention, WindowMultiHeadAttention):
    """``timm.models.swin_transformer_v2_cr.WindowMultiHeadAttention``; the bias is its meta-MLP's output."""

    map_layout = "shifted_windows"

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        Bw, L, C = x.shape
        q, k, v = self.qkv(x).view(Bw, L, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = cosine_qk(q, k, self.logit_scale.reshape(1, self.num_heads, 1, 1))
        bias = self._relative_positional_encodings()
        x = self._attend(q, k, v, 1.0, attn_mask=window_mask(mask, Bw), attn_bias=bias)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(Bw, L, -1)))
