"""``power``'s parallel form: every query row at once, in linear time, on CPU (C++) and CUDA (Triton).

``x^p`` attention is ``c(n) t^p m(Q) (w m(K))^T V``: O(N D dv) instead of O(N^2 d) (``base/state.py`` has the
features ``m`` and their weights ``w``). The features of N keys would be N x D (392 MB for N = 16k, d = 32, p = 3),
so the kernels never hold them: keys and queries go through the features in chunks (:func:`chunk_size`), built
inside the kernel and met with the ``D x dv`` state in one product. Memory is O(N d + D dv) per (batch, head).

Causal (query i attends keys ``j <= i + Nk - Nq``, bottom-right): chunked, quadratic inside a chunk (a small
lower-triangular ``(q . k)^p`` tile), the running state across chunks, with the per-row ``c(n_i)``.

Kernels: on CPU ``csrc/power_cpu.cpp`` (built by ``base/cpp.py``); on CUDA the Triton programs of
``triton/power_jit.py`` (``triton/power_op.py``). Both take grouped-query attention natively (a kv head's state
serves its group of query heads), fp32/bf16/fp16 operands with fp32 states, and have a hand-written backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ...dtypes import autocast_off, compute_dtype
from ..base.layout import flatten_heads, key_keep, per_row, unflatten_heads
from ..base.state import device_monomials, monomial_count, power_of

#: Feature-block budget of the C++ kernel, in elements: the chunk is the largest power of two of tokens
#: whose ``D x chunk`` block stays near 2 MB (fp32), at least 16 and at most 128 tokens.
CHUNK_ELEMENTS = 1 << 19


def chunk_size(d: int, p: int) -> int:
    """Tokens per chunk of the C++ kernel for head dim ``d`` and power ``p`` (its parallel and recurrent sweeps)."""
    fits = max(1, CHUNK_ELEMENTS // monomial_count(d, p))
    return max(16, min(128, 1 << (fits.bit_length() - 1)))


class PowerAttentionCPU(torch.autograd.Function):
    """Non-causal: ``out = s * m(q t) S``, ``S = sum_j w m(k_j) v_j^T`` per kv head, on ``csrc/power_cpu.cpp``.

    Operands ``(B*H, N, d)`` in the compute dtype; ``s`` ``(B*Hq, Nq)``; ``keep`` ``(B*Hkv, Nk)`` or None.
    """

    @staticmethod
    def forward(ctx, q, k, v, keep, s, t: float, power: int, groups: int):
        dtype = compute_dtype(q)
        chunk = chunk_size(q.shape[-1], power)
        with autocast_off("cpu"):
            q3, k3, v3 = flatten_heads(q, dtype) * t, flatten_heads(k, dtype), flatten_heads(v, dtype)
            out, state = torch.ops.polyattn_cpu.power_forward(q3, k3, v3, keep, s, power, groups, chunk)
        ctx.save_for_backward(q3, k3, v3, state, keep, s)
        ctx.meta = (t, power, groups, chunk, q.dtype, k.dtype, v.dtype)
        return out.view(*q.shape[:3], -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, state, keep, s = ctx.saved_tensors
        t, power, groups, chunk, *dtypes = ctx.meta
        with autocast_off("cpu"):
            g = (flatten_heads(grad_out, q3.dtype) * s[..., None]).contiguous()
            dq, dk, dv = torch.ops.polyattn_cpu.power_backward(q3, k3, v3, state, g, keep, power, groups, chunk)
            dq.mul_(t)
        return (*unflatten_heads(grad_out.shape[0], (dq, dk, dv), dtypes), None, None, None, None, None)


class CausalPowerAttentionCPU(torch.autograd.Function):
    """Causal: the C++ chunked sweep (quadratic tile within a chunk, running state across chunks)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, s, t: float, power: int, groups: int):
        dtype = compute_dtype(q)
        chunk = chunk_size(q.shape[-1], power)
        offset = k.shape[-2] - q.shape[-2]
        with autocast_off("cpu"):
            q3, k3, v3 = flatten_heads(q, dtype) * t, flatten_heads(k, dtype), flatten_heads(v, dtype)
            out, _ = torch.ops.polyattn_cpu.power_causal_forward(
                q3, k3, v3, keep, s, power, groups, offset, chunk, None, False
            )
        ctx.save_for_backward(q3, k3, v3, keep, s)
        ctx.meta = (t, power, groups, offset, chunk, q.dtype, k.dtype, v.dtype)
        return out.view(*q.shape[:3], -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, keep, s = ctx.saved_tensors
        t, power, groups, offset, chunk, *dtypes = ctx.meta
        with autocast_off("cpu"):
            g = (flatten_heads(grad_out, q3.dtype) * s[..., None]).contiguous()
            dq, dk, dv = torch.ops.polyattn_cpu.power_causal_backward(q3, k3, v3, g, keep, power, groups, offset, chunk)
            dq.mul_(t)
        return (*unflatten_heads(grad_out.shape[0], (dq, dk, dv), dtypes), None, None, None, None, None)


def power_attention(q, k, v, act, t, allowed, n, causal=None) -> Tensor:
    """The linear form on resolved arguments; ``k``, ``v`` may have fewer heads than ``q`` (grouped-query)."""
    batch, heads, nq = q.shape[:3]
    kv_heads, nk = k.shape[1], k.shape[-2]
    power, groups = power_of(act), heads // kv_heads
    if q.is_cuda:
        from ..triton.power_op import triton_power_attention

        return triton_power_attention(
            q, k, v, act, float(t), allowed, n, causal, *device_monomials(q.shape[-1], power, q.device)
        )
    dtype = compute_dtype(q)
    s = per_row(act.row_scale(n.to(dtype)), batch, heads, nq, dtype)
    keep = key_keep(allowed, batch, kv_heads, nk, dtype)
    function = PowerAttentionCPU if causal is None else CausalPowerAttentionCPU
    return function.apply(q, k, v, keep, s, float(t), power, groups)


__all__ = ["CHUNK_ELEMENTS", "CausalPowerAttentionCPU", "PowerAttentionCPU", "chunk_size", "power_attention"]
