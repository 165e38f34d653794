"""Launch tables of the Triton kernels: tile sizes per kernel, dtype and head dim, and the launches themselves.

Tiles per kernel, dtype and head dim come from ``_TUNED`` (sized offline for A100's and Hopper's shared memory
and registers: ``python -m polyattn_lightning.bench triton-static``); ``POLYATTN_TRITON_TABLE=legacy`` selects
the table before that (``_LEGACY``) and ``POLYATTN_TRITON_GRID=heads`` the old grid order (heads fastest), so
that a GPU run can time old against new (docs/benchmarks/kernels-cuda.md says what has been timed). Nothing here
imports Triton at module level: the backend's checks (``__init__``) read these tables on machines without it.
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import Tensor

#: ``torch.get_float32_matmul_precision()`` -> Triton's ``input_precision`` for fp32 operands.
FP32_PRECISION = {"highest": "ieee", "high": "tf32x3", "medium": "tf32"}


def interpreting() -> bool:
    """True under ``TRITON_INTERPRET=1``, where Triton runs kernels on CPU tensors (for tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@torch.compiler.assume_constant_result  # read once per trace: a constant of the graph
def fp32_precision() -> str:
    """``input_precision`` of fp32 products: ``ieee``, ``tf32x3`` or ``tf32`` (see the module's table)."""
    return FP32_PRECISION[torch.get_float32_matmul_precision()]


class LaunchConfig(NamedTuple):
    """Tile sizes and launch options of one kernel: ``BLOCK_M`` queries x ``BLOCK_N`` keys per step."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


KERNELS = ("forward", "backward_kv", "backward_q")
#: ``(kernel, dtype, head-dim bucket) -> LaunchConfig``, the bucket being ``max(d, dv)`` rounded up to
#: 32, 64, 128 or 256. Sized offline (``bench triton-static``): shared memory within A100's 166,912 B
#: and Hopper's 232,448 B, every product on tensor cores, no spills (<= 1 KB with mask + bias + dropout); fp32 at
#: 'highest' precision (IEEE products, on FMA) is held to the shared memory alone.
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
    ("backward_q", torch.bfloat16, 128): LaunchConfig(32, 64, 8, 2),
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
#: The widest head-dim bucket whose short tile fits A100's shared memory without spilling past the goals above, per
#: dtype (compiled offline: fp16's spills over 1 KB with mask + bias + dropout from d = 128 and outgrows A100 at
#: d = 256, fp32's spills from d = 64 and outgrows A100 from d = 128); wider short windows take the bucket's tile.
_SHORT_WIDEST = {torch.bfloat16: 128, torch.float16: 64, torch.float32: 32}
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


def launch_config(
    kernel: str, dtype: torch.dtype, d: int, dv: int, nq: int, nk: int, table: str | None = None
) -> LaunchConfig:
    """The tile config of ``kernel`` (one of ``KERNELS``) for these operands."""
    width = max(d, dv)
    if (table or launch_table()) == "legacy":
        bucket = 64 if width <= 64 else 128 if width <= 128 else 256
        return _LEGACY[(kernel if kernel == "forward" else "backward", dtype != torch.float32, bucket)]
    bucket = 32 if width <= 32 else 64 if width <= 64 else 128 if width <= 128 else 256
    if max(nq, nk) <= SHORT and bucket <= _SHORT_WIDEST[dtype]:
        return _SHORT[kernel]
    return _TUNED[(kernel, dtype, bucket)]


def _tl_dtype(dtype: torch.dtype):
    """Operand dtype of the products; the interpreter multiplies bf16 as raw integers, so it gets fp32."""
    import triton.language as tl

    if dtype == torch.bfloat16 and interpreting():
        return tl.float32
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[dtype]


def product_types(dtype: torch.dtype) -> dict:
    """The products' operand dtypes and ``input_precision`` for ``dtype`` inputs (the package docstring's table)."""
    import triton.language as tl

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
    args = (
        c,
        shift,
        q3 if mask is None else mask,
        q3 if bias is None else bias,
        q3 if seed is None else seed,
        t,
        threshold,
        nq,
        nk,
        heads,
        d,
        dv,
        *_broadcast_strides(mask),
        *_broadcast_strides(bias),
        0 if causal is None else causal,
    )
    import triton

    meta = dict(
        FORM=form,
        POWER=power,
        HAS_MASK=mask is not None,
        HAS_BIAS=bias is not None,
        DROPOUT=dropout_p > 0,
        CAUSAL=causal is not None,
        **product_types(q3.dtype),
        HEADS_FASTEST=grid_order() == "heads",
        BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_DV=max(16, triton.next_power_of_2(dv)),
    )
    return args, meta


def _launch(name: str, kernel, rows: int, q3, k3, v3, args, meta) -> Launch:
    import triton

    config = launch_config(name, q3.dtype, q3.shape[2], v3.shape[2], q3.shape[1], k3.shape[1])
    block = config.block_n if name == "backward_kv" else config.block_m
    grid = (q3.shape[0] * triton.cdiv(rows, block),)
    return Launch(kernel, grid, args, {**meta, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n}, config)


def forward_launches(
    q3, k3, v3, out, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal
) -> list[Launch]:
    """The forward kernel's launch for contiguous ``(B*H, N, d)`` operands (mask/bias 4-D, broadcastable)."""
    from .jit import _forward

    args, meta = _shared(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
    return [_launch("forward", _forward, q3.shape[1], q3, k3, v3, (q3, k3, v3, out, *args), meta)]


def backward_launches(
    q3,
    k3,
    v3,
    do,
    dq,
    dk,
    dv,
    ds,
    c,
    shift,
    mask,
    bias,
    seed,
    heads,
    t,
    form,
    power,
    dropout_p,
    causal,
    bias_grad: bool,
) -> list[Launch]:
    """The two backward kernels' launches; ``ds`` is the bias-gradient buffer (any tensor without ``bias_grad``)."""
    from .jit import _backward_kv, _backward_q

    args, meta = _shared(q3, k3, v3, c, shift, mask, bias, seed, heads, t, form, power, dropout_p, causal)
    return [
        _launch("backward_kv", _backward_kv, k3.shape[1], q3, k3, v3, (q3, k3, v3, do, dk, dv, *args), meta),
        _launch(
            "backward_q",
            _backward_q,
            q3.shape[1],
            q3,
            k3,
            v3,
            (q3, k3, v3, do, dq, ds, *args),
            {**meta, "BIAS_GRAD": bias_grad},
        ),
    ]
