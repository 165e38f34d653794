"""Attention masks, normalised once so every kernel sees the same thing.

Conventions (those of PyTorch):

* ``key_padding_mask``: bool ``(B, Nk)``, True marks a padding key to ignore
  (as in ``nn.MultiheadAttention``).
* ``attn_mask``: broadcastable to ``(B, H, Nq, Nk)``; bool True marks a pair
  that may attend (as in ``scaled_dot_product_attention``), or float additive
  (0 keeps, a negative value such as Swin's -100 or -inf masks).

Softmax hands the additive mask to SDPA unchanged. Every other activation
turns it into a boolean "allowed" mask: a masked key must contribute exactly
nothing, and feeding -100 into ``x^3`` would not do that.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class Masks(NamedTuple):
    """``allowed``: bool broadcastable to (B, H, Nq, Nk), or None when every pair may attend.
    ``additive``: the float mask for softmax (None if none was given)."""

    allowed: Tensor | None
    additive: Tensor | None


def check_broadcast(name: str, mask: Tensor, target: tuple[int, ...]) -> None:
    """Raise unless ``mask`` broadcasts to ``target`` without enlarging it (a mask of batch 3 for B=1 would)."""
    try:
        fits = torch.broadcast_shapes(mask.shape, target) == torch.Size(target)
    except RuntimeError:
        fits = False
    if not fits:
        raise ValueError(f"{name} of shape {tuple(mask.shape)} does not broadcast to (B, H, Nq, Nk) = {target}")
    if mask.dim() > 4:
        raise ValueError(f"{name} must have at most 4 dimensions, got shape {tuple(mask.shape)}")


def normalize_masks(
    q: Tensor,
    k: Tensor,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    *,
    softmax: bool,
) -> Masks:
    """Check both masks against q/k and merge them into one ``Masks``."""
    B, H, Nq, _ = q.shape
    Nk = k.shape[-2]
    target = (B, H, Nq, Nk)
    allowed = additive = None
    if attn_mask is not None:
        check_broadcast("attn_mask", attn_mask, target)
        if attn_mask.dtype == torch.bool:
            allowed = attn_mask
        elif attn_mask.is_floating_point():
            # checked eagerly; torch.compile skips this data-dependent test rather than break the graph here
            if not softmax and not torch.compiler.is_compiling() and bool((attn_mask > 0).any()):
                raise ValueError(
                    "an additive attn_mask for a non-softmax activation must hold 0 (keep) or negative values "
                    "(mask); pass a score bias such as a relative-position bias as attn_bias instead"
                )
            additive = attn_mask
            allowed = attn_mask == 0 if not softmax else torch.isfinite(attn_mask)
        else:
            raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}")
        if tuple(key_padding_mask.shape) != (B, Nk):
            raise ValueError(f"key_padding_mask must have shape (B, Nk) = {(B, Nk)}, got {tuple(key_padding_mask.shape)}")
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
        if additive is not None:
            additive = additive.masked_fill(~keep, float("-inf"))
    if allowed is not None:
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
    return Masks(allowed, additive)


def keys_per_row(allowed: Tensor | None, num_keys: int, device: torch.device) -> Tensor:
    """N in the paper's scales: the number of keys each query may attend to, fp32.

    Shape broadcasts to (B, H, Nq, 1); a plain ``num_keys`` when nothing is masked.
    """
    if allowed is None:
        return torch.full((1, 1, 1, 1), float(num_keys), device=device)
    counts = allowed.sum(dim=-1, keepdim=True, dtype=torch.float32)
    if allowed.shape[-1] == 1:  # broadcast along keys: every key shares the verdict
        counts = counts * num_keys
    return counts
