"""Fused Triton attention for the built-in elementwise activations (CUDA).

One program holds a block of queries (or, in the key/value backward, a block
of keys) and walks the other side block by block; ``S``, ``phi(S)`` and
``phi'(S)`` live only in fp32 registers, never in memory. No softmax means no
running max and no row statistics: the forward simply adds key blocks, and the
backward needs no ``rowsum(dO * O)`` term. The backward is two kernels, one
accumulating ``dK, dV`` per key block and one ``dQ`` per query block, so no
atomics are needed.

Supported: ``poly{p}``, ``relu``, ``softplus``, ``sigmoid`` (an Activation's
``kernel`` form), fp16 / bf16 / fp32 operands, head dims up to 256, any
boolean ``allowed`` mask (key padding or pairwise, read through broadcast
strides), causal masking (``CAUSAL``: query ``i`` attends keys ``j <= i + OFFSET``,
``OFFSET = Nk - Nq``; each program's tile loop stops at, or starts from, the
diagonal, so tiles above it are never computed, and only those it crosses are masked), an additive score bias (Swin's relative-position bias; read through
broadcast strides, its gradient summed over the dimensions it broadcasts
along), attention dropout, ragged lengths and ``Nq != Nk``.

Dropout follows the C++ kernel's scheme exactly (``fused_cpu.py``): one 64-bit
seed per call from torch's default CPU generator; pair (query ``i``, key ``j``)
of flattened head ``bh`` is kept iff word ``j % 4`` of
``tl.philox(seed, j // 4, i, bh, 0)`` (Philox4x32-10) is ``>= floor(p * 2**32)``.
No mask is stored: each kernel regenerates it. With the same seed both kernels
drop the same pairs.

The bias gradient is written as a ``(B*H, Nq, Nk)`` fp32 buffer by the ``dQ``
kernel and then summed over the bias's broadcast dimensions: O(B H Nq Nk)
memory, only when the bias requires grad (Swin's 7x7 windows: small).

Precision: ``q k^T`` runs on the operands' dtype with fp32 accumulation. The
other products take bf16 operands for bf16 inputs and fp32 otherwise: fp16's
range (65504) cannot hold ``phi(S)`` (``S^3`` overflows at ``|S| > 40``). fp32
products use TF32 only if ``torch.backends.cuda.matmul.allow_tf32`` says so.

The launches are ``torch.library.triton_op`` operators (``polyattn::triton_forward``
and ``polyattn::triton_backward``), so ``torch.compile`` can see through them
without a graph break (``test_triton_cuda.py`` checks this on a GPU; the
interpreter cannot be traced by torch.compile). ``triton_compiles`` runs the three kernels once per
configuration on tiny inputs: where Triton cannot compile them for the GPU
(an old architecture, a Triton error), ``attention()`` warns once, naming the
error, and uses the blocked kernel instead.

Status: tested under ``TRITON_INTERPRET=1`` (the CPU interpreter) against the
reference; NOT YET RUN ON A GPU. The block sizes, warps and stages in
``_CONFIGS`` are starting points, not measurements (``scripts/gpu_check.py``
is the prepared check). The interpreter multiplies bf16 as raw integers, so
under it bf16 products run on fp32 operands (bf16 loads, stores and casts are
still exercised).
"""
from __future__ import annotations

import math
import os
import warnings
from typing import NamedTuple, Optional

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
    """Whether ``attention()`` may use this kernel: Triton importable, a known form, a supported dtype,
    and CUDA tensors (or CPU tensors under the interpreter). ``triton_compiles`` says whether it builds."""
    return (
        triton is not None
        and (q.is_cuda or interpreting())
        and act.fused_form is not None
        and q.dtype in _DTYPES
        and q.shape[-1] <= 256
    )


