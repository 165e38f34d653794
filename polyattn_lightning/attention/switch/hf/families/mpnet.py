"""MPNet (``mpnet``): BERT's attention with a relative-position bias, computed by hand in HF.

``S = q k^T / sqrt(d) + position_bias + mask``: the bucketed relative bias (``MPNetEncoder.compute_position_bias``,
shared by every layer) is a score bias; the mask is the model's own (``create_bidirectional_mask``).
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.mpnet import modeling_mpnet as mpnet

from ._common import HFSwitched, hf_adapter, merge_heads, own_mask, split_heads


@hf_adapter(mpnet.MPNetSelfAttention)
class MPNetSelfAttention(HFSwitched, mpnet.MPNetSelfAttention):
    """``transformers.models.mpnet.modeling_mpnet.MPNetSelfAttention``."""

    relies_on = ("MPNetAttention.forward", "MPNetEncoder.forward", "MPNetEncoder.compute_position_bias")

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        position_bias: Tensor | None = None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[Tensor]:
        d = self.attention_head_size
        q, k, v = (split_heads(projection(hidden_states), d) for projection in (self.q, self.k, self.v))
        causal, masks = own_mask(attention_mask)
        if position_bias is not None:
            masks["attn_bias"] = position_bias
        out = self._attend(q, k, v, d**-0.5, dropout_p=self.dropout_p(self.dropout), is_causal=causal, **masks)
        out = self.o(merge_heads(out))
        return (out, None) if output_attentions else (out,)
