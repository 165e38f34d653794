"""DeBERTa (``deberta``) and DeBERTa-v2/v3 (``deberta_v2``): disentangled attention, its c2p / p2c terms as a
score bias.

``S = (q k^T + c2p + p2c) / sqrt(d * (1 + #position types))``: the content-to-position and position-to-content
terms (HF's own ``disentangled_att_bias`` / ``disentangled_attention_bias``, fed the same q and k) are a score
bias with its gradient into q, k and the relative embeddings; the scale is the temperature (v1 divides q by it
before the bias is made, as HF does; v2 divides inside the bias helper). The position types are counted as HF
counts them: v1 every entry of ``pos_att_type``, v2 only ``c2p`` and ``p2c`` (a ``p2p`` entry or a repeated one
changes v1's scale, not v2's). The mask is DeBERTa's 0/1 pair mask
``(B, 1, N, N)``, nonzero attends (float or integer: ``.bool()``, as HF reads it); a padded query attends
nothing: its output is zero, HF's a uniform average, neither is read. DeBERTa v1's ``talking_head`` option
(heads mixed before and after the softmax) is refused.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.deberta import modeling_deberta as v1
from transformers.models.deberta_v2 import modeling_deberta_v2 as v2

from ._common import HFSwitched, hf_adapter, merge_heads, own_mask


@hf_adapter(v1.DisentangledSelfAttention)
class DebertaSelfAttention(HFSwitched, v1.DisentangledSelfAttention):
    """``transformers.models.deberta.modeling_deberta.DisentangledSelfAttention``."""

    relies_on = ("scaled_size_sqrt", "DebertaAttention.forward", "DebertaEncoder.forward")

    def refusal(self) -> str | None:
        if self.talking_head:
            return "talking_head=True mixes the heads before and after the softmax, which no adapter expresses"
        return None

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        output_attentions: bool = False,
        query_states: Tensor | None = None,
        relative_pos: Tensor | None = None,
        rel_embeddings: Tensor | None = None,
    ) -> tuple[Tensor, None]:
        q, k, v = self.transpose_for_scores(self.in_proj(hidden_states)).chunk(3, dim=-1)
        if query_states is not None:  # the enhanced mask decoder's queries: the query rows of the same weight
            q = self.transpose_for_scores(self.in_proj(query_states)).chunk(3, dim=-1)[0]
        q = q + self.transpose_for_scores(self.q_bias[None, None, :])
        v = v + self.transpose_for_scores(self.v_bias[None, None, :])
        scale_factor = 1 + len(self.pos_att_type)
        q = q / v1.scaled_size_sqrt(q, scale_factor).to(q.dtype)
        bias = None
        if self.relative_attention and rel_embeddings is not None and relative_pos is not None:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            bias = self.disentangled_att_bias(q, k, relative_pos, rel_embeddings, scale_factor)
        causal, masks = own_mask(attention_mask.bool())  # 0/1 (float or integer), as HF reads it
        if isinstance(bias, Tensor):
            masks["attn_bias"] = bias
        out = self._attend(q, k, v, 1.0, dropout_p=self.dropout_p(self.dropout), is_causal=causal, **masks)
        return merge_heads(out), None


@hf_adapter(v2.DisentangledSelfAttention)
class DebertaV2SelfAttention(HFSwitched, v2.DisentangledSelfAttention):
    """``transformers.models.deberta_v2.modeling_deberta_v2.DisentangledSelfAttention`` (heads in the batch
    axis, ``(B * H, N, d)``, as HF lays them out)."""

    relies_on = ("scaled_size_sqrt", "DebertaV2Attention.forward", "DebertaV2Encoder.forward")

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor,
        output_attentions: bool = False,
        query_states: Tensor | None = None,
        relative_pos: Tensor | None = None,
        rel_embeddings: Tensor | None = None,
    ) -> tuple[Tensor, None]:
        if query_states is None:
            query_states = hidden_states
        heads = self.num_attention_heads
        q = self.transpose_for_scores(self.query_proj(query_states), heads)
        k = self.transpose_for_scores(self.key_proj(hidden_states), heads)
        v = self.transpose_for_scores(self.value_proj(hidden_states), heads)
        scale_factor = 1 + ("c2p" in self.pos_att_type) + ("p2c" in self.pos_att_type)
        bias = None
        if self.relative_attention:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            bias = self.disentangled_attention_bias(q, k, relative_pos, rel_embeddings, scale_factor)
        q, k, v = (x.view(-1, heads, *x.shape[1:]) for x in (q, k, v))
        causal, masks = own_mask(attention_mask.bool())  # 0/1 (float or integer), as HF reads it
        if isinstance(bias, Tensor):  # HF returns 0 without position types
            masks["attn_bias"] = bias.view(-1, heads, *bias.shape[1:])
        temperature = (q.shape[-1] * scale_factor) ** -0.5
        out = self._attend(q, k, v, temperature, dropout_p=self.dropout_p(self.dropout), is_causal=causal, **masks)
        return merge_heads(out), None
