"""Fused Triton attention for the built-in elementwise activations (CUDA).

One program holds a block of queries (or, in the key/value backward, a block
of keys) and walks the other side block by block; ``S``, ``phi(S)`` and
``phi'(S)`` live only in fp32 registers, never in memory. No softmax means no
running max and no row statistics: the forward simply adds key blocks, and the
backward needs no ``rowsum(dO * O)`` term. The backward is two kernels, one
accumulating ``dK, dV`` per key block and one ``dQ`` per query block, so no
atomics are needed.

Supported: ``poly{p}``, ``relu``, ``softplus``, ``sigmoid`` (an Activation's
``kernel`` form), fp16 / bf16 / fp32 operands, any boolean ``allowed`` mask
(key padding or pairwise, read through broadcast strides), ragged lengths and
``Nq != Nk``. Not supported, so ``attention()`` falls back to the blocked
kernel: ``attn_bias`` and ``dropout_p > 0``.

Precision: ``q k^T`` runs on the operands' dtype with fp32 accumulation. The
other products take bf16 operands for bf16 inputs and fp32 otherwise: fp16's
range (65504) cannot hold ``phi(S)`` (``S^3`` overflows at ``|S| > 40``). fp32
products use TF32 only if ``torch.backends.cuda.matmul.allow_tf32`` says so.

Tested here only under ``TRITON_INTERPRET=1`` (the CPU interpreter), against
the reference; the block sizes and warp counts have not been tuned on a GPU.
The interpreter multiplies bf16 as raw integers, so under it bf16 products
run on fp32 operands (bf16 loads, stores and casts are still exercised).
"""
from __future__ import annotations

