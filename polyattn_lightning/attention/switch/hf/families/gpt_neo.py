"""GPT-Neo (``gpt_neo``): causal attention, global or local (a sliding window) by layer, with no ``1/sqrt(d)``
scale.

Only the softmax step (``GPTNeoSelfAttention._attn``) is switched; HF's forward keeps its projections and
cache. The allowed pairs are the layer's own causal buffer (``bias``: lower-triangular, minus what lies beyond
``window_size`` in a local layer) and the model's mask (padding); temperature 1, as GPT-Neo was trained.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.gpt_neo import modeling_gpt_neo as gpt_neo

from ..masks import split_mask
from ._common import HFSwitched, allowed_by, hf_adapter


@hf_adapter(gpt_neo.GPTNeoSelfAttention)
class GPTNeoSelfAttention(HFSwitched, gpt_neo.GPTNeoSelfAttention):
    """``transformers.models.gpt_neo.modeling_gpt_neo.GPTNeoSelfAttention``."""

    relies_on = ("GPTNeoSelfAttention.forward", "GPTNeoAttention.forward")

    def _attn(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None = None):
        num_queries, num_keys = query.shape[-2], key.shape[-2]
        allowed = self.bias[:, :, num_keys - num_queries : num_keys, :num_keys]
        if attention_mask is not None:
            allowed = allowed & allowed_by(attention_mask)
        causal, masks = split_mask(allowed)
        out = self._attend(
            query, key, value, 1.0, dropout_p=self.dropout_p(self.attn_dropout), is_causal=causal, **masks
        )
        return out, None
