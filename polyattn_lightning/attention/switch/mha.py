"""``torch.nn.MultiheadAttention`` on the registry activation, wherever a model holds one.

PyTorch's own module is used by user models, SigLIP's attention-pooling head (Hugging Face), DETR-style
decoders...: :class:`SwitchedMultiheadAttention` is its switch for both doors (the timm/generic one takes any
``nn.Module`` holding it; the Hugging Face one switches it beside the model's own attention).

The steps are ``F.multi_head_attention_forward``'s (torch 2.x), with its softmax as ``attention()``:

* projections: the packed ``in_proj_weight`` or the separate ``q/k/v_proj_weight`` (``kdim``/``vdim``), the
  ``in_proj_bias``; ``bias_k``/``bias_v`` (``add_bias_kv``) and ``add_zero_attn`` append one key/value each
  (attendable by every query, as PyTorch pads the masks with "keep"); temperature ``head_dim ** -0.5``;
* masks: a bool ``attn_mask`` is True where a pair may *not* attend (PyTorch's MHA convention, the opposite of
  SDPA's); a float ``attn_mask`` or ``key_padding_mask`` is added to the scores, so its ``-inf``/``finfo.min``
  entries mask and every other entry is a score bias (:func:`~polyattn_lightning.attention.masks.split_sentinels`;
  softmax takes it unchanged); ``attn_mask`` is ``(L, S)`` or ``(B * heads, L, S)``; ``is_causal`` is PyTorch's
  hint that ``attn_mask`` is causal (the mask is used);
* ``dropout`` on the attention weights in training, ``batch_first``, unbatched ``(L, E)`` inputs;
* ``need_weights``: the weights ``phi(S)`` (materialised, fp32), averaged over heads unless
  ``average_attn_weights=False``, as PyTorch returns them; ``need_weights=False`` returns None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..masks import split_sentinels
from .base import AttentionInputs, SwitchedAttention, attention_map, register_adapter


@register_adapter(nn.MultiheadAttention)
class SwitchedMultiheadAttention(SwitchedAttention, nn.MultiheadAttention):
    """``nn.MultiheadAttention`` whose softmax is the registry activation (module docstring)."""

    relies_on = ("F.multi_head_attention_forward",)  # the steps mirrored (torch.nn.modules.activation's F)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if is_causal and attn_mask is None:
            raise RuntimeError("nn.MultiheadAttention: is_causal is a hint that attn_mask is causal; pass attn_mask")
        batched = query.dim() == 3
        if not batched:  # (L, E): one sequence
            query, key, value = (x.unsqueeze(0) for x in (query, key, value))
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, B, E) -> (B, L, E)
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        batch, length = query.shape[:2]
        q, k, v = self._project(query, key, value)
        extra = k.shape[2] - key.shape[1]  # keys appended by bias_k / add_zero_attn: every query may attend them
        masks = self._masks(length, k.shape[2], extra, key_padding_mask, attn_mask, q)
        dropout = self.dropout if self.training else 0.0
        temperature = self.head_dim**-0.5
        out = self._attend(q, k, v, temperature, dropout_p=dropout, **masks)
        out = self.out_proj(out.transpose(1, 2).reshape(batch, length, self.embed_dim))
        weights = None
        if need_weights:
            weights = attention_map(AttentionInputs(q, k, v, temperature, **masks), self.activation)
            weights = weights.mean(dim=1) if average_attn_weights else weights
            weights = weights if batched else weights.squeeze(0)
        if not batched:
            return out.squeeze(0), weights
        return (out if self.batch_first else out.transpose(0, 1)), weights

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v as ``(B, heads, L, head_dim)``, with ``bias_k``/``bias_v`` and the zero key appended."""
        if self._qkv_same_embed_dim:
            weights = self.in_proj_weight.chunk(3)
        else:
            weights = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        biases = self.in_proj_bias.chunk(3) if self.in_proj_bias is not None else (None, None, None)
        q, k, v = (F.linear(x, w, b) for x, w, b in zip((query, key, value), weights, biases))
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.reshape(1, 1, -1).expand(k.shape[0], 1, -1)], dim=1)
            v = torch.cat([v, self.bias_v.reshape(1, 1, -1).expand(v.shape[0], 1, -1)], dim=1)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(k.shape[0], 1, k.shape[2])], dim=1)
            v = torch.cat([v, v.new_zeros(v.shape[0], 1, v.shape[2])], dim=1)
        return tuple(x.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2) for x in (q, k, v))

    def _masks(
        self,
        length: int,
        num_keys: int,
        extra: int,
        key_padding_mask: Tensor | None,
        attn_mask: Tensor | None,
        like: Tensor,
    ) -> dict[str, Tensor]:
        """PyTorch's MHA masks as ``attention()``'s ``attn_mask`` / ``attn_bias`` / ``key_padding_mask``."""
        masks: dict[str, Tensor] = {}
        additive: list[Tensor] = []
        if key_padding_mask is not None:
            padding = F.pad(key_padding_mask, (0, extra), value=False if key_padding_mask.dtype == torch.bool else 0.0)
            if padding.dtype == torch.bool:
                masks["key_padding_mask"] = padding
            else:
                additive.append(padding.to(like.dtype)[:, None, None, :])
        if attn_mask is not None:
            if attn_mask.dim() == 3:  # (B * heads, L, S)
                attn_mask = attn_mask.reshape(-1, self.num_heads, length, num_keys - extra)
            if attn_mask.dtype == torch.bool:
                masks["attn_mask"] = ~F.pad(attn_mask, (0, extra), value=False)
            else:
                additive.append(F.pad(attn_mask.to(like.dtype), (0, extra), value=0.0))
        if additive:
            mask = additive[0] if len(additive) == 1 else additive[0] + additive[1]
            if self.activation.is_softmax and "attn_mask" not in masks:
                masks["attn_mask"] = mask  # SDPA adds it, as PyTorch does
            else:
                allowed, bias = split_sentinels(mask)
                masks["attn_mask"] = allowed if "attn_mask" not in masks else masks["attn_mask"] & allowed
                masks["attn_bias"] = bias
        return masks


__all__ = ["SwitchedMultiheadAttention"]
