"""``sdpa``: softmax on PyTorch's fused ``scaled_dot_product_attention`` (flash / memory-efficient / math).

Takes softmax only, with every mask, score bias, dropout and causal alignment ``attention()`` accepts; rows
with no attendable key give zeros instead of SDPA's NaN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..masks import Masks, causal_mask
from .base.contract import Backend, KernelInputs, stateless_reasons


def sdpa(q, k, v, masks: Masks, attn_bias, t, dropout_p) -> Tensor:
    """Softmax on SDPA; rows with no attendable key give zeros instead of NaN.

    A float mask or bias is cast to q's dtype: SDPA refuses one of another dtype (fp32 aside).
    Causal alone: SDPA's own ``is_causal`` for ``Nq == Nk`` (its fastest path), the lower-right
    ``CausalBias`` for ``Nq < Nk``; otherwise (``Nq > Nk``: rows with no key, or other masks)
    the causal mask is materialised into the boolean / additive mask.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    if masks.causal is not None and masks.allowed is None and attn_bias is None and masks.causal >= 0:
        if masks.causal == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=t)
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(nq, nk), dropout_p=dropout_p, scale=t
        )
    if masks.causal is not None:
        tri = causal_mask(nq, nk, q.device)
        additive = None if masks.additive is None else masks.additive.masked_fill(~tri, float("-inf"))
        masks = Masks(tri if masks.allowed is None else masks.allowed & tri, additive)
    mask = masks.additive.to(q.dtype) if masks.additive is not None else masks.allowed
    if attn_bias is not None:
        bias = attn_bias.to(q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    empty = None
    if masks.allowed is not None:
        empty = ~masks.allowed.any(dim=-1, keepdim=True)
        # unmask empty rows so SDPA stays finite, then zero them; compiled: always, so no data-dependent branch
        if torch.compiler.is_compiling() or bool(empty.any()):
            mask = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
        else:
            empty = None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=t)
    return out.masked_fill(empty, 0.0) if empty is not None else out


class Sdpa(Backend):
    name = "sdpa"
    supports = "softmax only (PyTorch's fused SDPA), every mask, bias, dropout and causal alignment"
    decomposable = True

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = stateless_reasons(inputs, self.name)
        if not inputs.act.is_softmax:
            reasons.append(f"activation {inputs.act.name!r} is not softmax (SDPA computes softmax only)")
        return reasons

    def forward(self, inputs: KernelInputs) -> Tensor:
        i = inputs
        return sdpa(i.q, i.k, i.v, i.masks, i.bias, i.t, i.dropout_p)


BACKEND = Sdpa()
