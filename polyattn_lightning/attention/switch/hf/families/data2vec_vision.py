"""Data2Vec-Vision (``data2vec_vision``): BEiT's attention (an older copy of it, outside the interface), its
relative-position bias a score bias.

``S = q k^T / sqrt(d) + B``: ``B`` is the layer's own relative-position bias (``Data2VecVisionRelativePositionBias``,
interpolated for another resolution as HF does) plus the model's shared one when given; there is no mask (the
model takes no padding). Both of HF's classes are switched, the eager one and the SDPA one (the default), which
compute the same thing.
"""

from __future__ import annotations

from torch import Tensor
from transformers.models.data2vec import modeling_data2vec_vision as d2v

from ._common import HFSwitched, hf_adapter, merge_heads, split_heads


class _Data2VecVisionSelfAttention(HFSwitched):
    def forward(
        self,
        hidden_states: Tensor,
        output_attentions: bool = False,
        relative_position_bias: Tensor | None = None,
        interpolate_pos_encoding: bool = False,
        resolution: tuple[int] | None = None,
    ) -> tuple[Tensor, None]:
        d = self.attention_head_size
        q, k, v = (split_heads(projection(hidden_states), d) for projection in (self.query, self.key, self.value))
        bias = None
        if self.has_relative_position_bias:
            height, width = resolution
            window_size = (height // self.config.patch_size, width // self.config.patch_size)
            bias = self.relative_position_bias(window_size, interpolate_pos_encoding, dim_size=hidden_states.shape[1])
        if relative_position_bias is not None:
            bias = relative_position_bias if bias is None else bias + relative_position_bias
        out = self._attend(q, k, v, d**-0.5, dropout_p=self.dropout_p(self.dropout), attn_bias=bias)
        return merge_heads(out), None


@hf_adapter(d2v.Data2VecVisionSelfAttention)
class Data2VecVisionSelfAttention(_Data2VecVisionSelfAttention, d2v.Data2VecVisionSelfAttention):
    """``transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSelfAttention`` (eager)."""

    relies_on = ("Data2VecVisionAttention.forward",)


@hf_adapter(d2v.Data2VecVisionSdpaSelfAttention)
class Data2VecVisionSdpaSelfAttention(_Data2VecVisionSelfAttention, d2v.Data2VecVisionSdpaSelfAttention):
    """``transformers.models.data2vec.modeling_data2vec_vision.Data2VecVisionSdpaSelfAttention``."""

    relies_on = ("Data2VecVisionAttention.forward",)