import os

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the blocked kernel runs instead
    triton = None

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``, where Triton runs kernels on CPU tensors (for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_supports(q: Tensor, act) -> bool:
    """Whether ``attention()`` should use this kernel: Triton importable, a known form, a supported dtype,
    and CUDA tensors (or CPU tensors under the interpreter)."""
    return (
        triton is not None
        and (q.is_cuda or interpreting())
        and act.fused_form is not None
        and q.dtype in _DTYPES
        and q.shape[-1] <= 256
    )


if triton is not None:

    @triton.jit
    def _phi(z, FORM: tl.constexpr, POWER: tl.constexpr):
        if FORM == 0:
            f = z
            for _ in tl.static_range(POWER - 1):
                f = f * z
        elif FORM == 1:
            f = tl.maximum(z, 0.0)
        elif FORM == 2:  # softplus, stable for large |z|
            f = tl.maximum(z, 0.0) + tl.log(1.0 + tl.exp(-tl.abs(z)))
        else:
            f = 1.0 / (1.0 + tl.exp(-z))
        return f

    @triton.jit
    def _dphi(z, FORM: tl.constexpr, POWER: tl.constexpr):
        if FORM == 0:
            g = z * 0.0 + POWER
            for _ in tl.static_range(POWER - 1):
                g = g * z
        elif FORM == 1:
            g = tl.where(z > 0, 1.0, 0.0)
        elif FORM == 2:
            g = 1.0 / (1.0 + tl.exp(-z))
        else:
            s = 1.0 / (1.0 + tl.exp(-z))
            g = s * (1.0 - s)
        return g

    @triton.jit
    def _mm(a, b, OPERAND: tl.constexpr, PRECISION: tl.constexpr):
        """``a @ b`` with both operands cast to ``OPERAND``, accumulated in fp32."""
        return tl.dot(a.to(OPERAND), b.to(OPERAND), input_precision=PRECISION)

    @triton.jit
    def _scores(q, k, t, shift, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k,
                HAS_MASK: tl.constexpr, QK: tl.constexpr, PRECISION: tl.constexpr):
        """``z = S + b(n)`` for a (queries x keys) block and whether each pair counts."""
        z = _mm(q, tl.trans(k), QK, PRECISION) * t + shift[:, None]
        valid = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
        if HAS_MASK:
            allowed = tl.load(mask_base + offs_m[:, None] * sm_q + offs_n[None, :] * sm_k, mask=valid, other=0)
            valid = valid & (allowed != 0)
        return z, valid

    @triton.jit
    def _load_rows(ptr, offs, n, offs_d, d):
        """Rows ``offs`` (< n) of a contiguous ``(N, d)`` matrix, zero-padded to the block."""
        inside = (offs[:, None] < n) & (offs_d[None, :] < d)
        return tl.load(ptr + offs[:, None] * d + offs_d[None, :], mask=inside, other=0.0)

    @triton.jit
    def _store_rows(ptr, x, offs, n, offs_d, d):
        inside = (offs[:, None] < n) & (offs_d[None, :] < d)
        tl.store(ptr + offs[:, None] * d + offs_d[None, :], x.to(ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D):
        """A block of queries with their row scale ``c`` and row shift ``b``."""
        rows_ok = offs_m < Nq
        q = _load_rows(Q + bh * Nq * D, offs_m, Nq, offs_d, D)
        c = tl.load(C + bh * Nq + offs_m, mask=rows_ok, other=0.0)
        return q, c, tl.load(Shift + bh * Nq + offs_m, mask=rows_ok, other=0.0)

    @triton.jit
    def _score_grad(z, valid, do_c, v, FORM: tl.constexpr, POWER: tl.constexpr, PV: tl.constexpr, PRECISION: tl.constexpr):
        """``dS = phi'(z) * (c dO V^T)``, zero on pairs that do not count."""
        return tl.where(valid, _dphi(z, FORM, POWER), 0.0) * _mm(do_c, tl.trans(v), PV, PRECISION)

    @triton.jit
    def _forward(Q, K, V, Out, C, Shift, Mask, t, Nq, Nk, H, D, DV, sm_b, sm_h, sm_q, sm_k,
                 FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, QK: tl.constexpr,
                 PV: tl.constexpr, PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per query block: ``out = sum_k c phi(z) V``."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
        mask_base = Mask + (bh // H) * sm_b + (bh % H) * sm_h
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        for start in range(0, Nk, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = _load_rows(K + bh * Nk * D, offs_n, Nk, offs_d, D)
            v = _load_rows(V + bh * Nk * DV, offs_n, Nk, offs_dv, DV)
            z, valid = _scores(q, k, t, shift, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, HAS_MASK, QK, PRECISION)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0) * c[:, None]
            acc += _mm(p, v, PV, PRECISION)
        _store_rows(Out + bh * Nq * DV, acc, offs_m, Nq, offs_dv, DV)

    @triton.jit
    def _backward_kv(Q, K, V, DO, DK, DV_, C, Shift, Mask, t, Nq, Nk, H, D, DV, sm_b, sm_h, sm_q, sm_k,
                     FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, QK: tl.constexpr,
                     PV: tl.constexpr, PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per key block: ``dV = sum_q phi(z)^T (c dO)``, ``dK = t sum_q dS^T Q``."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        k = _load_rows(K + bh * Nk * D, offs_n, Nk, offs_d, D)
        v = _load_rows(V + bh * Nk * DV, offs_n, Nk, offs_dv, DV)
        mask_base = Mask + (bh // H) * sm_b + (bh % H) * sm_h
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
        for start in range(0, Nq, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
            do_c = _load_rows(DO + bh * Nq * DV, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
            z, valid = _scores(q, k, t, shift, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, HAS_MASK, QK, PRECISION)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0)
            dv += _mm(tl.trans(p), do_c, PV, PRECISION)
            dk += _mm(tl.trans(_score_grad(z, valid, do_c, v, FORM, POWER, PV, PRECISION)), q, PV, PRECISION)
        _store_rows(DK + bh * Nk * D, dk * t, offs_n, Nk, offs_d, D)
        _store_rows(DV_ + bh * Nk * DV, dv, offs_n, Nk, offs_dv, DV)

    @triton.jit
    def _backward_q(Q, K, V, DO, DQ, C, Shift, Mask, t, Nq, Nk, H, D, DV, sm_b, sm_h, sm_q, sm_k,
                    FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, QK: tl.constexpr,
                    PV: tl.constexpr, PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per query block: ``dQ = t sum_k dS K``."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
        do_c = _load_rows(DO + bh * Nq * DV, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
        mask_base = Mask + (bh // H) * sm_b + (bh % H) * sm_h
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        for start in range(0, Nk, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = _load_rows(K + bh * Nk * D, offs_n, Nk, offs_d, D)
            v = _load_rows(V + bh * Nk * DV, offs_n, Nk, offs_dv, DV)
            z, valid = _scores(q, k, t, shift, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, HAS_MASK, QK, PRECISION)
            dq += _mm(_score_grad(z, valid, do_c, v, FORM, POWER, PV, PRECISION), k, PV, PRECISION)
        _store_rows(DQ + bh * Nq * D, dq * t, offs_m, Nq, offs_d, D)


BLOCK_M = BLOCK_N = 64
# Grids are (B*H, blocks): CUDA caps grid axes 1 and 2 at 65535 but axis 0 at 2**31 - 1, and
# B*H (batch x windows x heads for windowed attention) outgrows 65535 long before N / 64 does.


class TritonAttention(torch.autograd.Function):
    """Launches the three kernels on contiguous ``(B*H, N, d)`` operands of one dtype (``q``'s).

    The output comes back in ``v``'s dtype and each gradient in its input's.
    """

    @staticmethod
    def forward(ctx, q, k, v, act, t: float, allowed, n):
        B, H, nq, d = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        dtype = q.dtype
        q3, k3, v3 = (x.to(dtype).reshape(B * H, x.shape[-2], x.shape[-1]).contiguous() for x in (q, k, v))
        c, shift = act.per_row(n, (B, H, nq, nk), torch.float32)
        mask = None if allowed is None else allowed.to(torch.uint8).expand(B, H, nq, nk)
        # runtime arguments after the tensors, then the compile-time ones, shared by all three kernels
        mask_strides = (0,) * 4 if mask is None else mask.stride()
        ctx.args = (q3 if mask is None else mask, float(t), nq, nk, H, d, dv, *mask_strides)
        ctx.meta = dict(
            FORM=act.fused_form[0], POWER=act.fused_form[1],
            HAS_MASK=mask is not None,
            QK=_tl_dtype(dtype), PV=_tl_dtype(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32),
            PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
            BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
        )
        out = torch.empty(B * H, nq, dv, dtype=dtype, device=q.device)
        _forward[(B * H, triton.cdiv(nq, BLOCK_M))](q3, k3, v3, out, c, shift, *ctx.args, **ctx.meta)
        ctx.save_for_backward(q3, k3, v3, c, shift)
        ctx.inputs = [(x.shape, x.dtype) for x in (q, k, v)]
        return out.view(B, H, nq, dv).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, c, shift = ctx.saved_tensors
        do = grad_out.to(q3.dtype).reshape(q3.shape[0], q3.shape[1], -1).contiguous()
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        bh, nq, nk = q3.shape[0], q3.shape[1], k3.shape[1]
        _backward_kv[(bh, triton.cdiv(nk, BLOCK_N))](q3, k3, v3, do, dk, dv, c, shift, *ctx.args, **ctx.meta)
        _backward_q[(bh, triton.cdiv(nq, BLOCK_M))](q3, k3, v3, do, dq, c, shift, *ctx.args, **ctx.meta)
        grads = (g.view(shape).to(dtype) for g, (shape, dtype) in zip((dq, dk, dv), ctx.inputs))
        return (*grads, None, None, None, None)


def _tl_dtype(dtype: torch.dtype):
    """Operand dtype of the products; the interpreter multiplies bf16 as raw integers, so it gets fp32."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def triton_attention(q, k, v, act, t, allowed, bias, n, dropout_p) -> Tensor:
    """``kernels.run`` signature; ``attn_bias`` and dropout are not supported here (use ``blocked``)."""
    if triton is None:
        raise RuntimeError("the triton kernel needs the `triton` package")
    if bias is not None or dropout_p:
        raise ValueError("the triton kernel supports neither attn_bias nor dropout; use kernel='blocked'")
    if not triton_supports(q, act):
        raise ValueError(
            f"the triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), fp16/bf16/fp32 and a built-in "
            f"activation; got {q.device} {q.dtype} {act.name!r}"
        )
    return TritonAttention.apply(q, k, v, act, t, allowed, n)
