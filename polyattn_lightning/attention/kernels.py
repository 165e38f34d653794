"""The non-softmax kernels behind ``attention()``, by name.

All take the same normalised arguments: ``act`` (an elementwise Activation),
``t`` (temperature), ``allowed`` (bool mask or None), ``bias`` (additive score
bias or None), ``n`` (keys per row, fp32) and ``dropout_p``. Scores and
``phi(S)`` are fp32 in every kernel; the output has ``v``'s dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def materialized(q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    """The whole ``N x N`` score matrix at once: simplest, for small shapes and as a reference."""
    with torch.autocast(q.device.type, enabled=False):
        s = (q.float() @ k.float().transpose(-2, -1)) * t
        if bias is not None:
            s = s + bias.float()
        p = act(s, n)
        if allowed is not None:
            p = p.masked_fill(~allowed, 0.0)
        if dropout_p:
            p = F.dropout(p, dropout_p)
        return (p @ v.float()).to(v.dtype)


_KERNELS = {"materialized": materialized, "blocked": materialized}


def run(kernel: str, q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    if kernel not in _KERNELS:
        raise ValueError(f"attention kernel {kernel!r} is not available here; available: {sorted(_KERNELS)}")
    return _KERNELS[kernel](q, k, v, act, t, allowed, bias, n, dropout_p)
