"""Swin Transformer V2 (``swinv2``): scaled cosine attention in shifted windows, computed by hand in HF.

``S = cos(q, k) * tau_h + 16 sigmoid(cpb_mlp(coords))``: the clamped, exponentiated logit scale ``tau_h`` is a
per-head temperature folded into the L2-normalised q (``attention()`` gets ``temperature=1``; the parameter
keeps its gradient); the continuous position bias is a score bias; the 0/-100 shift mask
``(windows, N, N)`` (HF adds it twice, to the same effect) is a mask: for a non-softmax activation a masked
pair contributes exactly zero and N counts the window's unmasked keys.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.swinv2 import modeling_swinv2 as swinv2

from ._common import HFSwitched, hf_adapter, merge_heads, split_heads

#: HF's clamp of the log logit scale (a temperature of at most 100).
MAX_LOG_SCALE = math.log(1.0 / 0.01)


@hf_adapter(swinv2.Swinv2SelfAttention)
class Swinv2SelfAttention(HFSwitched, swinv2.Swinv2SelfAttention):
    """``transformers.models.swinv2.modeling_swinv2.Swinv2SelfAttention``."""

    relies_on = ("Swinv2Attention.forward", "Swinv2Layer.forward", "Swinv2Layer.get_attn_mask")

    map_layout = "shifted_windows"

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None, output_attentions: bool | None = False
    ) -> tuple[Tensor]:
        rows, tokens, _ = hidden_states.shape
        d = self.attention_head_size
        q, k, v = (split_heads(projection(hidden_states), d) for projection in (self.query, self.key, self.value))
        q = F.normalize(q, dim=-1) * torch.clamp(self.logit_scale, max=MAX_LOG_SCALE).exp()
        k = F.normalize(k, dim=-1)
        table = self.continuous_position_bias_mlp(self.relative_coords_table).view(-1, self.num_attention_heads)
        bias = table[self.relative_position_index.view(-1)].view(tokens, tokens, -1).permute(2, 0, 1)
        masks = {"attn_bias": 16 * torch.sigmoid(bias)[None]}
        if attention_mask is not None:  # window w of batch element b is row b * windows + w
            masks["attn_mask"] = (attention_mask == 0).repeat(rows // attention_mask.shape[0], 1, 1).unsqueeze(1)
        out = self._attend(q, k, v, 1.0, dropout_p=self.dropout_p(self.dropout), **masks)
        out = merge_heads(out)
        return (out, None) if output_attentions else (out,)
