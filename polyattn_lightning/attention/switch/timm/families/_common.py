"""What several hand-computed timm families share: Swin's window masks, talking-heads attention, no dropout."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ....masks import keys_per_row
from ....dtypes import compute_dtype
from ...base import AttentionInputs, SwitchedAttention


def window_mask(mask: Tensor | None, rows: int) -> Tensor | None:
    """Swin's shift mask ``(windows, N, N)`` (0 keep, -100 mask) as ``attn_mask`` for ``rows`` window rows.

    Windows are batch-major (row ``b * windows + w`` uses ``mask[w]``), as timm's ``view(-1, windows, ...)``
    has it; ``attention()`` turns -100 into "masked" for a non-softmax activation, so a masked key counts
    for nothing and N is the number of unmasked keys of the window.
    """
    if mask is None:
        return None
    return mask.repeat(rows // mask.shape[0], 1, 1).unsqueeze(1)


class SwitchedWithoutDropout(SwitchedAttention):
    """``SwitchedAttention`` for timm classes without ``attn_drop`` (``_attend`` reads ``attn_drop.p``).

    The dropout is a class attribute, so it is no submodule: the state_dict and ``named_modules`` stay timm's.
    """

    attn_drop = nn.Dropout(0.0)


HeadMix = Callable[[Tensor], Tensor]


def talking_heads(
    module: SwitchedAttention,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    temperature: float,
    mix_weight: Tensor,
    mix_before: HeadMix,
    mix_after: HeadMix,
    attn_bias: Tensor | None = None,
) -> Tensor:
    """``mix_after(phi(mix_before(q k^T * t + attn_bias))) @ v``: talking-heads attention (CaiT, EfficientFormerV2).

    The heads are mixed between the scores and ``phi`` and again after it, so no fused ``phi(S) @ v``
    kernel applies: the map is materialised, scores and ``phi`` in fp32, N = the keys. ``mix_before`` and
    ``mix_after`` act on ``(B, H, Nq, Nk)``; ``mix_weight`` is ``mix_before``'s ``(H_out, H_in)`` matrix.

    ``capture`` gets the scores ``phi`` is applied to, written as ``q' k'^T + b'`` (``q'_g`` concatenates
    ``W[g, h] * t * q_h`` over ``h``, ``k'`` the keys of every head, ``b'`` = ``mix_before`` of the bias),
    so norms and maps are those of ``phi`` where it acts; the map is ``phi`` before the second head
    mixing, so ``attention_map(...) @ v`` is not this layer's output.
    """
    if module.capture is not None:
        module.capture(module, _mixed_inputs(q, k, v, temperature, mix_weight, mix_before, attn_bias))
    dtype = compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        scores = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) * temperature
        if attn_bias is not None:
            scores = scores + attn_bias.to(dtype)
        mixed = mix_before(scores.to(mix_weight.dtype)).to(dtype)
        weights = module.activation(mixed, keys_per_row(None, k.shape[-2], q.device))
        weights = module.attn_drop(mix_after(weights.to(mix_weight.dtype)))
        return (weights.to(dtype) @ v.to(dtype)).to(v.dtype)


def _mixed_inputs(q, k, v, temperature, mix_weight, mix_before, attn_bias) -> AttentionInputs:
    B, H, Nk, d = k.shape
    mixed_q = torch.einsum("gh,bhnd->bgnhd", mix_weight.to(q.dtype), q * temperature).flatten(-2)
    keys = k.transpose(1, 2).reshape(B, 1, Nk, H * d).expand(B, mix_weight.shape[0], Nk, H * d)
    bias = attn_bias if attn_bias is not None else q.new_zeros(1, H, 1, 1)
    return AttentionInputs(mixed_q, keys, v, 1.0, attn_bias=mix_before(bias))


__all__ = ["SwitchedWithoutDropout", "talking_heads", "window_mask"]
