"""RoFormer (``roformer``): rotary position embeddings on q and k (and v with ``rotary_value``), then BERT's
attention (``S = q k^T / sqrt(d) + mask``), computed by hand in HF.

The rotation is HF's own ``apply_rotary_position_embeddings``, applied where HF applies it (self-attention,
before the cache); masks, cross attention and the cache as HF's forward has them.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.roformer import modeling_roformer as roformer

from ._common import HFSwitched, cached_key_values, hf_adapter, merge_heads, own_mask, split_heads


@hf_adapter(roformer.RoFormerSelfAttention)
class RoFormerSelfAttention(HFSwitched, roformer.RoFormerSelfAttention):
    """``transformers.models.roformer.modeling_roformer.RoFormerSelfAttention``."""

    relies_on = ("RoFormerAttention.forward", "RoFormerEncoder.forward")

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        sinusoidal_pos: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        cache=None,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[Tensor, None]:
        d = self.attention_head_size
        q = split_heads(self.query(hidden_states), d)
        cross = encoder_hidden_states is not None
        rotated = {}

        def project(states: Tensor) -> tuple[Tensor, Tensor]:
            k, v = split_heads(self.key(states), d), split_heads(self.value(states), d)
            if not cross and sinusoidal_pos is not None:
                if self.rotary_value:
                    rotated["q"], k, v = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k, v)
                else:
                    rotated["q"], k = self.apply_rotary_position_embeddings(sinusoidal_pos, q, k)
            return k, v

        k, v = cached_key_values(self, encoder_hidden_states if cross else hidden_states, cache, cross, project, kwargs)
        causal, masks = own_mask(attention_mask)
        out = self._attend(
            rotated.get("q", q), k, v, d**-0.5, dropout_p=self.dropout_p(self.dropout), is_causal=causal, **masks
        )
        return merge_heads(out), None
