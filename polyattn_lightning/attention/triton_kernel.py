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

Dropout: pair (query ``i``, key ``j``) of flattened head ``bh`` is kept iff
word ``j % 4`` of ``tl.philox(seed, j // 4, i, bh, 0)`` (Philox4x32-10) is
``>= floor(p * 2**32)``, the scheme of the C++ kernel (``fused_cpu.py``). Each
Philox call yields the four words of four neighbouring keys. No mask is
stored: each kernel regenerates it. The 64-bit seed is drawn per call on
``q``'s device (``draw_seed``: CUDA's default generator, so no host copy and no
stream sync, and safe under CUDA-graph capture); the C++ kernel draws its seed
from the CPU generator, so the two kernels do not drop the same pairs for the
same ``torch.manual_seed`` (each repeats itself; ExactResume restores both
generators).

The bias gradient is written as a ``(B*H, Nq, Nk)`` fp32 buffer by the ``dQ``
kernel and then summed over the bias's broadcast dimensions: O(B H Nq Nk)
memory, only when the bias requires grad (Swin's 7x7 windows: small).

Precision of the six products (``q k^T``, ``P V``, ``P^T dO``, ``dO V^T``,
``dS^T q``, ``dS k``), all accumulated in fp32:

============  ==========================  =====================================
inputs        ``q k^T``                   the other five
============  ==========================  =====================================
bf16          bf16 tensor cores           bf16 tensor cores
fp16          fp16 tensor cores           TF32 tensor cores on fp32 operands
fp32          ``fp32_precision()``        ``fp32_precision()``
============  ==========================  =====================================

fp16's range (65504) cannot hold ``phi(S)`` (``S^3`` overflows at ``|S| > 40``),
so fp16 inputs keep those products on fp32 operands, in TF32 (fp32's range,
fp16's 10-bit mantissa). fp32 inputs follow
``torch.get_float32_matmul_precision()``: ``'highest'`` (PyTorch's default) is
IEEE fp32, which Triton runs without tensor cores, so ``attention()``'s
``auto`` then picks the blocked kernel (cuBLAS); ``'high'`` is ``tf32x3``
(three TF32 products, about fp32 accuracy) and ``'medium'`` is ``tf32``.

Launches: a 1-D grid whose program id runs over a head's query (or key)
blocks first, so the programs running at the same time share one head's K and
V in L2 (and B*H is not capped by CUDA's 65535 on grid axes 1 and 2). Tiles
per kernel, dtype and head dim come from ``_TUNED`` (sized offline for A100's
and Hopper's shared memory and registers: ``python -m polyattn_lightning.bench
triton-static``); ``POLYATTN_TRITON_TABLE=legacy`` selects the table before
that (``_LEGACY``) and ``POLYATTN_TRITON_GRID=heads`` the old grid order
(heads fastest), until ``scripts/gpu_check.py`` has timed old against new.

The launches are ``torch.library.triton_op`` operators (``polyattn::triton_forward``
and ``polyattn::triton_backward``), so ``torch.compile`` can see through them
without a graph break (``test_triton_cuda.py`` checks this on a GPU; the
interpreter cannot be traced by torch.compile). They run under a device
guard: on ``q``'s CUDA device, whatever the current one. ``attention()``
checks each compiled configuration once against the blocked kernel before
trusting it (``triton_selfcheck.py``).

Status: tested under ``TRITON_INTERPRET=1`` (the CPU interpreter) against the
reference and compiled offline for sm_80 and sm_90 (``triton_static.py``); NOT
YET RUN ON A GPU (``scripts/gpu_check.py`` is the prepared check). The
interpreter multiplies bf16 as raw integers, so under it bf16 products run on
fp32 operands (bf16 loads, stores and casts are still exercised).
"""
from __future__ import annotations

import contextlib
import math
import os
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
#: ``torch.get_float32_matmul_precision()`` -> Triton's ``input_precision`` for fp32 operands.
FP32_PRECISION = {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``, where Triton runs kernels on CPU tensors (for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.compiler.assume_constant_result  # read once per trace: a constant of the graph
def fp32_precision() -> str:
    """``input_precision`` of fp32 products: ``ieee``, ``tf32x3`` or ``tf32`` (see the module's table)."""
    return FP32_PRECISION[torch.get_float32_matmul_precision()]


def triton_supports(q: Tensor, act) -> bool:
    """Whether ``attention()`` may use this kernel: Triton importable, a known form, a supported dtype,
    and CUDA tensors (or CPU tensors under the interpreter)."""
    return (
        triton is not None
        and (q.is_cuda or interpreting())
        and act.fused_form is not None
        and q.dtype in _DTYPES
        and q.shape[-1] <= 256
    )


def triton_preferred(q: Tensor) -> bool:
    """Whether ``auto`` should pick Triton over the blocked kernel: not for fp32 on CUDA at ``'highest'``
    precision, where Triton has no tensor cores and the blocked kernel runs on cuBLAS."""
    return not (q.dtype == torch.float32 and q.is_cuda and fp32_precision() == "ieee")


class LaunchConfig(NamedTuple):
    """Tile sizes and launch options of one kernel: ``BLOCK_M`` queries x ``BLOCK_N`` keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


KERNELS = ("forward", "backward_kv", "backward_q")
#: ``(kernel, dtype, head-dim bucket) -> LaunchConfig``, the bucket being ``max(d, dv)`` rounded up to
#: 32, 64, 128 or 256. Sized offline (``bench triton-static``): shared memory within A100's 166,912 B
#: and Hopper's 232,448 B, every product on tensor cores, no spills (<= 1 KB with mask + bias + dropout).
#: NOT TIMED on a GPU (``scripts/gpu_check.py`` times it against ``_LEGACY``).
_TUNED = {
    ("forward", torch.bfloat16, 32): LaunchConfig(128, 64, 4, 3),
    ("forward", torch.bfloat16, 64): LaunchConfig(128, 64, 8, 3),
    ("forward", torch.bfloat16, 128): LaunchConfig(128, 64, 8, 2),
    ("forward", torch.bfloat16, 256): LaunchConfig(64, 64, 8, 2),
    ("forward", torch.float16, 32): LaunchConfig(128, 64, 4, 3),
    ("forward", torch.float16, 64): LaunchConfig(128, 64, 8, 3),
    ("forward", torch.float16, 128): LaunchConfig(128, 64, 8, 2),
    ("forward", torch.float16, 256): LaunchConfig(64, 64, 8, 2),
    ("forward", torch.float32, 32): LaunchConfig(32, 32, 8, 2),
    ("forward", torch.float32, 64): LaunchConfig(32, 32, 4, 2),
    ("forward", torch.float32, 128): LaunchConfig(32, 32, 8, 2),
    ("forward", torch.float32, 256): LaunchConfig(16, 32, 4, 1),
    ("backward_kv", torch.bfloat16, 32): LaunchConfig(64, 64, 4, 2),
    ("backward_kv", torch.bfloat16, 64): LaunchConfig(32, 32, 4, 2),
    ("backward_kv", torch.bfloat16, 128): LaunchConfig(32, 64, 8, 2),
    ("backward_kv", torch.bfloat16, 256): LaunchConfig(32, 64, 8, 2),
    ("backward_kv", torch.float16, 32): LaunchConfig(64, 64, 4, 2),
    ("backward_kv", torch.float16, 64): LaunchConfig(32, 32, 4, 2),
    ("backward_kv", torch.float16, 128): LaunchConfig(32, 64, 8, 2),
    ("backward_kv", torch.float16, 256): LaunchConfig(32, 64, 8, 2),
    ("backward_kv", torch.float32, 32): LaunchConfig(32, 16, 4, 2),
    ("backward_kv", torch.float32, 64): LaunchConfig(32, 32, 4, 2),
    ("backward_kv", torch.float32, 128): LaunchConfig(16, 16, 4, 2),
    ("backward_kv", torch.float32, 256): LaunchConfig(16, 16, 4, 1),
    ("backward_q", torch.bfloat16, 32): LaunchConfig(64, 64, 4, 2),
    ("backward_q", torch.bfloat16, 64): LaunchConfig(64, 64, 4, 2),
    ("backward_q", torch.bfloat16, 128): LaunchConfig(64, 32, 8, 2),
    ("backward_q", torch.bfloat16, 256): LaunchConfig(64, 32, 8, 2),
    ("backward_q", torch.float16, 32): LaunchConfig(64, 64, 4, 2),
    ("backward_q", torch.float16, 64): LaunchConfig(64, 64, 4, 2),
    ("backward_q", torch.float16, 128): LaunchConfig(32, 64, 8, 2),
    ("backward_q", torch.float16, 256): LaunchConfig(64, 32, 8, 2),
    ("backward_q", torch.float32, 32): LaunchConfig(32, 32, 4, 2),
    ("backward_q", torch.float32, 64): LaunchConfig(32, 64, 4, 2),
    ("backward_q", torch.float32, 128): LaunchConfig(16, 32, 4, 2),
    ("backward_q", torch.float32, 256): LaunchConfig(16, 32, 4, 1),
}
#: Short windows (Swin's 7 x 7 = 49 tokens; both lengths <= 64): one 64-query block, 32-key steps,
#: instead of a 128 x 64 tile that is mostly padding.
SHORT = 64
_SHORT = {kernel: LaunchConfig(64, 32, 4, 2) for kernel in KERNELS}
#: The table before the offline check (``POLYATTN_TRITON_TABLE=legacy``): ``(forward or backward,
#: operands 16-bit, bucket 64/128/256)``; both backward kernels share the backward entry.
_LEGACY = {
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
TABLES = ("tuned", "legacy")
GRID_ORDERS = ("blocks", "heads")


def _choice(variable: str, allowed: tuple[str, ...]) -> str:
    value = os.environ.get(variable, allowed[0])
    if value not in allowed:
        raise ValueError(f"{variable}={value!r}: expected one of {allowed}")
    return value


@torch.compiler.assume_constant_result  # read once per trace: a constant of the graph
def launch_table() -> str:
    """``POLYATTN_TRITON_TABLE``: ``tuned`` (default) or ``legacy``."""
    return _choice("POLYATTN_TRITON_TABLE", TABLES)


@torch.compiler.assume_constant_result  # read once per trace: a constant of the graph
def grid_order() -> str:
    """``POLYATTN_TRITON_GRID``: ``blocks`` (default: a head's blocks run together) or ``heads`` (the old order)."""
    return _choice("POLYATTN_TRITON_GRID", GRID_ORDERS)


def launch_config(kernel: str, dtype: torch.dtype, d: int, dv: int, nq: int, nk: int,
                  table: str | None = None) -> LaunchConfig:
    """The tile config of ``kernel`` (one of ``KERNELS``) for these operands."""
    width = max(d, dv)
    if (table or launch_table()) == "legacy":
        bucket = 64 if width <= 64 else 128 if width <= 128 else 256
        return _LEGACY[(kernel if kernel == "forward" else "backward", dtype != torch.float32, bucket)]
    if max(nq, nk) <= SHORT:
        return _SHORT[kernel]
    bucket = 32 if width <= 32 else 64 if width <= 64 else 128 if width <= 128 else 256
    return _TUNED[(kernel, dtype, bucket)]


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
    def _keep(seed, threshold, bh, offs_m, start, BLOCK_N: tl.constexpr):
        """Dropout's keep decisions for keys ``start + [0, BLOCK_N)``: word ``j % 4`` of
        ``philox(seed, j // 4, i, bh, 0)`` >= threshold, one Philox call per four keys."""
        groups = start // 4 + tl.arange(0, BLOCK_N // 4)
        rows = offs_m[:, None] + groups[None, :] * 0
        zero = rows * 0
        r0, r1, r2, r3 = tl.philox(seed, groups[None, :] + zero, rows, zero + bh, zero)
        # join(join(r0, r2), join(r1, r3))[i, g, b, a] is word 2 b + a: row-major, it is key 4 g + 2 b + a
        words = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), (offs_m.shape[0], BLOCK_N))
        return words >= threshold.to(tl.uint32)

    @triton.jit
    def _scores(q, k, t, shift, bh, offs_m, start, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base, sb_q, sb_k,
                seed, threshold, OFFSET, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr, DROPOUT: tl.constexpr,
                CAUSAL: tl.constexpr, QK: tl.constexpr, QK_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
        """``z = S + b(n) + bias`` for a (queries x keys) block and whether each pair counts (mask, causal, dropout)."""
        z = _mm(q, tl.trans(k), QK, QK_PRECISION) * t + shift[:, None]
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
            valid = valid & _keep(seed, threshold, bh, offs_m, start, BLOCK_N)
        return z, valid

    @triton.jit
    def _program(Nrows, BLOCK: tl.constexpr, HEADS_FASTEST: tl.constexpr):
        """``(flattened head, block)`` of this program on the 1-D grid of ``B*H x cdiv(Nrows, BLOCK)``."""
        pid, blocks = tl.program_id(0), tl.cdiv(Nrows, BLOCK)
        if HEADS_FASTEST:
            heads = tl.num_programs(0) // blocks
            return pid % heads, pid // heads
        else:
            return pid // blocks, pid % blocks

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
    def _score_grad(z, valid, do_c, v, FORM: tl.constexpr, POWER: tl.constexpr, PV: tl.constexpr,
                    PV_PRECISION: tl.constexpr):
        """``dS = phi'(z) * (c dO V^T)``, zero on pairs that do not count."""
        return tl.where(valid, _dphi(z, FORM, POWER), 0.0) * _mm(do_c, tl.trans(v), PV, PV_PRECISION)

    @triton.jit
    def _forward(Q, K, V, Out, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                 sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                 FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                 DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, QK_PRECISION: tl.constexpr,
                 PV_PRECISION: tl.constexpr, HEADS_FASTEST: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per query block: ``out = sum_k c phi(z) V``."""
        bh, pid = _program(Nq, BLOCK_M, HEADS_FASTEST)
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
            z, valid = _scores(q, k, t, shift, bh, offs_m, start, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base,
                               sb_q, sb_k, seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK,
                               QK_PRECISION, BLOCK_N)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0) * c[:, None]
            acc += _mm(p, v, PV, PV_PRECISION)
        _store_rows(Out + bh.to(tl.int64) * Nq * DV, acc, offs_m, Nq, offs_dv, DV)

    @triton.jit
    def _backward_kv(Q, K, V, DO, DK, DV_, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                     sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                     FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                     DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, QK_PRECISION: tl.constexpr,
                     PV_PRECISION: tl.constexpr, HEADS_FASTEST: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
        """Per key block: ``dV = sum_q phi(z)^T (c dO)``, ``dK = t sum_q dS^T Q``."""
        bh, pid = _program(Nk, BLOCK_N, HEADS_FASTEST)
        start = pid * BLOCK_N
        offs_n = start + tl.arange(0, BLOCK_N)
        offs_d, offs_dv = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DV)
        k = _load_rows(K + bh.to(tl.int64) * Nk * D, offs_n, Nk, offs_d, D)
        v = _load_rows(V + bh.to(tl.int64) * Nk * DV, offs_n, Nk, offs_dv, DV)
        mask_base, bias_base, seed = _head_extras(Mask, Bias, Seed, bh, H, sm_b, sm_h, sb_b, sb_h, DROPOUT)
        DO_head = DO + bh.to(tl.int64) * Nq * DV
        dk = tl.zeros((BLOCK_N, BLOCK_D), dtype=tl.float32)
        dv = tl.zeros((BLOCK_N, BLOCK_DV), dtype=tl.float32)
        lo = 0
        if CAUSAL:  # no query before the first key's first reader
            lo = tl.maximum(0, start - OFFSET) // BLOCK_M * BLOCK_M
        for row in range(lo, Nq, BLOCK_M):
            offs_m = row + tl.arange(0, BLOCK_M)
            q, c, shift = _query_block(Q, C, Shift, bh, offs_m, Nq, offs_d, D)
            do_c = _load_rows(DO_head, offs_m, Nq, offs_dv, DV).to(tl.float32) * c[:, None]
            z, valid = _scores(q, k, t, shift, bh, offs_m, start, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base,
                               sb_q, sb_k, seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK,
                               QK_PRECISION, BLOCK_N)
            p = tl.where(valid, _phi(z, FORM, POWER), 0.0)
            dv += _mm(tl.trans(p), do_c, PV, PV_PRECISION)
            ds = _score_grad(z, valid, do_c, v, FORM, POWER, PV, PV_PRECISION)
            dk += _mm(tl.trans(ds), q, PV, PV_PRECISION)
        _store_rows(DK + bh.to(tl.int64) * Nk * D, dk * t, offs_n, Nk, offs_d, D)
        _store_rows(DV_ + bh.to(tl.int64) * Nk * DV, dv, offs_n, Nk, offs_dv, DV)

    @triton.jit
    def _backward_q(Q, K, V, DO, DQ, DBias, C, Shift, Mask, Bias, Seed, t, threshold, Nq, Nk, H, D, DV,
                    sm_b, sm_h, sm_q, sm_k, sb_b, sb_h, sb_q, sb_k, OFFSET,
                    FORM: tl.constexpr, POWER: tl.constexpr, HAS_MASK: tl.constexpr, HAS_BIAS: tl.constexpr,
                    DROPOUT: tl.constexpr, CAUSAL: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr, QK_PRECISION: tl.constexpr,
                    PV_PRECISION: tl.constexpr, HEADS_FASTEST: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BIAS_GRAD: tl.constexpr):
        """Per query block: ``dQ = t sum_k dS K``; with ``BIAS_GRAD`` also writes ``dS`` (the bias gradient)."""
        bh, pid = _program(Nq, BLOCK_M, HEADS_FASTEST)
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
            z, valid = _scores(q, k, t, shift, bh, offs_m, start, offs_n, Nq, Nk, mask_base, sm_q, sm_k, bias_base,
                               sb_q, sb_k, seed, threshold, OFFSET, HAS_MASK, HAS_BIAS, DROPOUT, CAUSAL, QK,
                               QK_PRECISION, BLOCK_N)
            ds = _score_grad(z, valid, do_c, v, FORM, POWER, PV, PV_PRECISION)
            if BIAS_GRAD:
                inside = (offs_m[:, None] < Nq) & (offs_n[None, :] < Nk)
                tl.store(DS_head + offs_m[:, None] * Nk + offs_n[None, :], ds, mask=inside)
            dq += _mm(ds, k, PV, PV_PRECISION)
        _store_rows(DQ + bh.to(tl.int64) * Nq * D, dq * t, offs_m, Nq, offs_d, D)


def _tl_dtype(dtype: torch.dtype):
    """Operand dtype of the products; the interpreter multiplies bf16 as raw integers, so it gets fp32."""
    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def product_types(dtype: torch.dtype) -> dict:
    """The products' operand dtypes and ``input_precision`` for ``dtype`` inputs (the module's table)."""
    fp32 = fp32_precision()
    if launch_table() == "legacy":  # as before the offline check: fp32 operands on TF32 only if allow_tf32 says so
        fp32 = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
        if dtype == torch.float16:
            return dict(QK=_tl_dtype(dtype), QK_PRECISION="ieee", PV=tl.float32, PV_PRECISION=fp32)
    if dtype == torch.float16:
        return dict(QK=_tl_dtype(dtype), QK_PRECISION="ieee", PV=tl.float32, PV_PRECISION="tf32")
    if dtype == torch.bfloat16:
        return dict(QK=_tl_dtype(dtype), QK_PRECISION="ieee", PV=_tl_dtype(dtype), PV_PRECISION="ieee")
    return dict(QK=tl.float32, QK_PRECISION=fp32, PV=tl.float32, PV_PRECISION=fp32)


def _broadcast_strides(x: Tensor | None) -> tuple[int, int, int, int]:
    """Element strides of a 4-D mask or bias, 0 along the dimensions it broadcasts along (size 1)."""
    if x is None:
        return (0, 0, 0, 0)
    return tuple(0 if size == 1 else stride for size, stride in zip(x.shape, x.stride()))


class Launch(NamedTuple):
    """One kernel launch: the Triton function, its 1-D grid, runtime arguments, constexprs and tile config."""

    kernel: object
    grid: tuple[int]
    args: tuple
    meta: dict
    config: LaunchConfig


def _shared(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal):
    """Runtime arguments after the block tensors, and the compile-time ones, shared by all three kernels."""
    nq, nk, d, dv = q3.shape[1], k3.shape[1], q3.shape[2], v3.shape[2]
    threshold = min(math.floor(dropout_p * 2**32), 2**32 - 1)
    args = (c, shift, q3 if mask is None else mask, q3 if bias is None else bias, q3 if seed is None else seed,
            t, threshold, nq, nk, heads, d, dv, *_broadcast_strides(mask), *_broadcast_strides(bias),
            0 if causal is None else causal)
    meta = dict(
        FORM=form, POWER=power, HAS_MASK=mask is not None, HAS_BIAS=bias is not None, DROPOUT=dropout_p > 0,
        CAUSAL=causal is not None,
        **product_types(q3.dtype), HEADS_FASTEST=grid_order() == "heads",
        BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    return args, meta


def _launch(name: str, kernel, rows: int, q3, k3, v3, args, meta) -> Launch:
    config = launch_config(name, q3.dtype, q3.shape[2], v3.shape[2], q3.shape[1], k3.shape[1])
    block = config.block_n if name == "backward_kv" else config.block_m
    grid = (q3.shape[0] * triton.cdiv(rows, block),)
    return Launch(kernel, grid, args, {**meta, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}, config)


def forward_launches(q3, k3, v3, out, c, shift, mask, bias, seed, heads, t, form, power, dropout_p,
                     causal) -> list[Launch]:
    """The forward kernel's launch for contiguous ``(B*H, N, d)`` operands (mask/bias 4-D, broadcastable)."""
    args, meta = _shared(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
    return [_launch("forward", _forward, q3.shape[1], q3, k3, v3, (q3, k3, v3, out, *args), meta)]


def backward_launches(q3, k3, v3, do, dq, dk, dv, ds, c, shift, mask, bias, seed, heads, t, form, power, dropout_p,
                      causal, bias_grad: bool) -> list[Launch]:
    """The two backward kernels' launches; ``ds`` is the bias-gradient buffer (any tensor without ``bias_grad``)."""
    args, meta = _shared(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
    return [
        _launch("backward_kv", _backward_kv, k3.shape[1], q3, k3, v3, (q3, k3, v3, do, dk, dv, *args), meta),
        _launch("backward_q", _backward_q, q3.shape[1], q3, k3, v3, (q3, k3, v3, do, dq, ds, *args),
                {**meta, "BIAS_GRAD": bias_grad}),
    ]


def _device_guard(x: Tensor):
    """Triton launches on the current CUDA device: make it ``x``'s for the launches (not while tracing with
    fake tensors, where nothing is launched)."""
    from torch._subclasses.fake_tensor import is_fake

    return torch.cuda.device(x.device) if x.is_cuda and not is_fake(x) else contextlib.nullcontext()


def _run(launches: list[Launch]) -> None:
    """The launches (where Triton compiles each on first use)."""
    for launch in launches:
        torch.library.wrap_triton(launch.kernel)[launch.grid](
            *launch.args, **launch.meta, num_warps=launch.config.num_warps, num_stages=launch.config.num_stages,
        )


if triton is not None:

    @torch.library.triton_op("polyattn::triton_forward", mutates_args=())
    def triton_forward(
        q3: Tensor, k3: Tensor, v3: Tensor, c: Tensor, shift: Tensor, mask: Optional[Tensor], bias: Optional[Tensor],
        seed: Optional[Tensor], heads: int, t: float, form: int, power: int, dropout_p: float,
        causal: Optional[int] = None,
    ) -> Tensor:
        """``out (B*H, Nq, dv)`` from contiguous ``(B*H, N, d)`` operands; mask/bias 4-D, broadcastable."""
        out = q3.new_empty(q3.shape[0], q3.shape[1], v3.shape[2])
        with _device_guard(q3):
            _run(forward_launches(q3, k3, v3, out, c, shift, mask, bias, seed, heads, t, form, power, dropout_p,
                                  causal))
        return out

    @torch.library.triton_op("polyattn::triton_backward", mutates_args=())
    def triton_backward(
        q3: Tensor, k3: Tensor, v3: Tensor, do: Tensor, c: Tensor, shift: Tensor, mask: Optional[Tensor],
        bias: Optional[Tensor], seed: Optional[Tensor], heads: int, t: float, form: int, power: int,
        dropout_p: float, causal: Optional[int], bias_grad: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``dq, dk, dv`` and, with ``bias_grad``, ``dS`` as fp32 ``(B*H, Nq, Nk)`` (else an empty tensor)."""
        bh, nq, nk = q3.shape[0], q3.shape[1], k3.shape[1]
        dq, dk, dv = torch.empty_like(q3), torch.empty_like(k3), torch.empty_like(v3)
        ds = (q3.new_zeros if causal is not None else q3.new_empty)(  # causal: skipped tiles stay 0
            (bh, nq, nk) if bias_grad else (0,), dtype=torch.float32
        )
        with _device_guard(q3):
            _run(backward_launches(q3, k3, v3, do, dq, dk, dv, ds if bias_grad else dq, c, shift, mask, bias, seed,
                                   heads, t, form, power, dropout_p, causal, bias_grad))
        return dq, dk, dv, ds


def draw_seed(device: torch.device) -> Tensor:
    """The dropout seed of one call: a one-element int64 tensor drawn on ``device`` by its default generator
    (on CUDA: no host copy, no stream sync, capturable in a CUDA graph)."""
    return torch.randint(2**63 - 1, (1,), dtype=torch.int64, device=device)


def kernel_operands(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, bias: Tensor | None):
    """``q, k, v`` as contiguous ``(B*H, N, d)`` in ``q``'s dtype, the mask as a 4-D uint8 view of ``allowed``
    (its strides kept, no copy) and the bias as 4-D: what the operators get."""
    q3, k3, v3 = (x.to(q.dtype).reshape(-1, x.shape[-2], x.shape[-1]).contiguous() for x in (q, k, v))
    mask = None if allowed is None else _as_4d(allowed).view(torch.uint8)
    return q3, k3, v3, mask, None if bias is None else _as_4d(bias)


class TritonAttention(torch.autograd.Function):
    """``out = c(n) / (1 - p) * dropout(mask(f(S + b(n) + bias))) @ v`` on the Triton operators.

    Operands go in as contiguous ``(B*H, N, d)`` in ``q``'s dtype; the output
    comes back in ``v``'s dtype and each gradient in its input's. ``seed``: the
    dropout seed tensor (default: drawn by ``draw_seed``).
    """

    @staticmethod
    def forward(ctx, q, k, v, bias, act, t: float, allowed, n, dropout_p: float, causal: int | None,
                seed: Tensor | None = None):
        B, H, nq, _ = q.shape
        nk, dv = k.shape[-2], v.shape[-1]
        q3, k3, v3, mask, bias4 = kernel_operands(q, k, v, allowed, bias)
        c, shift = act.per_row(n, (B, H, nq, nk), torch.float32)
        if dropout_p:
            c = c / (1.0 - dropout_p)
        if dropout_p and seed is None:
            seed = draw_seed(q.device)
        elif not dropout_p:
            seed = None
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
        return (*grads, dbias, None, None, None, None, None, None, None)


def _as_4d(x: Tensor) -> Tensor:
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


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
