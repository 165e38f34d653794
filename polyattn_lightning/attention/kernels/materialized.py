"""``materialized``: the whole ``N x N`` score matrix at once. Simple, for small shapes, and the reference.

Supports every elementwise activation, mask, score bias, dropout (PyTorch's) and causal attention; autograd
differentiates it. Never picked by ``auto`` for a parallel call: its memory is O(N^2) per head. Its KV-cache step
(:func:`materialized_step`: a few rows against the cache, ``R x N`` scores) is what ``auto`` runs for a generation
step where the fused C++ step cannot (CUDA, a custom activation, no C++ build).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..dtypes import autocast_off, compute_dtype
from ..masks import causal_mask, with_causal
from ..registry import Activation
from .base.contract import KV_STEP, PARALLEL, Backend, KernelInputs, KVStep, elementwise_reasons, stateless_reasons


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


def materialized_step(
    query: Tensor, key: Tensor, value: Tensor, act: Activation, t: float, causal: bool = False
) -> Tensor:
    """A KV-cache step, ``(B, H, R, dv)``: :func:`materialized` on the small ``(rows x cache)`` scores, grouped-query
    heads side by side on their kv head (broadcast, so the cache is not repeated). Not causal: every row attends all
    ``Nk`` keys; causal: row ``r`` of ``R`` attends the first ``Nk - R + r + 1``."""
    batch, heads, rows, dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    grouped = query.reshape(batch, kv_heads, group * rows, dim)  # row g * rows + r: head g of the group, row r
    allowed = None
    if causal:
        allowed = causal_mask(rows, num_keys, query.device).repeat(group, 1)
        first = num_keys - rows + 1  # the keys row 0 attends (a count below 1 is clamped by the activation)
        keys = torch.arange(first, first + rows, dtype=torch.float32, device=query.device).repeat(group).view(-1, 1)
    else:
        keys = torch.full((1, 1, 1, 1), float(num_keys), device=query.device)
    out = materialized(grouped, key, value, act, t, allowed, None, keys, 0.0)
    return out.view(batch, heads, rows, -1)


class Materialized(Backend):
    name = "materialized"
    supports = "any elementwise activation, mask, bias, dropout, causal; O(N^2) memory (a reference, never auto)"
    decomposable = True
    in_auto = False
    forms = frozenset({PARALLEL, KV_STEP})

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        return stateless_reasons(inputs, self.name) + elementwise_reasons(inputs)

    def forward(self, inputs: KernelInputs) -> Tensor:
        return materialized(*inputs.tiled)

    def kv_step(self, act: Activation) -> KVStep:
        return lambda q, k, v, t, causal: materialized_step(q, k, v, act, t, causal)


BACKEND = Materialized()
