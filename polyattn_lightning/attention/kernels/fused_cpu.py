"""``fused_cpu``: the fused C++ CPU kernel (``csrc/fused_cpu.cpp``; built by ``cpp.load``).

On CPU this is what makes a non-softmax model train as fast as softmax on
SDPA: one C++ loop per thread over cache-resident score tiles, BLAS for the
products, ``f``/``f'``/mask/dropout applied while the tile is hot. It knows the
built-in forms (``poly{p}``, ``relu``, ``softplus``, ``sigmoid``), any
boolean mask, a score bias (Swin's relative-position bias, with its gradient)
and attention dropout.

Key padding: a mask that only depends on the key (``(B, 1, 1, Nk)``, what a
``key_padding_mask`` becomes) is turned into per-sequence key lengths here, once
per call; the kernel's key loops stop at each sequence's last attendable key,
and when the attendable keys are a prefix (padding at the end, the usual case)
the mask is dropped altogether. Padded *queries* are still computed: the mask
applies to keys, and their outputs are defined (they attend to the real keys).

Causal (``causal``, the diagonal offset ``Nk - Nq``): the kernel never computes
a tile wholly above the diagonal and masks the tiles the diagonal crosses from
their coordinates; no causal mask tensor exists (``csrc/fused_cpu.cpp``).

Dropout RNG scheme (the Triton kernel uses the same one): one 64-bit ``seed`` per call,
drawn from torch's default CPU generator (``draw_seed``), so a seeded run
repeats and a restored RNG state (ExactResume) continues it exactly. (The
Triton kernel draws its seed on the CUDA device, from that device's generator,
to spare a host copy: for the same ``torch.manual_seed`` the two kernels drop
different pairs.) Entry
(query ``i``, key ``j``) of flattened head ``bh = b * H + h`` is kept iff::

    philox4x32_10(key=(seed & 0xffffffff, seed >> 32),
                  counter=(j // 4, i, bh, offset))[j % 4] >= threshold,
    threshold = min(floor(p * 2**32), 2**32 - 1)      # unsigned 32-bit

which is ``triton.language.philox(seed, j // 4, i, bh, offset)`` with int32
counters and the default 10 rounds, output ``j % 4``. ``offset`` is 0 here.
Kept entries are scaled by ``1 / (1 - p)`` (folded into ``c(n)``). The decision is a pure function of its coordinates,
so
no ``N x N`` mask exists: the backward regenerates it tile by tile, whatever its
tile shapes. ``dropout_keep_mask`` materialises it for small shapes (tests).

Where the C++ kernels cannot be built (no compiler), a warning says why and
the blocked kernel runs instead.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ... import deprecated
from ..dtypes import autocast_off, compute_dtype
from ..registry import Activation
from .base.contract import KV_STEP, PARALLEL, Backend, KernelInputs, KVStep, elementwise_reasons, stateless_reasons
from .base.costs import quadratic_cost
from .base.cpp import load
from .base.layout import as_4d, flatten_heads
from .blocked import grad_gain

#: Tile sizes (query rows x keys). The forward's 64 x 512 fp32 tile (128 KiB) and the
#: backward's three 128 x 256 tiles stay in L2; measured best on the benchmark machine.
FORWARD_BLOCK = (64, 512)
BACKWARD_BLOCK = (128, 256)


def draw_seed() -> int:
    """The dropout seed of one call, from torch's default CPU generator (advancing it once)."""
    return int(torch.randint(2**63 - 1, (), dtype=torch.int64).item())


def dropout_keep_mask(batch_heads: int, nq: int, nk: int, dropout_p: float, seed: int, offset: int = 0) -> Tensor:
    """The kernel's keep mask, bool ``(B*H, Nq, Nk)``, materialised: for tests and small shapes only."""
    if not load():
        raise RuntimeError("the fused_cpu kernel could not be built on this machine (see the warning above)")
    return torch.ops.polyattn_cpu.dropout_keep_mask(batch_heads, nq, nk, dropout_p, seed, offset)


