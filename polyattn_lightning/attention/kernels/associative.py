"""``associative``: the exact linear-time form of ``poly1`` attention, ``c(n) * (q t) @ (k^T v)``.

With ``phi(S) = c * S`` the product ``(q k^T) v`` may be regrouped as
``q (k^T v)``: O(N d^2) instead of O(N^2 d), with no score matrix at all.
It applies when ``c`` is the same for every query of a batch row, i.e. with no
mask or a key-padding mask only (padded keys are zeroed, ``n`` counts the rest).

A custom autograd Function with the closed-form backward: on CPU the C++
kernel ``csrc/associative_cpu.cpp`` (one parallel region over heads, six BLAS
products per head in all), elsewhere four batched products in PyTorch.

Causal (query i attends keys ``j <= i + Nk - Nq``) stays exact and linear in
``N``: ``out_i = c(n_i) t q_i (sum_{j <= i + Nk - Nq} k_j^T v_j)`` with
``n_i`` the exact number of keys row i may attend. The keys no query lacks
(the first ``Nk - Nq``) form a starting state ``k^T v``; queries with no key
(the first ``Nq - Nk``) give zeros; the rest pair query and key one to one and
run in chunks of ``CAUSAL_CHUNK``: within a chunk a small lower-triangular
``C x C`` score block, across chunks the running sum of the earlier chunks'
``k^T v``. Time O(N (C d + d dv)). On CPU the C++ kernel sweeps each head's
chunks with a ``d x dv`` running state (and a reverse sweep for dK, dV), so
nothing but the tiles and the gradients is allocated; elsewhere the same
algebra as batched products over all chunks at once (memory O(N (C + d dv / C)))
that autograd differentiates.

A step from a recurrent state (``attention(..., state=...)``, generation with ``RecurrentCache``): the ``d x dv``
state ``sum_j k_j^T v_j`` is ``power``'s state with ``m(x) = x``, and poly1's step is ``power/recurrent.py``'s
(its C++ kernels take p = 1..4), as fla's ``linear_attn`` runs ``simple_gla``'s recurrence; tested with the others
against ``power/naive.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

import torch.nn.functional as F

from ..dtypes import autocast_off, compute_dtype
from .base.contract import Backend, KernelInputs, elementwise_reasons, key_padding_reasons, state_reasons
from .base.cpp import load
from .base.layout import flatten_heads, key_keep, per_row
from .power.recurrent import RecurrentForm

#: Queries per chunk of the causal form: the ``C x C`` block within a chunk costs O(N C d),
#: the prefix sums across chunks O(N d dv / C) memory.
CAUSAL_CHUNK = 64


class AssociativeAttention(torch.autograd.Function):
    """``out = q @ kv`` with ``kv = s * k^T v``, ``s = c(n) * t`` per head ``(B*H,)``; padded keys zeroed."""

    @staticmethod
    def forward(ctx, q, k, v, keep, s):
        shape4 = q.shape
        dtype = compute_dtype(q)
        with autocast_off(q.device.type):
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
        with autocast_off(grad_out.device.type):
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


def associative(q, k, v, act, t, allowed, n, causal=None) -> Tensor:
    """``q (k^T v)`` on resolved arguments; ``allowed`` is None or a key-padding mask ``(B?, 1, 1, Nk)``."""
    batch, heads, nk = q.shape[0], q.shape[1], k.shape[-2]
    dtype = compute_dtype(q)
    if causal is not None:
        row_scale = act.row_scale(n.to(dtype)) * t
        if q.device.type == "cpu" and load():
            return _causal_cpp(q, k, v, row_scale, allowed, causal)
        return causal_associative(q, k, v, row_scale, allowed, causal)
    # c(n) is the same for every query of a batch row (B?, 1, 1, 1), so it and t
    # scale the small (d, dv) matrix k^T v rather than an (N, d) one.
    s = per_row(act.row_scale(n.to(dtype)) * t, batch, heads, 1, dtype).view(batch * heads)
    keep = key_keep(allowed, batch, heads, nk, dtype)  # (B*H, Nk): 1 for a key, 0 for padding; None: no padding
    return AssociativeAttention.apply(q, k, v, keep, s)


def _zero_padded(x: Tensor, keep: Tensor | None) -> Tensor:
    """``x`` (B*H, Nk, d) with the rows of padded keys zeroed (selected, so an inf there gives no NaN)."""
    return x if keep is None else x.masked_fill(keep[..., None] == 0, 0.0)


def _in_cpp(q3: Tensor) -> bool:
    """Whether the C++ kernel takes this call: CPU tensors and a kernel that loads."""
    return q3.device.type == "cpu" and load()


def causal_associative(
    q: Tensor, k: Tensor, v: Tensor, row_scale: Tensor, allowed: Tensor | None, causal: int, chunk: int | None = None
) -> Tensor:
    """Causal poly1, exact: ``out_i = s_i q_i sum_{j <= i + causal} k_j^T v_j`` in linear time.

    ``row_scale`` broadcasts to ``(B, H, Nq, 1)`` (``c(n_i) t``); ``allowed`` is None or a
    key-padding mask ``(B?, 1, 1, Nk)``; ``causal`` is ``Nk - Nq``.
    """
    batch, heads, nq, _ = q.shape
    nk, dv = k.shape[-2], v.shape[-1]
    dtype, out_dtype = compute_dtype(q), v.dtype
    with autocast_off(q.device.type):
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if allowed is not None:  # padded keys and values zeroed (selected: an inf there gives no NaN)
            padded = ~allowed.expand(batch, heads, 1, nk).transpose(-2, -1)
            k, v = k.masked_fill(padded, 0.0), v.masked_fill(padded, 0.0)
        state = None
        if causal > 0:  # the first `causal` keys are seen by every query
            state = k[:, :, :causal].transpose(-2, -1) @ v[:, :, :causal]
            k, v = k[:, :, causal:], v[:, :, causal:]
        skipped = max(0, -causal)  # the first -causal queries see no key
        out = _aligned_causal(q[:, :, skipped:], k, v, state, chunk or CAUSAL_CHUNK)
        if skipped:
            out = torch.cat([out.new_zeros(batch, heads, skipped, dv), out], dim=2)
        return (out * row_scale.to(dtype)).to(out_dtype)


def _aligned_causal(q: Tensor, k: Tensor, v: Tensor, state: Tensor | None, chunk: int) -> Tensor:
    """``out_i = q_i (state + sum_{j <= i} k_j^T v_j)`` for as many queries as keys, chunk by chunk."""
    batch, heads, length, d = q.shape
    dv = v.shape[-1]
    chunks = -(-length // chunk)
    pad = chunks * chunk - length
    qc, kc, vc = (F.pad(x, (0, 0, 0, pad)).view(batch, heads, chunks, chunk, x.shape[-1]) for x in (q, k, v))
    above = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    within = (qc @ kc.transpose(-2, -1)).masked_fill(above, 0.0) @ vc  # (B, H, chunks, C, dv)
    kv = kc.transpose(-2, -1) @ vc  # (B, H, chunks, d, dv)
    before = F.pad(kv.cumsum(dim=2)[:, :, :-1], (0, 0, 0, 0, 1, 0))  # exclusive prefix sum over chunks
    if state is not None:
        before = before + state[:, :, None]
    out = within + qc @ before
    return out.view(batch, heads, chunks * chunk, dv)[:, :, :length]


class CausalAssociativeCPU(torch.autograd.Function):
    """Causal poly1 on the C++ sweep: ``(B*H, N, d)`` operands, ``s`` per row ``(B*H, Nq)``, ``keep`` ``(B*H, Nk)``."""

    @staticmethod
    def forward(ctx, q, k, v, keep, s, causal: int, chunk: int):
        dtype = compute_dtype(q)
        with autocast_off("cpu"):
            q3, k3, v3 = (flatten_heads(x, dtype) for x in (q, k, v))
            out = torch.ops.polyattn_cpu.associative_causal_forward(q3, k3, v3, keep, s, causal, chunk)
        ctx.save_for_backward(q3, k3, v3, keep, s)
        ctx.meta = (causal, chunk, q.dtype, k.dtype, v.dtype)
        return out.view(*q.shape[:3], -1).to(v.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        q3, k3, v3, keep, s = ctx.saved_tensors
        causal, chunk, *dtypes = ctx.meta
        with autocast_off("cpu"):
            g = (flatten_heads(grad_out, q3.dtype) * s[..., None]).contiguous()
            grads = torch.ops.polyattn_cpu.associative_causal_backward(q3, k3, v3, g, keep, causal, chunk)
        shapes = (*grad_out.shape[:2], -1)
        return (
            *(x.view(*shapes, x.shape[-1]).to(dtype) for x, dtype in zip(grads, dtypes)),
            None,
            None,
            None,
            None,
        )


def _causal_cpp(q, k, v, row_scale, allowed, causal) -> Tensor:
    batch, heads, nq, nk = *q.shape[:3], k.shape[-2]
    dtype = compute_dtype(q)
    s = per_row(row_scale, batch, heads, nq, dtype)
    keep = key_keep(allowed, batch, heads, nk, dtype)
    return CausalAssociativeCPU.apply(q, k, v, keep, s, causal, CAUSAL_CHUNK)


class Associative(RecurrentForm, Backend):
    name = "associative"
    supports = (
        "poly1 only, with key padding and causal, and a step from a recurrent state; no pairwise mask, score bias or "
        "dropout (they do not factor)"
    )

    def not_supported_reasons(self, inputs: KernelInputs) -> list[str]:
        reasons = elementwise_reasons(inputs)
        if not reasons and not inputs.act.associative:
            reasons.append(f"activation {inputs.act.name!r} is not linear (the associative form is poly1's)")
        if inputs.state is not None:
            reasons += state_reasons(inputs)
        return reasons + key_padding_reasons(inputs, "associative")

    def forward(self, inputs: KernelInputs) -> Tensor:
        i = inputs
        return associative(i.q, i.k, i.v, i.act, i.t, i.allowed, i.n, i.causal)


BACKEND = Associative()
