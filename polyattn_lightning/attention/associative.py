"""The exact associative form of ``poly1`` attention: ``c(n) * (q t) @ (k^T v)``.

With ``phi(S) = c * S`` the product ``(q k^T) v`` may be regrouped as
``q (k^T v)``: O(N d^2) instead of O(N^2 d), with no score matrix at all.
It applies when ``c`` is the same for every query of a batch row, i.e. with no
mask or a key-padding mask only (padded keys are zeroed, ``n`` counts the rest).

A custom autograd Function with the closed-form backward: on CPU the C++
kernel ``csrc/associative_cpu.cpp`` (one parallel region over heads, six BLAS
products per head in all), elsewhere four batched products in PyTorch.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .blocked import flatten_heads
from .cpp import load
from .registry import compute_dtype


class AssociativeAttention(torch.autograd.Function):
    """``out = q @ kv`` with ``kv = s * k^T v``, ``s = c(n) * t`` per head ``(B*H,)``; padded keys zeroed."""

    @staticmethod
    def forward(ctx, q, k, v, keep, s):
        shape4 = q.shape
        dtype = compute_dtype(q)
        with torch.autocast(q.device.type, enabled=False):
            q3, k3, v3 = (flatten_heads(x, dtype) for x in (q, k, v))
            if _in_cpp(q3):
                out, kv = torch.ops.polyattn_cpu.associative_forward(q3, k3, v3, keep, s)
            else:
                keys = _zero_padded(k3, keep)
                kv = torch.bmm(keys.transpose(1, 2), v3).mul_(s[:, None, None])  # (B*H, d, dv)
                out = torch.bmm(q3, kv)
        ctx.save_for_backward(q3, k3, v3, kv, keep, s)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        return out.view(*shape4[:3], -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, kv, keep, s = ctx.saved_tensors
        with torch.autocast(grad_out.device.type, enabled=False):
            do = flatten_heads(grad_out, q3.dtype)
            if _in_cpp(q3):
                dq, dk, dv = torch.ops.polyattn_cpu.associative_backward(q3, k3, v3, kv, do, keep, s)
            else:
                keys = _zero_padded(k3, keep)
                dq = torch.bmm(do, kv.transpose(1, 2))
                dkv = torch.bmm(q3.transpose(1, 2), do).mul_(s[:, None, None])  # (B*H, d, dv)
                dk = torch.bmm(v3, dkv.transpose(1, 2))
                dv = torch.bmm(keys, dkv)
                dk = _zero_padded(dk, keep)
        shapes = (*grad_out.shape[:2], -1)
        return (
            *(g.view(*shapes, g.shape[-1]).to(dtype) for g, dtype in zip((dq, dk, dv), ctx.dtypes)),
            None,
            None,
        )


def associative(q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    """``kernels.run`` signature; ``allowed`` may only be a key-padding mask ``(B?, 1, 1, Nk)``."""
    if not act.associative:
        raise ValueError(f"the associative kernel needs a linear activation (poly1), got {act.name!r}")
    if bias is not None or dropout_p:
        raise ValueError("the associative kernel supports neither attn_bias nor dropout")
    if allowed is not None and (allowed.shape[-2] != 1 or allowed.shape[-3] != 1):
        raise ValueError("the associative kernel supports only a key-padding mask, not a pairwise attn_mask")
    batch, heads, nk = q.shape[0], q.shape[1], k.shape[-2]
    dtype = compute_dtype(q)
    # c(n) is the same for every query of a batch row (B?, 1, 1, 1), so it and t
    # scale the small (d, dv) matrix k^T v rather than an (N, d) one.
    s = (act.row_scale(n.to(dtype)) * t).expand(batch, heads, 1, 1).reshape(batch * heads)
    keep = None
    if allowed is not None:  # (B*H, Nk): 1 for a key, 0 for padding
        keep = allowed.to(dtype).expand(batch, heads, 1, nk).reshape(batch * heads, nk).contiguous()
    return AssociativeAttention.apply(q, k, v, keep, s.contiguous())


def _zero_padded(x: Tensor, keep: Tensor | None) -> Tensor:
    """``x`` (B*H, Nk, d) with the rows of padded keys zeroed (selected, so an inf there gives no NaN)."""
    return x if keep is None else x.masked_fill(keep[..., None] == 0, 0.0)


def _in_cpp(q3: Tensor) -> bool:
    """Whether the C++ kernel takes this call: CPU tensors and a kernel that loads."""
    return q3.device.type == "cpu" and load()
