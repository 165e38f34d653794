"""The exact associative form of ``poly1`` attention: ``c(n) * (q t) @ (k^T v)``.

With ``phi(S) = c * S`` the product ``(q k^T) v`` may be regrouped as
``q (k^T v)``: O(N d^2) instead of O(N^2 d), with no score matrix at all.
It applies when ``c`` is the same for every query of a batch row, i.e. with no
mask or a key-padding mask only (padded keys are zeroed, ``n`` counts the rest).
Plain torch ops in fp32, so autograd differentiates it.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .registry import compute_dtype


def associative(q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    """``kernels.run`` signature; ``allowed`` may only be a key-padding mask ``(B?, 1, 1, Nk)``."""
    if not act.associative:
        raise ValueError(f"the associative kernel needs a linear activation (poly1), got {act.name!r}")
    if bias is not None or dropout_p:
        raise ValueError("the associative kernel supports neither attn_bias nor dropout")
    if allowed is not None and (allowed.shape[-2] != 1 or allowed.shape[-3] != 1):
        raise ValueError("the associative kernel supports only a key-padding mask, not a pairwise attn_mask")
    dtype = compute_dtype(q)
    with torch.autocast(q.device.type, enabled=False):
        keys = k.to(dtype)
        if allowed is not None:
            keys = keys * allowed.transpose(-2, -1)  # (B?, 1, Nk, 1): padded keys contribute nothing
        # c(n) is the same for every query of a batch row (B?, 1, 1, 1), so it and t
        # scale the small (d, dv) matrix k^T v rather than an (N, d) one.
        kv = (keys.transpose(-2, -1) @ v.to(dtype)) * (act.row_scale(n.to(dtype)) * t)
        return (q.to(dtype) @ kv).to(v.dtype)
