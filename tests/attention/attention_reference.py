"""The plain-PyTorch reference every attention kernel is checked against (imported by the tests).

Written out formula by formula from the issue, independently of the registry:
``S = q k^T / sqrt(d) + bias``; masked pairs are dropped; ``n`` counts the
keys a query may attend to.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FORMULAS = {
    "poly1": lambda s, n: s / n.sqrt(),
    "poly2": lambda s, n: s**2 / n.sqrt(),
    "poly3": lambda s, n: s**3 / n.sqrt(),
    "relu": lambda s, n: torch.relu(s) / n,
    "softplus": lambda s, n: F.softplus(s) / n,
    "sigmoid": lambda s, n: torch.sigmoid(s - n.log()),
}
ELEMENTWISE = sorted(FORMULAS)


def reference_attention(q, k, v, name, keep=None, bias=None):
    """``phi(S) @ v`` with the whole score matrix; ``keep`` is a bool mask broadcastable to (B, H, Nq, Nk)."""
    s = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if bias is not None:
        s = s + bias
    if keep is None:
        keep = torch.ones(s.shape, dtype=torch.bool)
    keep = keep.expand(s.shape)
    n = keep.sum(-1, keepdim=True).clamp_min(1).to(s.dtype)
    return (FORMULAS[name](s, n) * keep) @ v


def make_qkv(B=2, H=3, Nq=9, Nk=11, d=4, dv=5, dtype=torch.float64, seed=0):
    """Random ``q, k, v`` that require grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]

