"""What Hugging Face attention calls pass beyond q, k, v and a mask: ``position_bias``, ``s_aux``, ``softcap``.

* ``position_bias`` (T5, mT5, LongT5, Switch Transformers, Pix2Struct, LayoutLMv3...): a score bias added to
  ``S`` before ``phi``; its ``finfo.min`` / ``-inf`` entries (LongT5 adds its local mask into it) mask, by
  equality. T5 has no ``1/sqrt(d)`` scale: it passes ``scaling=1.0``, the temperature.
* ``s_aux`` (GPT-OSS's learned attention sinks, one logit per head) and ``sinks`` (Inkling 2's, one per query
  row, ``(B, H, Q, 1)``): for softmax, an extra logit in every row's normaliser whose weight is dropped,
  ``exp(S_j) / (sum_k exp(S_k) + exp(s_h))``. :func:`with_sinks`
  writes it as one more key, first in the row, with key and value 0 and score bias ``s_h``: exact for softmax
  (its weight multiplies a zero value), and the same key for every other activation: ``phi(s_h) * 0`` adds
  nothing to the output and the key counts in N (N = the row's keys + 1). So for an elementwise ``phi`` the
  sinks change only N, and ``s_aux`` gets no gradient (docs/howto/switch-hf.md says so).
* ``softcap`` (Gemma 2, T5Gemma, VaultGemma): ``S -> c * tanh(S / c)`` before the mask and ``phi``, as HF's
  eager code has it: :func:`softcapped_attention` materialises the map (fp32 scores), as HF's eager path does
  (its SDPA path refuses ``softcap``). A ``capture`` hook sees the scores before the cap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ...dtypes import autocast_off, compute_dtype
from ...functional import resolve_scores
from ...masks import keys_per_row, split_sentinels, with_causal
from ...registry import ActivationSpec, get_activation


def with_position_bias(masks: dict[str, Tensor], position_bias: Tensor) -> dict[str, Tensor]:
    """``masks`` with ``position_bias`` added to the score bias, its sentinel entries (if any) masking."""
    if torch.compiler.is_compiling() or not bool((position_bias <= torch.finfo(position_bias.dtype).min).any()):
        bias = position_bias
    else:
        allowed, bias = split_sentinels(position_bias)
        given = masks.get("attn_mask")
        masks = {**masks, "attn_mask": allowed if given is None else _and_mask(given, allowed)}
    if masks.get("attn_bias") is not None:
        bias = masks["attn_bias"] + bias
    return {**masks, "attn_bias": bias}


def _and_mask(mask: Tensor, allowed: Tensor) -> Tensor:
    """A bool or float (0 keep / negative mask) ``mask`` restricted to ``allowed``."""
    if mask.dtype == torch.bool:
        return mask & allowed
    return mask.masked_fill(~allowed, float("-inf"))


def with_sinks(key: Tensor, value: Tensor, masks: dict[str, Tensor], sinks: Tensor):
    """``(key, value, masks)`` with the sink as key 0 of every row: k = v = 0, score bias the sink logit, attended
    by every query (the causal diagonal, bottom-right, keeps the same real keys: there is one more key at the
    front); ``sinks`` is ``(H,)`` (one per query head) or ``(B, H, Q, 1)`` (one per row)."""
    batch, heads, _, dim = key.shape
    key = torch.cat([key.new_zeros(batch, heads, 1, dim), key], dim=2)
    value = torch.cat([value.new_zeros(batch, heads, 1, value.shape[-1]), value], dim=2)
    masks = dict(masks)
    if masks.get("attn_mask") is not None:
        mask = masks["attn_mask"]
        masks["attn_mask"] = F.pad(mask, (1, 0), value=True if mask.dtype == torch.bool else 0.0)
    if masks.get("key_padding_mask") is not None:
        masks["key_padding_mask"] = F.pad(masks["key_padding_mask"], (1, 0), value=False)
    column = sinks.reshape(1, heads, 1, 1) if sinks.dim() == 1 else sinks
    sink = F.pad(column.to(key.dtype), (0, key.shape[2] - 1))
    bias = masks.get("attn_bias")
    masks["attn_bias"] = sink if bias is None else F.pad(bias, (1, 0)) + sink
    return key, value, masks


def softcapped_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    spec: ActivationSpec,
    temperature: float,
    softcap: float,
    dropout_p: float,
    is_causal: bool,
    masks: dict[str, Tensor],
) -> Tensor:
    """``phi(c * tanh(S / c) + bias) @ v``, the map materialised in fp32 (``S = q k^T * temperature``); masks and
    N as ``attention()`` has them; ``(B, H, Q, dv)`` in ``value``'s dtype."""
    act = get_activation(spec)
    _, _, resolved = resolve_scores(
        query,
        key,
        act,
        None,
        temperature,
        masks.get("key_padding_mask"),
        masks.get("attn_mask"),
        masks.get("attn_bias"),
        is_causal=is_causal,
    )
    num_queries, num_keys = query.shape[-2], key.shape[-2]
    allowed = with_causal(resolved.allowed, resolved.causal, num_queries, num_keys, query.device)
    dtype = compute_dtype(query) if not act.is_softmax else torch.promote_types(query.dtype, torch.float32)
    with autocast_off(query.device.type):
        scores = (query.to(dtype) @ key.to(dtype).transpose(-2, -1)) * temperature
        scores = softcap * torch.tanh(scores / softcap)
        if masks.get("attn_bias") is not None:
            scores = scores + masks["attn_bias"].to(dtype)
        if act.is_softmax:
            if resolved.additive is not None:
                scores = scores + resolved.additive.to(dtype)
            if allowed is not None:
                scores = scores.masked_fill(~allowed, float("-inf"))
            weights = scores.softmax(dim=-1).nan_to_num(0.0)  # a row with no key: zero output
        else:
            weights = act(scores, keys_per_row(resolved.allowed, num_keys, query.device, resolved.causal).to(dtype))
            if allowed is not None:
                weights = weights.masked_fill(~allowed, 0.0)
        if dropout_p:
            weights = F.dropout(weights, dropout_p)
        return (weights @ value.to(dtype)).to(value.dtype)


__all__ = ["softcapped_attention", "with_position_bias", "with_sinks"]
