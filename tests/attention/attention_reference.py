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


def bottom_right(nq: int, nk: int) -> torch.Tensor:
    """The causal mask, bool (Nq, Nk): key j allowed for query i iff j <= i + Nk - Nq (bottom-right aligned)."""
    i = torch.arange(nq)[:, None]
    j = torch.arange(nk)[None, :]
    return j - i <= nk - nq


def causal_reference(q, k, v, name, keep=None, bias=None):
    """``reference_attention`` under the dense causal mask (and ``keep``, if given)."""
    mask = bottom_right(q.shape[-2], k.shape[-2])
    return reference_attention(q, k, v, name, keep=mask if keep is None else keep & mask, bias=bias)


def make_qkv(B=2, H=3, Nq=9, Nk=11, d=4, dv=5, dtype=torch.float64, seed=0):
    """Random ``q, k, v`` that require grad."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(B, H, Nq, d), (B, H, Nk, d), (B, H, Nk, dv)]
    return [torch.randn(s, generator=g, dtype=dtype).requires_grad_() for s in shapes]


def philox_keep(seed: int, bh: int, nq: int, nk: int, p: float) -> torch.Tensor:
    """The documented dropout scheme, written out in numpy: pair (i, j) of head bh is kept iff word j % 4 of
    Philox4x32-10(key = seed's low/high 32 bits, counter = (j // 4, i, bh, 0)) >= floor(p * 2**32)."""
    import numpy as np

    low = np.uint64(0xFFFFFFFF)
    i, j = np.meshgrid(np.arange(nq, dtype=np.uint64), np.arange(nk, dtype=np.uint64), indexing="ij")
    c = [j // np.uint64(4), i, np.full_like(i, bh), np.zeros_like(i)]
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & low, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & low]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & low, (k1 + np.uint64(0xBB67AE85)) & low
    words = np.choose((j % np.uint64(4)).astype(np.int64), c)
    return torch.from_numpy(words >= min(int(p * 2**32), 2**32 - 1))
