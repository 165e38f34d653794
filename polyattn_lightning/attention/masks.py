"""Attention masks, normalised once so every kernel sees the same thing.

Conventions (those of PyTorch):

* ``key_padding_mask``: bool ``(B, Nk)``, True marks a padding key to ignore
  (as in ``nn.MultiheadAttention``).
* ``attn_mask``: broadcastable to ``(B, H, Nq, Nk)``; bool True marks a pair
  that may attend (as in ``scaled_dot_product_attention``), or float additive
  (0 keeps, a negative value such as Swin's -100 or -inf masks).

* ``is_causal``: query ``i`` attends keys ``0 .. i + Nk - Nq`` (bottom-right
  aligned, as a KV cache needs: the last query sees every key; keys ``0 .. i``
  when ``Nq == Nk``). It is kept as that diagonal offset ``Nk - Nq``
  (``Masks.causal``), never as an ``Nq x Nk`` tensor: the kernels skip the
  tiles above the diagonal and mask only the tiles it crosses.

Softmax hands the additive mask to SDPA unchanged. Every other activation
turns it into a boolean "allowed" mask: a masked key must contribute exactly
nothing, and feeding -100 into ``x^3`` would not do that.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor


class Masks(NamedTuple):
    """``allowed``: bool broadcastable to (B, H, Nq, Nk), or None when every pair may attend.
    ``additive``: the float mask for softmax (None if none was given).
    ``causal``: the causal diagonal offset ``Nk - Nq`` (query i attends keys j <= i + causal),
    None when not causal; it is not merged into ``allowed``."""

    allowed: Tensor | None
    additive: Tensor | None
    causal: int | None = None


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
    is_causal: bool = False,
) -> Masks:
    """Check both masks against q/k and merge them into one ``Masks`` (causality as an offset only)."""
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
            raise ValueError(
                f"key_padding_mask must have shape (B, Nk) = {(B, Nk)}, got {tuple(key_padding_mask.shape)}"
            )
        keep = ~key_padding_mask[:, None, None, :]
        allowed = keep if allowed is None else allowed & keep
        if additive is not None:
            additive = additive.masked_fill(~keep, float("-inf"))
    if allowed is not None:
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)
    return Masks(allowed, additive, Nk - Nq if is_causal else None)


def split_sentinels(mask: Tensor) -> tuple[Tensor, Tensor]:
    """A float mask that may carry a score bias as ``(allowed, bias)``: its ``-inf`` and ``finfo.min`` entries mask
    (by equality: nothing finite lies below ``finfo.min``, and ``finfo.min`` plus a bias of any size below
    ~1e31 rounds back to it), every other entry is a score bias added to ``S`` (masked entries' bias 0).

    For masks whose builder adds a relative-position bias to a padding mask (Hugging Face's BEiT, a float
    ``attn_mask`` of ``nn.MultiheadAttention``): a finite entry is never read as "masked", whatever its sign.
    """
    masked = mask <= torch.finfo(mask.dtype).min
    return ~masked, mask.masked_fill(masked, 0.0)


def causal_mask(num_queries: int, num_keys: int, device: torch.device) -> Tensor:
    """The bottom-right causal mask, bool ``(Nq, Nk)``, True where query i may attend key j <= i + Nk - Nq.

    Materialised only where a dense mask is needed anyway (softmax with another mask, the
    materialized kernel, the diagnostics); the tiled kernels never build it.
    """
    return torch.ones(num_queries, num_keys, dtype=torch.bool, device=device).tril(num_keys - num_queries)


def with_causal(
    allowed: Tensor | None, causal: int | None, num_queries: int, num_keys: int, device: torch.device
) -> Tensor | None:
    """``allowed`` and the causal mask in one dense bool mask (``allowed`` itself when not causal)."""
    if causal is None:
        return allowed
    tri = causal_mask(num_queries, num_keys, device)
    return tri if allowed is None else allowed & tri


def keys_per_row(allowed: Tensor | None, num_keys: int, device: torch.device, causal: int | None = None) -> Tensor:
    """N in the paper's scales: the number of keys each query may attend to, fp32.

    Shape broadcasts to (B, H, Nq, 1); a plain ``num_keys`` when nothing is masked.
    With ``causal`` (the offset ``Nk - Nq``) N grows along the sequence: ``i + 1 + causal``
    keys for query i, clamped to ``[0, Nk]``, less the padded ones among them (a
    cumulative count of a key-only mask; no ``Nq x Nk`` tensor unless ``allowed`` is pairwise).
    """
    if causal is not None:
        return _causal_keys_per_row(allowed, num_keys, device, causal)
    if allowed is None:
        # num_keys as it is: a symbolic count (torch.export, dynamic sequence) stays symbolic, float() would fix it
        return torch.full((1, 1, 1, 1), num_keys, dtype=torch.float32, device=device)
    counts = allowed.sum(dim=-1, keepdim=True, dtype=torch.float32)
    if allowed.shape[-1] == 1:  # broadcast along keys: every key shares the verdict
        counts = counts * num_keys
    return counts


def _causal_keys_per_row(allowed: Tensor | None, num_keys: int, device: torch.device, causal: int) -> Tensor:
    num_queries = num_keys - causal
    reach = (torch.arange(num_queries, device=device) + (causal + 1)).clamp_(0, num_keys)  # keys 0 .. reach - 1
    if allowed is None:
        return reach.to(torch.float32).view(1, 1, num_queries, 1)
    if allowed.shape[-1] == 1:  # the same verdict for every key of a row
        return allowed.to(torch.float32) * reach.to(torch.float32).view(num_queries, 1)
    if allowed.shape[-2] == 1:  # key-only (padding): allowed keys among the first reach[i]
        before = F.pad(allowed[..., 0, :].cumsum(-1, dtype=torch.float32), (1, 0))  # (..., Nk + 1)
        return before[..., reach].unsqueeze(-1)
    return (allowed & causal_mask(num_queries, num_keys, device)).sum(dim=-1, keepdim=True, dtype=torch.float32)
