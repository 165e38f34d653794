"""Norm diagnostics of the attention map, for the callbacks that log them.

The polynomial-attention paper's argument: softmax works because it keeps
``||softmax(S)||_F <= sqrt(N)`` and its Jacobian's Frobenius norm bounded;
an activation scaled by ``1/sqrt(N)`` keeps both at ``O(sqrt(N))``. This module
measures the two norms per head:

* ``||phi(S)||_F`` over the ``Nq x Nk`` map;
* the Frobenius norm of ``d phi(S) / d S``. For an elementwise ``phi`` the
  Jacobian is diagonal, so this is ``||phi'(S)||_F``. For softmax each row has
  ``J = diag(p) - p p^T`` and ``||J||_F^2 = sum p^2 - 2 sum p^3 + (sum p^2)^2``;
  rows add.

Both are computed over blocks of query rows (never the whole ``N x N``), with
masked pairs contributing nothing, and averaged over the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from .functional import resolve_scores
from .masks import keys_per_row
from .registry import ActivationSpec

#: Elements of one ``(B, H, rows, Nk)`` score block.
BLOCK_ELEMENTS = 1 << 22


class AttentionNorms(NamedTuple):
    """Per-head norms, each ``(H,)``, averaged over the batch."""

    phi: Tensor
    jacobian: Tensor


@torch.no_grad()
def attention_norms(
    q: Tensor,
    k: Tensor,
    activation: ActivationSpec = "softmax",
    *,
    scale: float | str | None = None,
    temperature: float | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
) -> AttentionNorms:
    """``||phi(S)||_F`` and ``||d phi(S)/dS||_F`` per head, for the scores ``attention()`` would use."""
    act, t, masks = resolve_scores(q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias)
    allowed = masks.allowed
    n = keys_per_row(allowed, k.shape[-2], q.device)
    B, H, nq, _ = q.shape
    rows = max(1, BLOCK_ELEMENTS // (B * H * k.shape[-2]))
    phi_sq = torch.zeros(B, H, dtype=torch.float64, device=q.device)
    jac_sq = torch.zeros_like(phi_sq)
    with torch.autocast(q.device.type, enabled=False):
        q, k = q.float() * t, k.float()
        for start in range(0, nq, rows):
            block = slice(start, start + rows)
            s = q[:, :, block] @ k.transpose(-2, -1)
            for extra in (masks.additive, attn_bias):
                if extra is not None:
                    s = s + _rows(extra, block).float()
            keep = None if allowed is None else _rows(allowed, block)
            if act.is_softmax:
                p = _softmax(s, keep)
                p2 = p.square().sum(-1)
                phi_sq += p2.sum(-1)
                jac_sq += (p2 - 2 * p.pow(3).sum(-1) + p2.square()).sum(-1)
            else:
                counts = _rows(n, block)
                phi, grad = act(s, counts), act.derivative(s, counts)
                if keep is not None:
                    phi, grad = phi.masked_fill(~keep, 0.0), grad.masked_fill(~keep, 0.0)
                phi_sq += phi.square().sum((-2, -1))
                jac_sq += grad.square().sum((-2, -1))
    return AttentionNorms(phi_sq.sqrt().mean(0).float(), jac_sq.sqrt().mean(0).float())


def _rows(x: Tensor, block: slice) -> Tensor:
    """Query rows ``block`` of a tensor broadcastable along them (size-1 or absent row dims are kept)."""
    return x if x.dim() < 2 or x.shape[-2] == 1 else x[..., block, :]


def _softmax(s: Tensor, keep: Tensor | None) -> Tensor:
    """Softmax over keys; a row with no allowed key is all zeros."""
    if keep is None:
        return s.softmax(-1)
    return s.masked_fill(~keep, float("-inf")).softmax(-1).nan_to_num(0.0)