class LaunchConfig(NamedTuple):
    """Tile sizes and launch options of one kernel: ``BLOCK_M`` queries x ``BLOCK_N`` keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


#: ``(kernel, operand dtype is 16-bit, head dim bucket) -> LaunchConfig``; the bucket is the padded
#: head dim rounded up to 64, 128 or 256. NOT MEASURED ON A GPU: starting points after the Triton
#: FlashAttention tutorial (16-bit: 128x64 forward tiles, 4 warps, 3 stages for d <= 64; fp32 operands
#: take twice the registers and shared memory, so half the tiles). scripts/gpu_check.py times them.
_CONFIGS = {
    ("forward", True, 64): LaunchConfig(128, 64, 4, 3),
    ("forward", True, 128): LaunchConfig(128, 64, 8, 2),
    ("forward", True, 256): LaunchConfig(64, 32, 8, 1),
    ("forward", False, 64): LaunchConfig(64, 64, 4, 2),
    ("forward", False, 128): LaunchConfig(64, 32, 4, 2),
    ("forward", False, 256): LaunchConfig(32, 32, 4, 1),
    ("backward", True, 64): LaunchConfig(64, 64, 4, 2),
    ("backward", True, 128): LaunchConfig(64, 64, 8, 1),
    ("backward", True, 256): LaunchConfig(32, 32, 8, 1),
    ("backward", False, 64): LaunchConfig(64, 32, 4, 1),
    ("backward", False, 128): LaunchConfig(32, 32, 4, 1),
    ("backward", False, 256): LaunchConfig(32, 32, 4, 1),
}


def launch_config(kernel: str, dtype: torch.dtype, d: int, dv: int) -> LaunchConfig:
    """The table entry for ``kernel`` (``forward`` or ``backward``) at this dtype and head dims."""
    width = max(d, dv)
    bucket = 64 if width <= 64 else 128 if width <= 128 else 256
    return _CONFIGS[(kernel, dtype in (torch.float16, torch.bfloat16), bucket)]


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
    def _keep(seed, threshold, bh, offs_m, offs_n):
        """Dropout's keep decisions for a block: word ``j % 4`` of ``philox(seed, j // 4, i, bh, 0)`` >= threshold."""
        rows = offs_m[:, None] + offs_n[None, :] * 0
        zero = rows * 0
        r0, r1, r2, r3 = tl.philox(seed, offs_n[None, :] // 4 + zero, rows, zero + bh, zero)
        lane = offs_n[None, :] % 4 + zero
        word = tl.where(lane == 0, r0, tl.where(lane == 1, r1, tl.where(lane == 2, r2, r3)))
        return word >= threshold.to(tl.uint32)

    @triton.jit
    def _scores(q, k, t, shift, bh, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base, sb_q, sb_k,
                seed, threshold, OFFSET, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                CAUSAL: tl.constexpr, QK: tl.constexpr, PRECISION: tl.constexpr):
        """``z = S + b(n) + bias`` for a (queries x keys) block and whether each pair counts (mask, causal, dropout)."""
        z = _mm(q, tl.trans(k), QK, PRECISION) * t + shift[:, None]
        valid = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
        if CAUSAL:
            valid = valid & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
        if HAS_BIAS:
            bias = tl.load(bias_base + offs_m[:, None] * sb_q + offs_n[None, :] * sb_k, mask=valid, other=0.0)
            z += bias.to(tl.float32)
        if HAS_MASK:
            allowed = tl.load(mask_base + offs_m[:, None] * sm_q + offs_n[None, :] * sm_k, mask=valid, other=0)
            valid = valid & (allowed != 0)
        if DROPOUT:
            valid = valid & _keep(seed, threshold, bh, offs_m, offs_n)
        return z, valid

    @triton.jit
    def _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT: tl.constexpr):
        """This head's mask and bias base pointers (broadcast strides may be 0) and the dropout seed."""
        b, h = (bh // H).to(tl.int64), (bh % H).to(tl.int64)
        if DROPOUT:
            seed = tl.load(Seed)
        else:
            seed = 0
        return Mask + b * sm_b + h * sm_h, Bias + b * sb_b + h * sb_h, seed

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
        q = _load_rows(Q + bh.to(tl.int64) * Nq * D, offs_m, Nq, offs_d, D)
        c = tl.load(C + bh * Nq + offs_m, mask=rows_ok, other=0.0)
        return q, c, tl.load(Shift + bh * Nq + offs_m, mask=rows_ok, other=0.0)

    @triton.jit
    def _score_grad(z, valid, do_c, v, FORM: tl.constexpr, POWER: tl.constexpr, PV: tl.constexpr, PRECISION: tl.constexpr):
        """``dS = phi'(z) * (c dO V^T)``, zero on pairs that do not count."""
        return tl.where(valid, _dphi(z, FORM, POWER), 0.0) * _mm(do_c, tl.trans(v), PV, PRECISION)

    @triton.jit
    def _forward(Q, K, V, Out, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                 sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                 FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr,
                 PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per query block: ``out = sum_k c phi(z) V``."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
        mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
        K_head, V_head = K + bh.to(tl.int64) * Nk * D, V + bh.to(tl.int64) * Nk * DV
        acc = tl.zeros((BLOCK_M, BLOCK_DV), dtype=tl.float32)
        hi = Nk
        if CAUSAL:  # no key beyond the last row's reach
            hi = tl.minimum(Nk, (pid + 1) * BLOCK_M + OFFSET)
        for start in range(0, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = _load_rows(K_head, offs_n, Nk, offs_d, D)
            v = _load_rows(V_head, offs_n, Nk, offs_dv, DV)
            z, valid = _scores(q, k, t, shift, bh, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base, sb_q, sb_k,
                               seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK, PRECISION)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0) * c[:, None]
            acc += _mm(p, v, PV, PRECISION)
        _store_rows(Out + bh.to(tl.int64) * Nq * DV, acc, offs_m, Nq, offs_dv, DV)

    @triton.jit
    def _backward_kv(Q, K, V, DO, DK, DV_, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                     sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                     FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr,
                     PRECISION: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per key block: ``dV = sum_q phi(z)^T (c dO)``, ``dK = t sum_q dS^T Q``."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        k = _load_rows(K + bh.to(tl.int64) * Nk * D, offs_n, Nk, offs_d, D)
        v = _load_rows(V + bh.to(tl.int64) * Nk * DV, offs_n, Nk, offs_dv, DV)
        mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
        DO_head = DO + bh.to(tl.int64) * Nq * DV
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
        lo = 0
        if CAUSAL:  # no query before the first key's first reader
            lo = tl.maximum(0, pid * BLOCK_N - OFFSET) // BLOCK_M * BLOCK_M
        for start in range(lo, Nq, BLOCK_M):
            offs_m = start + tl.arange(0, BLOCK_M)
            q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
            do_c = _load_rows(DO_head, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
            z, valid = _scores(q, k, t, shift, bh, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base, sb_q, sb_k,
                               seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK, PRECISION)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0)
            dv += _mm(tl.trans(p), do_c, PV, PRECISION)
            dk += _mm(tl.trans(_score_grad(z, valid, do_c, v, FORM, POWER, PV, PRECISION)), q, PV, PRECISION)
        _store_rows(DK + bh.to(tl.int64) * Nk * D, dk * t, offs_n, Nk, offs_d, D)
        _store_rows(DV_ + bh.to(tl.int64) * Nk * DV, dv, offs_n, Nk, offs_dv, DV)

    @triton.jit
    def _backward_q(Q, K, V, DO, DQ, DBias, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                    sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                    FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr,
                    PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BIAS_GRAD: tl.constexpr):
        """Per query block: ``dQ = t sum_k dS K``; with ``BIAS_GRAD`` also writes ``dS`` (the bias gradient)."""
        bh, pid = tl.program_id(0), tl.program_id(1)
        offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
        do_c = _load_rows(DO + bh.to(tl.int64) * Nq * DV, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
        mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
        K_head, V_head = K + bh.to(tl.int64) * Nk * D, V + bh.to(tl.int64) * Nk * DV
        DS_head = DBias + bh.to(tl.int64) * Nq * Nk
        dq = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        hi = Nk
        if CAUSAL:
            hi = tl.minimum(Nk, (pid + 1) * BLOCK_M + OFFSET)
        for start in range(0, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            k = _load_rows(K_head, offs_n, Nk, offs_d, D)
            v = _load_rows(V_head, offs_n, Nk, offs_dv, DV)
            z, valid = _scores(q, k, t, shift, bh, offs_m, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base, sb_q, sb_k,
                               seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK, PRECISION)
            ds = _score_grad(z, valid, do_c, v, FORM, POWER, PV, PRECISION)
            if BIAS_GRAD:
                inside = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
                tl.store(DS_head + offs_m[:, None] * Nk + offs_n[None, :], ds, mask=inside)
            dq += _mm(ds, k, PV, PRECISION)
        _store_rows(DQ + bh.to(tl.int64) * Nq * D, dq * t, offs_m, Nq, offs_d, D)


def _tl_dtype(dtype: torch.dtype):
    """Operand dtype of the products; the interpreter multiplies bf16 as raw integers, so it gets fp32."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def _broadcast_strides(x: Tensor | None) -> tuple[int, int, int, int]:
    """Element strides of a 4-D mask or bias, 0 along the dimensions it broadcasts along (size 1)."""
    if x is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(x.shape, x.stride()))


def _kernel_args(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal):
    """Runtime arguments after the block tensors, and the compile-time ones, shared by all three kernels."""
    nq, nk, d, dv = q3.shape[1], k3.shape[1], q3.shape[2], v3.shape[2]
    threshold = min(math.floor(dropout_p * 2**32), 2**32 - 1)
    args = (c, shift, q3 if mask is None else mask, q3 if bias is None else bias, q3 if seed is None else seed,
            t, threshold, nq, nk, heads, d, dv, *_broadcast_strides(mask), *_broadcast_strides(bias),
            0 if causal is None else causal)
    dtype = q3.dtype
    meta = dict(
        FORM=form, POWER=power, HAS_MASK=mask is not None, HAS_BIAS=bias is not None, DROPOUT=dropout_p > 0,
        CAUSAL=causal is not None,
        QK=_tl_dtype(dtype), PV=_tl_dtype(torch.bfloat16 if dtype == torch.bfloat16 else torch.float32),
        PRECISION="tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee",
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    return args, meta


def _launch(kernel, grid, args, meta, config: LaunchConfig) -> None:
    """One kernel launch (the point where Triton compiles it on first use)."""
    torch.library.wrap_triton(kernel)[grid](
        *args, **meta, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


if triton is not None:

    @torch.library.triton_op("polyattn::triton_forward", mutates_args=())
    def triton_forward(
        q3: Tensor, k3: Tensor, v3: Tensor, c: Tensor, shift: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
        seed: Optional[Tensor], heads: int, t: float, form: int, power: int, dropout_p: float,
        causal: Optional[int] = None,
    ) -> Tensor:
        """``out (B*H, Nq, dv)`` from contiguous ``(B*H, N, d)`` operands; mask/bias 4-D, broadcastable."""
        args, meta = _kernel_args(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
        config = launch_config("forward", q3.dtype, q3.shape[2], v3.shape[2])
        out = q3.new_empty(q3.shape[0], q3.shape[1], v3.shape[2])
        _launch(_forward, (q3.shape[0], triton.cdiv(q3.shape[1], config.block_m)), (q3, k3, v3, out, *args), meta, config)
        return out

    @torch.library.triton_op("polyattn::triton_backward", mutates_args=())
    def triton_backward(
        q3: Tensor, k3: Tensor, v3: Tensor, do: Tensor, c: Tensor, shift: Tensor, mask: Optional[Tensor],
        bias: Optional[Tensor], seed: Optional[Tensor], heads: int, t: float, form: int, power: int,
        dropout_p: float, causal: Optional[int], bias_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` and, with ``bias_grad``, ``dS`` as fp32 ``(B*H, Nq, Nk)`` (else an empty tensor)."""
        args, meta = _kernel_args(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
        config = launch_config("backward", q3.dtype, q3.shape[2], v3.shape[2])
        bh, nq, nk = q3.shape[0], q3.shape[1], k3.shape[1]
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        ds = (q3.new_zeros if causal is not None else q3.new_empty)(  # causal: skipped tiles stay 0
            (bh, nq, nk) if bias_grad else (0,), dtype=torch.float32
        )
        _launch(_backward_kv, (bh, triton.cdiv(nk, config.block_n)), (q3, k3, v3, do, dk, dv, *args), meta, config)
        _launch(_backward_q, (bh, triton.cdiv(nq, config.block_m)), (q3, k3, v3, do, dq, ds if bias_grad else dq, *args),
                {**meta, "BIAS_GRAD": bias_grad}, config)
        return dq, dk, dv, ds


def draw_seed(device: torch.device) -> Tensor:
    """The dropout seed of one call as a one-element int64 tensor on ``device``, drawn from torch's default
    CPU generator the way the C++ kernel draws it (``fused_cpu.draw_seed``), so both drop the same pairs."""
    return torch.randint(2**63 - 1, (1,), dtype=torch.int64).to(device)


class TritonAttention(torch.autograd.Function):
    """``out = c(n) / (1 - p) * dropout(mask(f(S + b(n) + bias))) @ v`` on the Triton operators.

    Operands go in as contiguous ``(B*H, N, d)`` in ``q``'s dtype; the output
    comes back in ``v``'s dtype and each gradient in its input's.
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, act, t: float, allowed, n, dropout_p: float, causal: int | None):
        B, H, nq, _ = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        q3, k3, v3 = (x.to(q.dtype).reshape(B * H, x.shape[-2], x.shape[-1]).contiguous() for x in (q, k, v))
        c, shift = act.per_row(n, (B, H, nq, nk), torch.float32)
        if dropout_p:
            c = c / (1.0 - dropout_p)
        mask = None if allowed is None else _as_4d(allowed).to(torch.uint8)
        bias4 = None if bias is None else _as_4d(bias)
        seed = draw_seed(q.device) if dropout_p else None
        form, power = act.fused_form
        ctx.op_args = (H, float(t), form, power, float(dropout_p), causal)
        out = torch.ops.polyattn.triton_forward(q3, k3, v3, c, shift, mask, bias4, seed, *ctx.op_args)
        ctx.save_for_backward(q3, k3, v3, c, shift, mask, bias4, seed)
        ctx.inputs = [(x.shape, x.dtype) for x in (q, k, v)] + [None if bias is None else (bias.shape, bias.dtype)]
        return out.view(B, H, nq, dv).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, c, shift, mask, bias4, seed = ctx.saved_tensors
        want_bias = bias4 is not None and ctx.needs_input_grad[3]
        do = grad_out.to(q3.dtype).reshape(q3.shape[0], q3.shape[1], -1).contiguous()
        dq, dk, dv, ds = torch.ops.polyattn.triton_backward(
            q3, k3, v3, do, c, shift, mask, bias4, seed, *ctx.op_args, want_bias
        )
        grads = [g.view(shape).to(dtype) for g, (shape, dtype) in zip((dq, dk, dv), ctx.inputs)]
        dbias = None
        if want_bias:  # dS summed over the dimensions the bias broadcasts along
            heads = ctx.op_args[0]
            ds4 = ds.view(-1, heads, q3.shape[1], k3.shape[1])
            broadcast = [dim for dim in range(4) if bias4.shape[dim] == 1 and ds4.shape[dim] > 1]
            summed = ds4.sum(dim=broadcast, keepdim=True) if broadcast else ds4
            shape, dtype = ctx.inputs[3]
            dbias = summed.reshape(shape).to(dtype)
        return (*grads, dbias, None, None, None, None, None, None)


def _as_4d(x: Tensor) -> Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


#: ``triton_compiles`` verdicts by configuration.
_PROBED: dict[tuple, bool] = {}


@torch.compiler.assume_constant_result
def _compiles(device: str, dtype: torch.dtype, d: int, form: int, power: int, has_mask: bool, has_bias: bool,
              dropout: bool, causal: bool) -> bool:
    key = (device, dtype, d, form, power, has_mask, has_bias, dropout, causal)
    if key not in _PROBED:
        _PROBED[key] = _probe(*key)
    return _PROBED[key]


def triton_compiles(q: Tensor, act, has_mask: bool, has_bias: bool, dropout: bool, causal: bool = False) -> bool:
    """Whether the kernels compile and run for this configuration (dtype, head dim, form, mask, bias, dropout,
    causal).

    Decided once per configuration and process, on tiny inputs (``v``'s head dim taken equal to ``q``'s);
    where they fail, a warning names the error and ``attention()`` uses the blocked kernel instead.
    """
    form, power = act.fused_form
    return _compiles(str(q.device), q.dtype, q.shape[-1], form, power, has_mask, has_bias, dropout, causal)


def _probe(device, dtype, d, form, power, has_mask, has_bias, dropout, causal) -> bool:
    n = 16
    try:
        g = torch.Generator().manual_seed(0)  # the default generator is left alone: seeded runs stay repeatable
        q3, k3, v3, do = (torch.randn(1, n, d, generator=g).to(device, dtype) for _ in range(4))
        c, shift = torch.ones(1, n, device=device), torch.zeros(1, n, device=device)
        mask = torch.ones(1, 1, 1, n, dtype=torch.uint8, device=device) if has_mask else None
        bias = torch.zeros(1, 1, n, n, device=device) if has_bias else None
        seed = torch.ones(1, dtype=torch.int64, device=device) if dropout else None
        p = 0.1 if dropout else 0.0  # the usual attention dropout (Triton types its threshold as i32 then)
        offset = 0 if causal else None
        out = torch.ops.polyattn.triton_forward(q3, k3, v3, c, shift, mask, bias, seed, 1, 1.0, form, power, p, offset)
        grads = torch.ops.polyattn.triton_backward(q3, k3, v3, do, c, shift, mask, bias, seed, 1, 1.0, form, power,
                                                   p, offset, has_bias)
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        if not all(bool(x.isfinite().all()) for x in (out, *grads)):
            raise FloatingPointError("non-finite result on finite inputs")
    except Exception as error:  # a Triton compile error, out of resources, an unsupported GPU...
        warnings.warn(
            f"the Triton attention kernel does not run on this GPU for {dtype}, head dim {d}, form {form}/{power}, "
            f"mask={has_mask}, bias={has_bias}, dropout={dropout}, causal={causal} ({type(error).__name__}: {error}); "
            "attention falls back to the blocked PyTorch kernel (slower)",
            stacklevel=4,
        )
        return False
    return True


def triton_attention(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None) -> Tensor:
    """``kernels.run`` signature."""
    if triton is None:
        raise RuntimeError("the triton kernel needs the `triton` package")
    if not triton_supports(q, act):
        raise ValueError(
            f"the triton kernel needs CUDA tensors (or TRITON_INTERPRET=1), fp16/bf16/fp32, head dim <= 256 and a "
            f"built-in activation; got {q.device} {q.dtype} d={q.shape[-1]} {act.name!r}"
        )
    return TritonAttention.apply(q, k, v, bias, act, t, allowed, n, float(dropout_p), causal)
