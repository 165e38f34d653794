"""``power``: the exact linear-time form of ``poly{p}`` attention for p = 2..4 (p = 1 is ``associative``).

``(q . k)^p = <phi_p(q), phi_p(k)>`` where ``phi_p`` lists the ``D = C(d+p-1, p)`` monomials of degree p,
each weighted by the square root of its multinomial count, so ``x^p`` attention is
``c(n) t^p phi_p(Q) (phi_p(K)^T V)``: O(N D dv) instead of O(N^2 d). Because the scale is ``c(n)``
(``1/sqrt(N)``; no row-sum denominator, unlike softmax or linear attention) the identity holds for odd p as
well: a padded key drops out when its features are zeroed and ``n`` counts the rest. Score bias and attention
dropout do not factor and stay on the quadratic kernels; RoPE (applied to q and k before) does factor.

D grows fast: 528 (d = 32, p = 2), 2,080 (d = 64, p = 2), 5,984 (d = 32, p = 3), 45,760 (d = 64, p = 3),
52,360 (d = 32, p = 4). The features of N keys would be N x D (392 MB for N = 16k, d = 32, p = 3), so the
kernels never hold them: keys and queries go through the features in chunks (``chunk_size``), built inside
the kernel and met with the ``D x dv`` state in one product. Memory is O(N d + D dv) per (batch, head).

Causal (query i attends keys ``j <= i + Nk - Nq``, bottom-right): chunked, quadratic inside a chunk (a small
lower-triangular ``(q . k)^p`` tile), the running state across chunks, with the per-row ``c(n_i)``.

Kernels: on CPU ``csrc/power_cpu.cpp`` (built by ``cpp.py``); on CUDA the Triton programs of
``triton/power_jit.py`` (``triton/power_op.py``). Both take grouped-query attention natively (a kv head's state
serves its group of query heads), fp32/bf16/fp16 operands with fp32 states, and have a hand-written backward.

``kernel="auto"`` compares this form's cost with the quadratic kernel's: the two meet at the crossover
length measured on the machine (``crossover.json``, written by ``python -m polyattn_lightning.bench
crossover``; :func:`~.base.crossover_length`).
"""

from __future__ import annotations

import functools
import itertools
import math

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..dtypes import autocast_off, compute_dtype
from ..forms import FusedForm
from .base import Backend, KernelInputs, crossover_length, elementwise_reasons, key_padding_reasons, linear_cost
from .blocked import flatten_heads
from .cpp import load

#: The powers this form takes (p = 1 is ``associative``'s ``q (k^T v)``).
POWERS = (2, 3, 4)
#: The Triton form's largest head dim (its launch configs are checked offline up to it: ``bench triton-static``).
CUDA_MAX_HEAD_DIM = 128
#: Feature-block budget of the C++ kernel, in elements: the chunk is the largest power of two of tokens
#: whose ``D x chunk`` block stays near 2 MB (fp32), at least 16 and at most 128 tokens.
CHUNK_ELEMENTS = 1 << 19


def monomial_count(d: int, p: int) -> int:
    """``D = C(d + p - 1, p)``: the monomials of degree ``p`` in ``d`` variables."""
    return math.comb(d + p - 1, p)


