"""How the kernels lay their operands out: heads flattened into the batch, masks and biases as 4-D, per-row and
per-key numbers as contiguous ``(B*H, N)`` rows.

The C++ and tiled kernels take ``q``, ``k``, ``v`` as contiguous ``(B*H, N, d)`` in the compute dtype
(:func:`flatten_heads`) and hand gradients back in the callers' ``(B, H, N, d)`` and dtypes
(:func:`unflatten_heads`); a key-padding mask becomes one 1/0 number per key (:func:`key_keep`), a per-row scale one
number per query row (:func:`per_row`).
"""

from __future__ import annotations

import torch
from torch import Tensor


def as_4d(x: Tensor) -> Tensor:
    """Left-pad a broadcastable mask or bias to 4 dimensions."""
    return x.reshape((1,) * (4 - x.dim()) + tuple(x.shape))


def flatten_heads(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``(B, H, N, d)`` -> contiguous ``(B*H, N, d)`` in the compute dtype."""
    return x.to(dtype).reshape(x.shape[0] * x.shape[1], x.shape[-2], x.shape[-1]).contiguous()


def unflatten_heads(batch: int, grads, dtypes) -> list[Tensor]:
    """``(B*H, N, d)`` gradients back to ``(B, H, N, d)``, each in its input's dtype."""
    return [g.view(batch, -1, *g.shape[1:]).to(dtype) for g, dtype in zip(grads, dtypes)]


def per_row(x: Tensor, batch: int, heads: int, rows: int, dtype: torch.dtype) -> Tensor:
    """A per-row number broadcastable to ``(B, H, Nq, 1)`` (``c(n)``, ``c(n) t``) as a contiguous ``(B*H, Nq)``."""
    return x.to(dtype).expand(batch, heads, rows, 1).reshape(batch * heads, rows).contiguous()


def key_keep(allowed: Tensor | None, batch: int, heads: int, nk: int, dtype: torch.dtype) -> Tensor | None:
    """A key-padding ``allowed`` ``(B?, 1, 1, Nk)`` as 1/0 per key, a contiguous ``(B*H, Nk)`` in ``dtype``; None:
    none."""
    if allowed is None:
        return None
    return allowed.to(dtype).expand(batch, heads, 1, nk).reshape(batch * heads, nk).contiguous()
