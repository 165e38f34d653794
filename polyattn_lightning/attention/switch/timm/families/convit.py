"""ConViT (``timm.models.convit``): gated positional self-attention (GPSA) and plain self-attention (MHSA).

GPSA mixes two maps per head, ``(1 - g) softmax(q k^T * scale) + g softmax(P)`` with a learned gate
``g = sigmoid(gating_param)`` and positional scores ``P = pos_proj(rel_indices)``, then divides by the
row sum (1 for two softmax maps). Decision: the content map is switched (``phi(q k^T * scale)`` through
``attention()``, N = the patches), the positional map stays softmax and the row renormalisation is
dropped. Why: ``P`` holds no query or key (it is a learned locality prior, ``-|delta|^2`` at init, whose
``x^3`` or ReLU would wipe out the locality), and dividing by the row sum of a non-softmax map would
bring back the normalisation being replaced (and divide by ~0). With softmax the renormalisation is the
identity, so a switched ``softmax`` gives timm's outputs. So a poly3 GPSA still calls softmax once, on
``P`` (``keeps_softmax`` tells ``set_attention``'s probe so: it is named in the log line); ``capture`` sees the
content map, and ``attention_map(...) @ v`` is the content term before the
gate.
"""

from __future__ import annotations

import torch
from timm.models.convit import GPSA, MHSA
from torch import Tensor

from ...base import SwitchedAttention, register_adapter


@register_adapter(GPSA)
class ConViTGatedAttention(SwitchedAttention, GPSA):
    """``timm.models.convit.GPSA``: ``(1 - g) * phi(q k^T * scale) @ v + g * softmax(P) @ v``."""

    #: Read by set_attention's probe: this softmax is kept by decision (named in its log line, not refused).
    keeps_softmax = "GPSA's positional map stays softmax by decision (no q k^T in it); its content map is switched"

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        if self.rel_indices is None or self.rel_indices.shape[1] != N:
            self.rel_indices = self.get_rel_indices(N)
        q, k = self.qk(x).reshape(B, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        v = self.v(x).reshape(B, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3)
        positional = self.pos_proj(self.rel_indices.expand(B, -1, -1, -1)).permute(0, 3, 1, 2).softmax(dim=-1)
        gate = torch.sigmoid(self.gating_param.view(1, -1, 1, 1))
        x = (1.0 - gate) * self._attend(q, k, v, self.scale) + gate * (self.attn_drop(positional) @ v)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))


@register_adapter(MHSA)
class ConViTSelfAttention(SwitchedAttention, MHSA):
    """``timm.models.convit.MHSA`` (the blocks after ``local_up_to_layer``)."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = self._attend(q, k, v, self.scale)
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B, N, C)))
