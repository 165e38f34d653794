"""The fused C++ CPU kernel (``csrc/fused_cpu.cpp``; built by ``cpp.load``).

On CPU this is what makes a non-softmax model train as fast as softmax on
SDPA: one C++ loop per thread over cache-resident score tiles, BLAS for the
products, ``f``/``f'``/mask applied while the tile is hot. It knows the
built-in forms (``poly{p}``, ``relu``, ``softplus``, ``sigmoid``), any
boolean mask and a score bias (Swin's relative-position bias, with its
gradient); dropout goes to the blocked PyTorch kernel.

Where the C++ kernels cannot be built (no compiler), a warning says why and
the blocked kernel runs instead.
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from .blocked import as_4d, flatten_heads, grad_gain
from .cpp import load
from .registry import Activation, compute_dtype

#: Tile sizes (query rows x keys). The forward's 64 x 512 fp32 tile (128 KiB) and the
#: backward's three 128 x 256 tiles stay in L2; measured best on the benchmark machine.
FORWARD_BLOCK = (64, 512)
BACKWARD_BLOCK = (128, 256)


def fused_cpu_supports(q: Tensor, act: Activation) -> bool:
    """Whether ``attention()`` should use this kernel: CPU tensors, a known form, and a kernel that loads."""
    return q.device.type == "cpu" and act.fused_form is not None and load()


class FusedCPUAttention(torch.autograd.Function):
    """``out = c(n) * mask(f(S + b(n) + bias)) @ v``; forward and backward in C++.

    Operands go in as contiguous ``(B*H, N, d)`` in the compute dtype with ``t``
    folded into ``q``; ``c(n)`` scales ``out`` (forward) and ``dO`` (backward);
    the constant factor of ``f'`` (``p`` for ``S^p``) scales dQ, dK and dbias.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, act: Activation, t: float, allowed, n):
        shape4 = (*q.shape[:3], k.shape[-2])
        dtype = compute_dtype(q)
        form, power = act.fused_form
        with torch.autocast("cpu", enabled=False):
            row_scale, row_shift = act.per_row(n, shape4, dtype)
            row_shift = row_shift if act.shift else None
            q3, k3, v3 = flatten_heads(q, dtype) * t, flatten_heads(k, dtype), flatten_heads(v, dtype)
            bias4 = None if bias is None else as_4d(bias.detach().to(dtype)).contiguous()
            strided = [None if x is None else x.expand(shape4) for x in (bias4, allowed)]
            out = torch.ops.polyattn_cpu.forward(
                q3, k3, v3, row_scale, row_shift, *strided, shape4[1], form, power, *FORWARD_BLOCK
            )
        ctx.save_for_backward(q3, k3, v3, row_scale, row_shift, *strided)
        ctx.meta = (shape4, t, act, None if bias is None else bias4.shape)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if bias is None else bias.dtype)
        return out.view(*shape4[:3], -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, row_scale, row_shift, bias, mask = ctx.saved_tensors
        shape4, t, act, bias_shape = ctx.meta
        form, power = act.fused_form
        want_bias = bias is not None and ctx.needs_input_grad[3]
        with torch.autocast("cpu", enabled=False):
            dout = (grad_out.reshape(q3.shape[0], q3.shape[1], -1).to(q3.dtype) * row_scale[..., None]).contiguous()
            dq, dk, dv, dbias = torch.ops.polyattn_cpu.backward(
                q3, k3, v3, dout, row_shift, bias, mask, want_bias, shape4[1], form, power, *BACKWARD_BLOCK
            )
            gain = grad_gain(act)  # f'(S) = p S^(p-1); the kernel leaves out the p
            dq.mul_(t * gain)
            if gain != 1.0:
                dk.mul_(gain)
                dbias.mul_(gain)
        q_dtype, k_dtype, v_dtype, bias_dtype = ctx.dtypes
        heads = shape4[:2]
        return (
            dq.view(*heads, *dq.shape[1:]).to(q_dtype),
            dk.view(*heads, *dk.shape[1:]).to(k_dtype),
            dv.view(*heads, *dv.shape[1:]).to(v_dtype),
            dbias.view(bias_shape).to(bias_dtype) if want_bias else None,
            None, None, None, None,
        )


def fused_cpu(q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    """``kernels.run`` signature; no dropout (the blocked kernel has it)."""
    if dropout_p:
        raise ValueError("the fused_cpu kernel has no dropout; use kernel='blocked'")
    if act.fused_form is None:
        raise ValueError(f"the fused_cpu kernel does not know activation {act.name!r}; use kernel='blocked'")
    if q.device.type != "cpu":
        raise ValueError(f"the fused_cpu kernel runs on CPU tensors, got {q.device}")
    if not load():
        raise RuntimeError("the fused_cpu kernel could not be built on this machine (see the warning above)")
    return FusedCPUAttention.apply(q, k, v, bias, act, t, allowed, n)
