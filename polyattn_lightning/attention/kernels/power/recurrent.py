"""The recurrent form of ``poly{p}`` attention, p = 1..4: new tokens folded into a recurrent state
(:class:`~..base.state.RecurrentState`).

A causal model generating with it keeps, per kv head, ``S = sum_j w m(k_j) v_j^T`` and the number of keys folded in,
instead of every key and value: the next token's output is ``c(n) m(q t) S`` once its own key is folded in, O(D dv)
whatever the context. :func:`step` runs the next tokens from a state (causally: token i sees the state and the new
tokens up to i); :func:`fold` puts a prompt's keys into one. Both update the state in place: it holds the initial
state when they are called and the final state when they return.

On CPU the C++ kernels of ``csrc/power_cpu.cpp``: one token is one pass over the state (``power_decode``), more the
chunked causal kernel started from the state (``power_causal_forward``, the parallel form's sweep). Elsewhere (CUDA,
or no C++ build) :func:`chunked_step`, the same chunked sweep in PyTorch. ``associative`` runs this form for poly1
(``m(x) = x``: the C++ kernels take p = 1..4), as fla's ``linear_attn`` runs ``simple_gla``'s recurrence.
``naive.py`` is the plain reference both are tested against. :class:`RecurrentForm` is what the two backends with this
form (``associative``, ``power``) declare about it.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...dtypes import autocast_off
from ...registry import Activation
from ..base.contract import KV_STEP, PARALLEL, STATE_STEP, KernelInputs, StateStep
from ..base.cpp import load
from ..base.layout import flatten_heads, key_keep, per_row
from ..base.state import RecurrentState, features
from . import parallel

#: ``Activation.scale`` -> ``power_decode``'s ``length_scale`` (0: the fixed value).
LENGTH_SCALE_CODES = {"inv_sqrt_n": 1, "inv_n": 2}


def fold(state: RecurrentState, k: Tensor, v: Tensor, keep: Tensor | None = None) -> None:
    """``kv += sum_j keep_j w m(k_j) v_j^T``, ``count += sum keep`` over the keys ``k``, values ``v``
    ``(B, Hkv, N, d / dv)``; ``keep`` ``(B, N)`` 1/0 (left padding enters neither), None: every key."""
    batch, kv_heads, n, d = k.shape
    if 0 in (batch, kv_heads, n):  # no sequence, head or key: nothing to fold
        return
    dtype, p = state.kv.dtype, state.power
    keep = k.new_ones(batch, n, dtype=dtype) if keep is None else keep.to(dtype)
    if state.kv.device.type == "cpu" and load():
        k3, v3 = flatten_heads(k, dtype), flatten_heads(v, dtype)
        no_query = k3.new_empty(batch * kv_heads, 0, d)
        _, folded = torch.ops.polyattn_cpu.power_causal_forward(
            no_query,
            k3,
            v3,
            key_keep(keep[:, None, None], batch, kv_heads, n, dtype),
            no_query.new_empty(no_query.shape[:2]),
            p,
            1,
            n,
            parallel.chunk_size(d, p),
            state.kv.view(-1, *state.kv.shape[2:]),
            True,
        )
        state.kv.copy_(folded.view_as(state.kv))
    else:
        kept = keep[:, None, :, None]
        with autocast_off(k.device.type):
            state.kv += features(k.to(dtype) * kept, p, weighted=True).transpose(-2, -1) @ (v.to(dtype) * kept)
    state.count += keep.sum(-1, keepdim=True)


def step(
    q: Tensor, k: Tensor, v: Tensor, keep: Tensor | None, state: RecurrentState, act: Activation, t: float
) -> Tensor:
    """The outputs ``(B, H, Q, dv)`` of the next ``Q`` tokens (in ``v``'s dtype), their keys folded into ``state``.

    ``q`` ``(B, H, Q, d)``, ``k``, ``v`` ``(B, Hkv, Q, d / dv)``, ``keep`` ``(B, Q)`` 1/0 per new key or None (every
    key); query head ``h`` reads kv head ``h // (H / Hkv)``'s state.
    """
    kv, count = state.kv, state.count
    if 0 in q.shape[:3]:  # no sequence, head or new token: nothing to fold, nothing to read
        return v.new_zeros(*q.shape[:3], v.shape[-1])
    if not (kv.is_cpu and load()):
        return chunked_step(q, k, v, keep, state, act, t)
    batch, heads, rows, d = q.shape
    kv_heads, p, dtype = k.shape[1], state.power, kv.dtype
    q3 = flatten_heads(q, dtype) * t
    k3, v3 = flatten_heads(k, dtype), flatten_heads(v, dtype)
    keep = q3.new_ones(batch, rows) if keep is None else keep.to(dtype)
    if rows == 1:
        code = LENGTH_SCALE_CODES.get(act.scale, 0)
        fixed = 1.0 if act.scale == "none" or code else float(act.scale)
        keep3 = keep.expand(batch, kv_heads).reshape(-1).contiguous()
        out = torch.ops.polyattn_cpu.power_decode(
            q3, k3, v3, keep3, kv.view(-1, *kv.shape[2:]), count.view(-1), p, heads // kv_heads, code, fixed
        )
    else:
        n = count[:, :1] + keep.cumsum(-1)  # (B, Q): the keys row i attends
        s = per_row(act.row_scale(n)[:, None, :, None], batch, heads, rows, dtype)
        out, folded = torch.ops.polyattn_cpu.power_causal_forward(
            q3,
            k3,
            v3,
            key_keep(keep[:, None, None], batch, kv_heads, rows, dtype),
            s,
            p,
            heads // kv_heads,
            0,
            parallel.chunk_size(d, p),
            kv.view(-1, *kv.shape[2:]),
            True,
        )
        kv.copy_(folded.view_as(kv))
        count += keep.sum(-1, keepdim=True)
    return out.view(batch, heads, rows, -1).to(v.dtype)


def chunked_step(q, k, v, keep, state: RecurrentState, act: Activation, t: float) -> Tensor:
    """:func:`step` in PyTorch (any device): chunks of queries, each over the state and its own causal tile."""
    batch, heads, rows, d = q.shape
    kv_heads, p, dtype, out_dtype = k.shape[1], state.power, state.kv.dtype, v.dtype
    groups, chunk = heads // kv_heads, parallel.chunk_size(d, p)
    keep = q.new_ones(batch, rows, dtype=dtype) if keep is None else keep.to(dtype)
    kept = keep[:, None, :, None]
    outs = []
    with autocast_off(q.device.type):  # the products in the state's dtype (fp32), also under autocast
        q = (q.to(dtype) * t).view(batch, kv_heads, groups, rows, d)
        k, v = k.to(dtype) * kept, v.to(dtype) * kept
        n = state.count[:, :1] + keep.cumsum(-1)
        for i0 in range(0, rows, chunk):
            qc, kc, vc = q[..., i0 : i0 + chunk, :], k[:, :, i0 : i0 + chunk], v[:, :, i0 : i0 + chunk]
            tile = (qc @ kc[:, :, None].transpose(-2, -1)).pow(p).tril()  # (B, Hkv, G, C, C): causal within
            folded = state.kv + features(kc, p, weighted=True).transpose(-2, -1) @ vc
            out = features(qc, p) @ state.kv[:, :, None] + tile @ vc[:, :, None]
            state.kv.copy_(folded)
            outs.append(out)
        out = torch.cat(outs, dim=-2).view(batch, heads, rows, -1)
        state.count += keep.sum(-1, keepdim=True)
        return (out * act.row_scale(n)[:, None, :, None]).to(out_dtype)


class RecurrentForm:
    """The recurrent form as a backend declares it (``associative`` for poly1, ``power`` for poly2-poly4, with
    :class:`~..base.contract.Backend`): a step from a state runs :func:`step`, and ``auto`` leaves a KV-cache step to
    the quadratic kernels' one-call forms."""

    forms = frozenset({PARALLEL, STATE_STEP})

    def declined_reasons(self, inputs: KernelInputs) -> list[str]:
        if inputs.kind == KV_STEP:
            return [
                "a KV-cache step: the state of every cached key would be built again at each step (O(N D dv)); "
                "RecurrentCache keeps it and steps from it"
            ]
        return []

    def state_step(self, act: Activation) -> StateStep:
        return lambda q, k, v, keep, state, t: step(q, k, v, keep, state, act, t)


__all__ = ["LENGTH_SCALE_CODES", "RecurrentForm", "chunked_step", "fold", "step"]
