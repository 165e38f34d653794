"""The non-softmax kernels behind ``attention()``, by name.

All take the same normalised arguments: ``act`` (an elementwise Activation),
``t`` (temperature), ``allowed`` (bool mask or None), ``bias`` (additive score
bias or None), ``n`` (keys per row, fp32) and ``dropout_p``, and the keyword
``causal`` (the causal diagonal offset ``Nk - Nq``, or None). Scores and
``phi(S)`` are fp32 in every kernel (fp64 for fp64 inputs); the output has
``v``'s dtype. The hand-written backward passes are differentiable once:
asking for a second derivative raises instead of returning a wrong one.

* ``materialized``: the whole ``N x N`` at once; simple, a reference.
* ``blocked``: tiles, custom backward; CPU and GPU, any activation (``blocked.py``).
* ``fused_cpu``: the same walk in C++, the fast path on CPU (``fused_cpu.py``).
* ``associative``: ``poly1`` as ``q (k^T v)`` (``associative.py``).
* ``triton``: fused CUDA kernel (``triton_kernel.py``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .associative import associative
from .blocked import blocked
from .fused_cpu import fused_cpu
from .masks import with_causal
from .registry import autocast_off, compute_dtype
from .triton_kernel import triton_attention


def materialized(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None) -> Tensor:
    """The whole ``N x N`` score matrix at once: simplest, for small shapes and as a reference."""
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


_KERNELS = {
    "materialized": materialized,
    "blocked": blocked,
    "fused_cpu": fused_cpu,
    "associative": associative,
    "triton": triton_attention,
}


def run(kernel: str, q, k, v, act, t, allowed, bias, n, dropout_p, causal: int | None = None) -> Tensor:
    if kernel not in _KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not available here; available: {sorted(_KERNELS)}")
    if 0 in (*q.shape[:3], k.shape[-2]):  # nothing to tile: an empty batch, no queries or no keys (zeros)
        kernel = "materialized"
    return _KERNELS[kernel](q, k, v, act, t, allowed, bias, n, dropout_p, causal=causal)
