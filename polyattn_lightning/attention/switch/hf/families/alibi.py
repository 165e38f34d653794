"""Falcon (``falcon``) and BLOOM (``bloom``): ALiBi, or (Falcon) rotary embeddings; computed by hand in HF.

HF passes ALiBi as ``slope_h * position_j``: softmax takes it as it is, every other activation its relative form
(``switch/hf/masks.py``: :func:`~..masks.relative_alibi`, and why).

* Falcon (``FalconAttention``, transformers 5.24, where it computes attention itself; from 5.25 on it calls the
  ``AttentionInterface`` and the ALiBi mask is a rule of ``masks.py``; ``switch/reviewed.json`` says which
  release takes which route). Its SDPA path, the default: with ALiBi the model adds ``alibi / sqrt(d)`` into its
  float mask, ``finfo.min`` where masked (split by equality); rotary models get HF's ``apply_rotary_pos_emb`` and
  a boolean mask; multi-query keys are broadcast to every head; temperature ``1 / sqrt(d)``. HF's eager path with
  ALiBi adds the bias twice (once itself, once in the mask); the switch follows the SDPA path.
* BLOOM (``BloomAttention``): ``S = q k^T / sqrt(d) + alibi`` (``baddbmm``, ``beta = 1``) plus the model's
  mask; the tensor-parallel output slices (``pretraining_tp``) and the residual dropout as HF's forward has them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers.models.bloom import modeling_bloom as bloom
from transformers.models.falcon import modeling_falcon as falcon

from ....masks import split_sentinels
from ..masks import relative_alibi
from ._common import HFSwitched, hf_adapter, merge_heads, own_mask


def _alibi_for(module: HFSwitched, bias: Tensor, num_queries: int) -> Tensor:
    return bias if module.activation.is_softmax else relative_alibi(bias, num_queries)


@hf_adapter(falcon.FalconAttention)
class FalconAttention(HFSwitched, falcon.FalconAttention):
    """``transformers.models.falcon.modeling_falcon.FalconAttention``."""

    relies_on = ("apply_rotary_pos_emb", "build_alibi_tensor", "FalconDecoderLayer.forward", "FalconModel.forward")

    def forward(
        self,
        hidden_states: Tensor,
        alibi: Tensor | None,
        attention_mask: Tensor | None,
        position_ids: Tensor | None = None,
        layer_past=None,
        use_cache: bool = False,
        output_attentions: bool = False,
        position_embeddings: tuple[Tensor, Tensor] | None = None,
        **kwargs,
    ) -> tuple[Tensor, None]:
        num_kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
        q, k, v = self._split_heads(self.query_key_value(hidden_states))
        batch, length = q.shape[:2]
        q = q.transpose(1, 2).reshape(batch, self.num_heads, length, self.head_dim)
        k, v = (x.transpose(1, 2).reshape(batch, num_kv_heads, length, self.head_dim) for x in (k, v))
        if alibi is None:
            cos, sin = position_embeddings
            q, k = falcon.apply_rotary_pos_emb(q, k, cos, sin)
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        k, v = (x.expand(-1, self.num_heads, -1, -1) for x in (k, v))  # multi-query: one k/v head for all
        causal, masks = False, {}
        if attention_mask is None:
            causal = length > 1
        elif alibi is None:
            causal, masks = own_mask(attention_mask)
        else:  # alibi / sqrt(d) with finfo.min where masked (FalconModel.forward)
            allowed, bias = split_sentinels(attention_mask)
            causal, masks = own_mask(allowed)
            masks["attn_bias"] = _alibi_for(self, bias, length)
        if alibi is not None and attention_mask is None:
            bias = alibi.reshape(batch, self.num_heads, 1, -1) / math.sqrt(self.head_dim)
            masks["attn_bias"] = _alibi_for(self, bias, length)
        dropout = self.dropout_p(self.attention_dropout) if alibi is not None else 0.0  # HF's SDPA path
        out = self._attend(q, k, v, self.inv_norm_factor, dropout_p=dropout, is_causal=causal, **masks)
        return self.dense(merge_heads(out)), None


@hf_adapter(bloom.BloomAttention)
class BloomAttention(HFSwitched, bloom.BloomAttention):
    """``transformers.models.bloom.modeling_bloom.BloomAttention``."""

    relies_on = ("dropout_add", "build_alibi_tensor", "BloomBlock.forward", "BloomModel.forward")

    def forward(
        self,
        hidden_states: Tensor,
        residual: Tensor,
        alibi: Tensor,
        attention_mask: Tensor | None,
        layer_past=None,
        use_cache: bool = False,
        output_attentions: bool = False,
        **kwargs,
    ) -> tuple[Tensor, None]:
        batch, length, _ = hidden_states.shape
        q, k, v = self._reshape(self.query_key_value(hidden_states))
        if layer_past is not None:
            k, v = layer_past.update(k, v, self.layer_idx)
        causal, masks = (length > 1, {}) if attention_mask is None else own_mask(attention_mask)
        bias = self.beta * alibi.view(batch, self.num_heads, 1, k.shape[2])
        masks["attn_bias"] = _alibi_for(self, bias, length)
        out = self._attend(
            q,
            k,
            v,
            self.inv_norm_factor,
            dropout_p=self.dropout_p(self.attention_dropout),
            is_causal=causal,
            **masks,
        )
        context = merge_heads(out)
        if self.pretraining_tp > 1 and self.slow_but_exact:
            step = self.hidden_size / self.pretraining_tp
            output = torch.zeros_like(context)
            for i in range(self.pretraining_tp):
                part = slice(int(i * step), int((i + 1) * step))
                output = output + F.linear(context[:, :, part], self.dense.weight[:, part])
        else:
            output = self.dense(context)
        return bloom.dropout_add(output, residual, self.hidden_dropout, self.training), None
