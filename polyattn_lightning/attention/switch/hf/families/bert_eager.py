"""BERT's attention as HF's older copies compute it by hand (``S = q k^T / sqrt(d) + mask``): Megatron-BERT
(``megatron_bert``), RemBERT (``rembert``), TAPAS (``tapas``) and VisualBERT (``visual_bert``).

The mask is the model's own (``create_bidirectional_mask`` or, as a decoder, ``create_causal_mask``; VisualBERT's
extended mask over text and visual tokens); cross attention and the cache as HF's forward has them (VisualBERT
has neither). Only the return conventions differ: ``(context, None)`` (Megatron-BERT, RemBERT), ``(context,)``
(TAPAS, plus the cache as a decoder; VisualBERT).
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.megatron_bert import modeling_megatron_bert as megatron
from transformers.models.rembert import modeling_rembert as rembert
from transformers.models.tapas import modeling_tapas as tapas
from transformers.models.visual_bert import modeling_visual_bert as visual_bert

from ._common import HFSwitched, cached_key_values, hf_adapter, merge_heads, own_mask, split_heads


class _BertEager(HFSwitched):
    def _bert_attention(
        self, hidden_states: Tensor, attention_mask: Tensor | None, encoder_hidden_states, cache, kwargs
    ) -> Tensor:
        """The layer's ``(B, L, H * d)`` context."""
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
        return merge_heads(out)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, **kwargs):
        kwargs.pop("output_attentions", None)
        return self._bert_attention(hidden_states, attention_mask, encoder_hidden_states, cache, kwargs), None


@hf_adapter(megatron.MegatronBertSelfAttention)
class MegatronBertSelfAttention(_BertEager, megatron.MegatronBertSelfAttention):
    """``transformers.models.megatron_bert.modeling_megatron_bert.MegatronBertSelfAttention``."""

    relies_on = ("MegatronBertAttention.forward",)


@hf_adapter(rembert.RemBertSelfAttention)
class RemBertSelfAttention(_BertEager, rembert.RemBertSelfAttention):
    """``transformers.models.rembert.modeling_rembert.RemBertSelfAttention``."""

    relies_on = ("RemBertAttention.forward",)


@hf_adapter(tapas.TapasSelfAttention)
class TapasSelfAttention(_BertEager, tapas.TapasSelfAttention):
    """``transformers.models.tapas.modeling_tapas.TapasSelfAttention``."""

    relies_on = ("TapasAttention.forward",)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None, **kwargs):
        kwargs.pop("output_attentions", None)
        context = self._bert_attention(hidden_states, attention_mask, encoder_hidden_states, cache, kwargs)
        return (context, cache) if self.is_decoder else (context,)


@hf_adapter(visual_bert.VisualBertSelfAttention)
class VisualBertSelfAttention(_BertEager, visual_bert.VisualBertSelfAttention):
    """``transformers.models.visual_bert.modeling_visual_bert.VisualBertSelfAttention``; no cache, no cross
    attention (its layers' masks are the extended ``(B, 1, 1, N)`` ones)."""

    relies_on = ("VisualBertAttention.forward",)

    def forward(self, hidden_states, attention_mask=None, output_attentions=False):
        return (self._bert_attention(hidden_states, attention_mask, None, None, {}),)
