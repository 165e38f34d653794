"""Megatron-BERT (``megatron_bert``): BERT's attention computed by hand (``S = q k^T / sqrt(d) + mask``).

The mask is the model's own (``create_bidirectional_mask``, or ``create_causal_mask`` as a decoder), cross
attention and the cache as HF's forward has them.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.megatron_bert import modeling_megatron_bert as megatron

from ._common import HFSwitched, cached_key_values, hf_adapter, merge_heads, own_mask, split_heads


@hf_adapter(megatron.MegatronBertSelfAttention)
class MegatronBertSelfAttention(HFSwitched, megatron.MegatronBertSelfAttention):
    """``transformers.models.megatron_bert.modeling_megatron_bert.MegatronBertSelfAttention``."""

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        cache=None,
        output_attentions: bool | None = False,
        **kwargs,
    ) -> tuple[Tensor, None]:
        d = self.attention_head_size
        q = split_heads(self.query(hidden_states), d)
        cross = encoder_hidden_states is not None
        k, v = cached_key_values(
            self,
            encoder_hidden_states if cross else hidden_states,
            cache,
            cross,
            lambda x: (split_heads(self.key(x), d), split_heads(self.value(x), d)),
            kwargs,
        )
        causal, masks = own_mask(attention_mask)
        out = self._attend(q, k, v, d**-0.5, dropout_p=self.dropout_p(self.dropout), is_causal=causal, **masks)
        return merge_heads(out), None