def chunk_size(d: int, p: int) -> int:
    """Tokens per chunk of the C++ kernel for head dim ``d`` and power ``p``."""
    fits = max(1, CHUNK_ELEMENTS // monomial_count(d, p))
    return max(16, min(128, 1 << (fits.bit_length() - 1)))


def power_of(act) -> int | None:
    """``p`` of a ``poly{p}`` activation, else None."""
    form = act.fused_form
    return form[1] if form is not None and form[0] is FusedForm.POLY else None


# --------------------------------------------------------------------------- the C++ kernels (CPU)


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
        return (*_unflatten(grad_out, (dq, dk, dv), dtypes), None, None, None, None, None)


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
        return (*_unflatten(grad_out, (dq, dk, dv), dtypes), None, None, None, None, None)


def _unflatten(grad_out: Tensor, grads, dtypes) -> list[Tensor]:
    batch = grad_out.shape[0]
    return [g.view(batch, -1, *g.shape[1:]).to(dtype) for g, dtype in zip(grads, dtypes)]


# --------------------------------------------------------------------------- on resolved arguments


def row_scales(act, n: Tensor, shape: tuple[int, int, int], dtype: torch.dtype) -> Tensor:
    """``c(n)`` per query row as a contiguous ``(B*Hq, Nq)`` in ``dtype``."""
    batch, heads, nq = shape
    return act.row_scale(n.to(dtype)).expand(batch, heads, nq, 1).reshape(batch * heads, nq).contiguous()


def key_keep(allowed: Tensor | None, batch: int, kv_heads: int, nk: int, dtype: torch.dtype) -> Tensor | None:
    """A key-padding ``allowed`` ``(B?, 1, 1, Nk)`` as 1/0 per key, ``(B*Hkv, Nk)`` in ``dtype``; None: none."""
    if allowed is None:
        return None
    return allowed.to(dtype).expand(batch, kv_heads, 1, nk).reshape(batch * kv_heads, nk).contiguous()


def power_attention(q, k, v, act, t, allowed, n, causal=None) -> Tensor:
    """The linear form on resolved arguments; ``k``, ``v`` may have fewer heads than ``q`` (grouped-query)."""
    batch, heads, nq = q.shape[:3]
    kv_heads, nk = k.shape[1], k.shape[-2]
    power, groups = power_of(act), heads // kv_heads
    if q.is_cuda:
        from .triton.power_op import triton_power_attention

        return triton_power_attention(
            q, k, v, act, float(t), allowed, n, causal, *device_monomials(q.shape[-1], power, q.device)
        )
    dtype = compute_dtype(q)
    s = row_scales(act, n, (batch, heads, nq), dtype)
    keep = key_keep(allowed, batch, kv_heads, nk, dtype)
    function = PowerAttentionCPU if causal is None else CausalPowerAttentionCPU
    return function.apply(q, k, v, keep, s, float(t), power, groups)


# --------------------------------------------------------------------------- a recurrent state (decoding)
#
# A causal model generating with this form keeps, per kv head, the state ``S = sum_j w m(k_j) v_j^T``
# (``D x dv``) and the number of keys folded into it, instead of every key and value: the next token's output
# is ``c(n) m(q t) S`` once its own key is folded in. ``attention.switch.hf.cache`` keeps them for a
# Hugging Face model. The functions below update a state in place; p = 1 (poly1) is here too (``m(x) = x``).

#: ``Activation.scale`` -> the decode kernel's ``length_scale`` (0: the fixed value).
LENGTH_SCALE_CODES = {"inv_sqrt_n": 1, "inv_n": 2}


@functools.cache
def monomials(d: int, p: int) -> tuple[Tensor, Tensor]:
    """``(index (D, p), weight (D,))``: each monomial's coordinates ``e1 <= ... <= ep`` and multinomial count,
    in the kernels' order (lexicographic). The state's rows follow it."""
    index = torch.tensor(list(itertools.combinations_with_replacement(range(d), p)), dtype=torch.long)
    counts = torch.stack([(index == e).sum(-1) for e in range(d)], dim=-1)  # multiplicity of each coordinate
    weight = math.factorial(p) / torch.exp(torch.lgamma(counts.double() + 1).sum(-1))
    return index.view(-1, p), weight.round()


@functools.cache
def device_monomials(d: int, p: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """:func:`monomials` as the Triton kernels read them: ``index`` ``(p, D)`` int32, ``weight`` fp32, on ``device``."""
    index, weight = monomials(d, p)
    return index.t().contiguous().to(device, torch.int32), weight.to(device, torch.float32)


def features(x: Tensor, p: int, weighted: bool = False) -> Tensor:
    """``m(x)`` (``w m(x)`` if ``weighted``): ``(..., d) -> (..., D)``, for a few rows (decoding, tests)."""
    index, weight = monomials(x.shape[-1], p)
    out = x[..., index.to(x.device)].prod(-1)
    return out * weight.to(out) if weighted else out


def state_size(d: int, p: int) -> int:
    """Rows of the state: ``D`` (``d`` for p = 1)."""
    return monomial_count(d, p)


def fold(state: Tensor, count: Tensor, k: Tensor, v: Tensor, keep: Tensor, p: int) -> None:
    """``state (B, Hkv, D, dv) += sum_j keep_j w m(k_j) v_j^T``, ``count (B, Hkv) += sum keep``, in place;
    ``keep`` ``(B, N)``, 1 or 0 (left padding enters neither)."""
    batch, kv_heads, n, _ = k.shape
    dtype = state.dtype
    keep = keep.to(dtype)
    if state.device.type == "cpu" and load():
        k3, v3 = flatten_heads(k, dtype), flatten_heads(v, dtype)
        keep3 = keep[:, None].expand(batch, kv_heads, n).reshape(-1, n).contiguous()
        q3 = k3.new_empty(batch * kv_heads, 0, k.shape[-1])
        _, folded = torch.ops.polyattn_cpu.power_causal_forward(
            q3,
            k3,
            v3,
            keep3,
            q3.new_empty(q3.shape[:2]),
            p,
            1,
            n,
            chunk_size(k.shape[-1], p),
            state.view(-1, *state.shape[2:]),
            True,
        )
        state.copy_(folded.view_as(state))
    else:
        kept = keep[:, None, :, None]
        state += features(k.to(dtype) * kept, p, weighted=True).transpose(-2, -1) @ (v.to(dtype) * kept)
    count += keep.sum(-1, keepdim=True)


def step(q, k, v, keep, state: Tensor, count: Tensor, act, t: float) -> Tensor:
    """The next ``Q`` tokens of a causal model over a state: fold their keys (causally: token i sees the state and
    the new tokens up to i) and return their outputs ``(B, H, Q, dv)``; ``state``, ``count`` updated in place.

    ``q`` ``(B, H, Q, d)``, ``k``, ``v`` ``(B, Hkv, Q, d / dv)``, ``keep`` ``(B, Q)`` 1/0. One token on CPU is
    one pass over the state (``power_decode``); more (a prompt) the chunked causal kernel from the state.
    """
    batch, heads, rows, d = q.shape
    kv_heads, p = k.shape[1], power_of(act)
    dtype = state.dtype
    groups = heads // kv_heads
    if state.device.type == "cpu" and load():
        q3 = flatten_heads(q, dtype) * t
        k3, v3 = flatten_heads(k, dtype), flatten_heads(v, dtype)
        keep = keep.to(dtype)
        if rows == 1:
            code = LENGTH_SCALE_CODES.get(act.scale, 0)
            fixed = 1.0 if act.scale == "none" or code else float(act.scale)
            keep3 = keep.expand(batch, kv_heads).reshape(-1).contiguous()
            out = torch.ops.polyattn_cpu.power_decode(
                q3, k3, v3, keep3, state.view(-1, *state.shape[2:]), count.view(-1), p, groups, code, fixed
            )
        else:
            n = count[:, :1] + keep.cumsum(-1)  # (B, Q): the keys row i attends
            s = act.row_scale(n)[:, None].expand(batch, heads, rows).reshape(-1, rows).contiguous()
            keep3 = keep[:, None].expand(batch, kv_heads, rows).reshape(-1, rows).contiguous()
            out, folded = torch.ops.polyattn_cpu.power_causal_forward(
                q3, k3, v3, keep3, s, p, groups, 0, chunk_size(d, p), state.view(-1, *state.shape[2:]), True
            )
            state.copy_(folded.view_as(state))
            count += keep.sum(-1, keepdim=True)
        return out.view(batch, heads, rows, -1)
    return _step_torch(q, k, v, keep, state, count, act, t)


def _step_torch(q, k, v, keep, state, count, act, t) -> Tensor:
    """:func:`step` in PyTorch (any device): chunks of queries, each over the state and its own causal tile."""
    batch, heads, rows, d = q.shape
    kv_heads, p, dtype = k.shape[1], power_of(act), state.dtype
    groups, chunk = heads // kv_heads, chunk_size(d, p)
    kept = keep.to(dtype)[:, None, :, None]
    q = (q.to(dtype) * t).view(batch, kv_heads, groups, rows, d)
    k, v = k.to(dtype) * kept, v.to(dtype) * kept
    n = count[:, :1] + keep.to(dtype).cumsum(-1)
    outs = []
    for i0 in range(0, rows, chunk):
        qc, kc, vc = q[..., i0 : i0 + chunk, :], k[:, :, i0 : i0 + chunk], v[:, :, i0 : i0 + chunk]
        tile = (qc @ kc[:, :, None].transpose(-2, -1)).pow(p).tril()  # (B, Hkv, G, C, C): causal within
        folded = state + features(kc, p, weighted=True).transpose(-2, -1) @ vc
        out = features(qc, p) @ state[:, :, None] + tile @ vc[:, :, None]
        state.copy_(folded)
        outs.append(out)
    out = torch.cat(outs, dim=-2).view(batch, heads, rows, -1)
    count += keep.to(dtype).sum(-1, keepdim=True)
    return out * act.row_scale(n)[:, None, :, None]


# --------------------------------------------------------------------------- the backend


class Power(Backend):
    name = "power"
    supports = (
        "poly2-poly4, exact in linear time (memory O(N d + D dv)), key padding, causal, grouped-query heads; "
        "CPU (C++) and CUDA (Triton); no pairwise mask, score bias or dropout (they do not factor)"
    )
    grouped_heads = True

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = elementwise_reasons(inputs)
        power = power_of(inputs.act)
        if not reasons and power not in POWERS:
            reasons.append(
                f"activation {inputs.act.name!r} is not poly2-poly4 (the linear form of poly1 is 'associative')"
            )
        q = inputs.q
        if q.device.type == "cpu":
            if not load():
                reasons.append("the C++ kernels could not be built on this machine (see the warning above)")
        elif not q.is_cuda:
            reasons.append(f"q is on {q.device}; this kernel runs on CPU and CUDA tensors")
        else:
            from .triton import DTYPES, triton_available

            if not triton_available():
                reasons.append("the triton package is not installed (the CUDA form is a Triton kernel)")
            if q.dtype not in DTYPES:
                reasons.append(f"dtype {q.dtype} on CUDA (the Triton form takes float16, bfloat16 and float32)")
            if max(q.shape[-1], inputs.v.shape[-1]) > CUDA_MAX_HEAD_DIM:
                reasons.append(f"head dim > {CUDA_MAX_HEAD_DIM} on CUDA (the Triton form's tiles are sized up to it)")
        return reasons + key_padding_reasons(inputs, "power")

    def cost(self, inputs: KernelInputs) -> float | None:
        d, dv, p = inputs.q.shape[-1], inputs.v.shape[-1], power_of(inputs.act)
        return linear_cost(inputs, monomial_count(d, p) * dv, crossover_length(inputs, d, p))

    def forward(self, inputs: KernelInputs) -> Tensor:
        i = inputs
        return power_attention(i.q, i.k, i.v, i.act, i.t, i.allowed, i.n, i.causal)


BACKEND = Power()
