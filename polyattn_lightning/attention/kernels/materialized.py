"""``materialized``: the whole ``N x N`` score matrix at once. Simple, for small shapes, and the reference.

Supports every elementwise activation, mask, score bias, dropout (PyTorch's) and causal attention; autograd
differentiates it. Never picked by ``auto``: its memory is O(N^2) per head.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from ..dtypes import autocast_off, compute_dtype
from ..masks import with_causal
from .base import Backend, KernelInputs, elementwise_reasons


def materialized(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None) -> Tensor:
    """``c(n) * mask(f(q k^T t + b(n) + bias)) @ v`` with the map materialised (fp32 scores, ``v``'s dtype out)."""
    allowed = with_causal(allowed, causal, q.shape[-2], k.shape[-2], q.device)
    dtype = compute_dtype(q)
    with autocast_off(q.device.type):
        s = (q.to(dtype) @ k.to(dtype).transpose(-2, -1)) * t
        if bias is not None:
            s = s + bias.to(dtype)
        p = act(s, n.to(dtype))
        if allowed is not None:
            p = p.masked_fill(~allowed, 0.0)
        if dropout_p:
            p = F.dropout(p, dropout_p)
        return (p @ v.to(dtype)).to(v.dtype)


class Materialized(Backend):
    name = "materialized"
    supports = "any elementwise activation, mask, bias, dropout, causal; O(N^2) memory (a reference, never auto)"
    in_auto = False

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        return elementwise_reasons(inputs)

    def forward(self, inputs: KernelInputs) -> Tensor:
        return materialized(*inputs.tiled)


BACKEND = Materialized()
