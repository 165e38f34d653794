"""Plain PyTorch references of the ``poly{p}`` forms, p = 1..4, written from the formula: what the parallel and
recurrent forms are tested against, and the shortest statement of what they compute. Slow (the whole score matrix;
one token at a time), in the inputs' dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...registry import Activation
from ..base.state import RecurrentState, features, power_of


def parallel(q: Tensor, k: Tensor, v: Tensor, act: Activation, t: float, keep=None, causal: bool = False) -> Tensor:
    """``out_i = c(n_i) sum_j a_ij (q_i . k_j t)^p v_j`` with the whole score matrix: ``a_ij`` 1 where query i may
    attend key j (``keep`` ``(B, Nk)`` 1/0 or None; causal: ``j <= i + Nk - Nq``), ``n_i = sum_j a_ij``; k, v
    repeated to q's heads."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    nq, nk = q.shape[-2], k.shape[-2]
    allowed = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(nk - nq)
    allowed = allowed.expand(q.shape[0], 1, nq, nk)
    if keep is not None:
        allowed = allowed & keep.bool()[:, None, None, :]
    n = allowed.sum(-1, keepdim=True).to(q.dtype)
    return act.row_scale(n) * (((q @ k.transpose(-2, -1)) * t) ** power_of(act) * allowed) @ v


def recurrent(
    q: Tensor, k: Tensor, v: Tensor, keep, state: RecurrentState, act: Activation, t: float
) -> tuple[Tensor, RecurrentState]:
    """One new token at a time: fold key j into the state (``S += keep_j w m(k_j) v_j^T``, ``n += keep_j``), then
    ``out_j = c(n) m(q_j t) S`` for each query head from its kv head's state. Returns the outputs ``(B, H, Q, dv)``
    and the final state (a new one: ``state`` is left as it was)."""
    kv, count, p = state.kv.clone(), state.count.clone(), state.power
    groups, dtype = q.shape[1] // k.shape[1], kv.dtype
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    outs = []
    for j in range(q.shape[-2]):
        kept = kv.new_ones(q.shape[0]) if keep is None else keep[:, j].to(dtype)
        added = features(k[:, :, j], p, weighted=True)[..., :, None] * v[:, :, j, None, :]  # (B, Hkv, D, dv)
        kv = kv + kept[:, None, None, None] * added
        count = count + kept[:, None]
        read = features(q[:, :, j] * t, p)[:, :, None, :] @ kv.repeat_interleave(groups, 1)  # (B, H, 1, dv)
        outs.append(act.row_scale(count.repeat_interleave(groups, 1))[..., None, None] * read)
    return torch.cat(outs, dim=-2), RecurrentState(kv, count, p)


__all__ = ["parallel", "recurrent"]