def key_lengths(allowed: Tensor | None, batch: int, nk: int) -> tuple[Tensor | None, Tensor | None]:
    """``(lengths, allowed)``: per-sequence key extents for a key-only mask, and the mask still needed.

    ``lengths[b]`` is one past the last attendable key of sequence ``b`` (0 if none): keys
    beyond it contribute nothing, so the kernel never visits them. The mask is returned as
    None when each sequence's attendable keys are exactly its first ``lengths[b]``.
    A mask that varies over heads or queries is returned unchanged with no lengths.
    """
    if allowed is None or allowed.shape[1] != 1 or allowed.shape[2] != 1:
        return None, allowed
    keep = allowed.expand(allowed.shape[0], 1, 1, nk).reshape(-1, nk)
    lengths = (keep * torch.arange(1, nk + 1, device=keep.device)).amax(dim=-1)
    # torch.compile keeps the mask rather than break the graph on this data-dependent test
    prefix = not torch.compiler.is_compiling() and bool((keep.sum(dim=-1) == lengths).all())
    return lengths.expand(batch).contiguous(), None if prefix else allowed


def fused_forward(
    q, k, v, bias, act: Activation, t: float, allowed, lengths, n, dropout_p: float, seed: int, causal: int | None
) -> tuple[Tensor, tuple, tuple]:
    """The forward of :class:`FusedCPUAttention`: ``(out, tensors the backward needs, its metadata)``."""
    shape4 = (*q.shape[:3], k.shape[-2])
    dtype = compute_dtype(q)
    form, power = (int(x) for x in act.fused_form)
    with autocast_off("cpu"):
        row_scale, row_shift = act.per_row(n, shape4, dtype, shift=act.shift is not None)
        if dropout_p:
            row_scale = row_scale / (1.0 - dropout_p)
        q3, k3, v3 = flatten_heads(q, dtype) * t, flatten_heads(k, dtype), flatten_heads(v, dtype)
        bias4 = None if bias is None else as_4d(bias.detach().to(dtype)).contiguous()
        strided = [None if x is None else x.expand(shape4) for x in (bias4, allowed)]
        rng = (dropout_p, seed, 0)  # (p, seed, offset)
        out = torch.ops.polyattn_cpu.forward(
            q3,
            k3,
            v3,
            row_scale,
            row_shift,
            *strided,
            lengths,
            shape4[1],
            form,
            power,
            *rng,
            *FORWARD_BLOCK,
            causal,
        )
    meta = (shape4, t, act, None if bias is None else bias4.shape, rng, causal)
    return out.view(*shape4[:3], -1).to(v.dtype), (q3, k3, v3, row_scale, row_shift, *strided, lengths), meta


class FusedCPUAttention(torch.autograd.Function):
    """``out = c(n) * dropout(mask(f(S + b(n) + bias))) @ v``; forward and backward in C++.

    Operands go in as contiguous ``(B*H, N, d)`` in the compute dtype with ``t``
    folded into ``q``; ``c(n) / (1 - p)`` scales ``out`` (forward) and ``dO`` (backward);
    the constant factor of ``f'`` (``p`` for ``S^p``) scales dQ, dK and dbias.
    ``lengths`` and the reduced ``allowed`` come from ``key_lengths``; ``seed`` from ``draw_seed``.
    """

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        bias,
        act: Activation,
        t: float,
        allowed,
        lengths,
        n,
        dropout_p: float,
        seed: int,
        causal: int | None,
    ):
        out, saved, meta = fused_forward(q, k, v, bias, act, t, allowed, lengths, n, dropout_p, seed, causal)
        ctx.save_for_backward(*saved)
        ctx.meta = meta
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, None if bias is None else bias.dtype)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, row_scale, row_shift, bias, mask, lengths = ctx.saved_tensors
        shape4, t, act, bias_shape, rng, causal = ctx.meta
        form, power = (int(x) for x in act.fused_form)
        want_bias = bias is not None and ctx.needs_input_grad[3]
        with autocast_off("cpu"):
            dout = (grad_out.reshape(q3.shape[0], q3.shape[1], -1).to(q3.dtype) * row_scale[..., None]).contiguous()
            dq, dk, dv, dbias = torch.ops.polyattn_cpu.backward(
                q3,
                k3,
                v3,
                dout,
                row_shift,
                bias,
                mask,
                lengths,
                want_bias,
                shape4[1],
                form,
                power,
                *rng,
                *BACKWARD_BLOCK,
                causal,
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
            None,
            None,
            None,
            None,
            None,
            None,
            None,
            None,
        )


def fused_cpu(q, k, v, act, t, allowed, bias, n, dropout_p, causal=None) -> Tensor:
    """The fused kernel on resolved arguments (``KernelInputs``' fields)."""
    lengths, allowed = key_lengths(allowed, q.shape[0], k.shape[-2])
    seed = draw_seed() if dropout_p else 0
    args = (q, k, v, bias, act, t, allowed, lengths, n, float(dropout_p), seed, causal)
    if torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, bias)):
        return FusedCPUAttention.apply(*args)
    return fused_forward(*args)[0]  # inference (decoding with a KV cache): no autograd node to build


def decode(q: Tensor, k: Tensor, v: Tensor, act: Activation, t: float, causal: bool = False) -> Tensor | None:
    """A KV-cache step in one C++ call (``decode`` in ``csrc/fused_cpu.cpp``) in Hugging Face's ``(B, R, H, dv)``
    layout; None where it cannot run (not CPU tensors, a custom activation, no C++ build). The backend's KV-cache step
    form (:meth:`FusedCPU.kv_step`) is the same call in ``attention()``'s ``(B, H, R, dv)``, laid out in memory as
    this one is (the op returns that view).

    A few query rows, no mask, no gradient. Not causal: every row attends every key, ``n = Nk``. Causal: the rows are
    the last ``R`` positions (a short prompt's prefill), row ``r`` attends the first ``Nk - R + r + 1`` keys. q
    ``(B, H, R, d)``, k/v ``(B, H_kv, Nk, d)`` in any strides (query head ``h`` reads kv head ``h // (H / H_kv)``; the
    cache is never repeated), the output in ``v``'s dtype.
    """
    if q.device.type != "cpu" or decode_plan(act) is None:
        return None
    return BACKEND.kv_step(act)(q, k, v, t, causal).transpose(1, 2)


@functools.cache
def decode_plan(act: Activation) -> tuple[Any, int, int] | None:
    """``(op, form, power)``: :func:`decode`'s C++ op and ``act``'s form, resolved once per activation (a decoding
    step is a few microseconds: each lookup counts); None for an activation it does not know or without a build."""
    form = act.fused_form
    if form is None or not load():
        return None
    return torch.ops.polyattn_cpu.decode.default, int(form[0]), form[1]


class FusedCPU(Backend):
    name = "fused_cpu"
    supports = (
        "CPU tensors, the built-in forms (poly{p}, relu, softplus, sigmoid), every mask, bias, dropout, causal; a "
        "KV-cache step in one call"
    )
    forms = frozenset({PARALLEL, KV_STEP})

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = stateless_reasons(inputs, self.name) + elementwise_reasons(inputs)
        if not inputs.act.is_softmax and inputs.act.fused_form is None:
            reasons.append(
                f"the fused_cpu kernel does not know activation {inputs.act.name!r} (a custom one: "
                "kernel='blocked' runs it)"
            )
        if inputs.q.device.type != "cpu":
            reasons.append(f"q is on {inputs.q.device}; this kernel runs on CPU tensors")
        elif not load():
            reasons.append("the C++ kernels could not be built on this machine (see the warning above)")
        return reasons

    def cost(self, inputs: KernelInputs) -> float:
        return quadratic_cost(inputs)

    def forward(self, inputs: KernelInputs) -> Tensor:
        if inputs.few_rows:  # a short prompt or input: the KV-cache step's one call serves as well
            return self.kv_step(inputs.act)(inputs.q, inputs.k, inputs.v, inputs.t, inputs.causal is not None)
        return fused_cpu(*inputs.tiled)

    def kv_step(self, act: Activation) -> KVStep:
        """The C++ ``decode`` op with ``act``'s form and row constants bound: per step, the rows' ``c(n)``, ``b(n)``
        (one count without causality: every row attends every key) and the call."""
        op, form, power = decode_plan(act)
        constants = act.row_constants

        def step(q: Tensor, k: Tensor, v: Tensor, t: float, causal: bool) -> Tensor:
            keys = k.shape[2]
            if causal and q.shape[2] > 1:
                rows = q.shape[2]
                scales, shifts = zip(*(constants(keys - rows + r + 1) for r in range(rows)))
                return op(q, k, v, form, power, t, scales, shifts, True)
            scale, shift = constants(keys)
            return op(q, k, v, form, power, t, (scale,), (shift,), False)

        return step


BACKEND = FusedCPU()


def __getattr__(name: str):
    """Names that moved or went: where to (``polyattn_lightning/deprecated.py``)."""
    return deprecated.attribute(__name__, name)
