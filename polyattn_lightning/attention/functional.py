"""``attention()``: the one public entry point; it picks the kernel.

Dispatch, in order:

1. ``softmax`` -> PyTorch's fused ``scaled_dot_product_attention``.
2. ``poly1`` with no pairwise mask, bias or dropout -> the exact associative
   form ``q @ (k^T v)``, O(N d^2) instead of O(N^2 d); causal too, as chunked
   prefix sums of ``k^T v`` (still linear time, exact).
3. A built-in elementwise activation -> a fused kernel (masks, score bias and
   in-kernel dropout included): Triton on CUDA, C++ on CPU. Where Triton cannot
   compile for the GPU, a warning names the error once and step 4 runs instead.
4. Anything elementwise -> the blocked PyTorch kernel (CPU and GPU).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from .masks import Masks, causal_mask, check_broadcast, keys_per_row, normalize_masks
from .registry import Activation, ActivationSpec, get_activation

KERNELS = ("auto", "sdpa", "associative", "triton", "fused_cpu", "blocked", "materialized")


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    activation: ActivationSpec = "softmax",
    *,
    scale: float | str | None = None,
    temperature: float | None = None,
    key_padding_mask: Tensor | None = None,
    attn_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    kernel: str = "auto",
) -> Tensor:
    """Attention with a registry activation: ``out = phi(S) @ v``, ``S = q k^T * t``.

    Args:
        q, k, v: ``(B, H, Nq, d)``, ``(B, H, Nk, d)``, ``(B, H, Nk, dv)``.
        activation: a registry name (``"poly3"``), a mapping ``{name, **options}`` or an ``Activation``.
        scale: overrides the activation's length scale ``c`` (``"inv_sqrt_n"``, ``"inv_n"``, ``"none"`` or a float).
        temperature: ``t``; defaults to ``d ** -0.5`` as timm applies it.
        key_padding_mask: bool ``(B, Nk)``, True = padding.
        attn_mask: bool (True = attend) or additive float (0 keep, negative mask), broadcastable to ``(B, H, Nq, Nk)``.
        attn_bias: an additive score bias (e.g. Swin's relative-position bias), added to ``S`` before ``phi``.
        dropout_p: dropout on ``phi(S)``; pass 0 in eval mode.
        is_causal: query ``i`` attends keys ``0 .. i + Nk - Nq`` only (bottom-right aligned, as a KV
            cache needs; keys ``0 .. i`` when ``Nq == Nk``; for ``Nq != Nk`` this differs from SDPA's
            top-left ``is_causal``). Combines with both masks; ``N`` is the number of keys a row may
            attend, so it grows along the sequence. The tiled kernels skip the tiles above the
            diagonal, and causal ``poly1`` stays linear-time and exact (``associative.py``).
        kernel: force one implementation (see ``KERNELS``); ``auto`` picks the fastest that applies.

    Non-softmax scores and activations are computed in fp32 (also under autocast);
    the output has the input dtype. A query with no attendable key gets a zero output.
    """
    _check_inputs(q, k, v, dropout_p, kernel)
    act, t, masks = resolve_scores(
        q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, is_causal=is_causal
    )
    if act.is_softmax:
        if kernel not in ("auto", "sdpa"):
            raise ValueError(f"softmax runs only on kernel 'sdpa', not {kernel!r}")
        return _sdpa(q, k, v, masks, attn_bias, t, dropout_p)

    n = keys_per_row(masks.allowed, k.shape[-2], q.device, masks.causal)
    if kernel == "auto":
        # ``allowed`` is a key-padding mask only when no attn_mask was merged into it
        key_padding_only = key_padding_mask if attn_mask is None else None
        kernel = _pick_kernel(q, act, masks.allowed, attn_bias, dropout_p, key_padding_only, masks.causal)
    from . import kernels  # late import: it loads the Triton and C++ kernel modules (triton takes seconds to import)

    return kernels.run(kernel, q, k, v, act, t, masks.allowed, attn_bias, n, dropout_p, causal=masks.causal)


class ScoreSpec(NamedTuple):
    """What turns ``q k^T`` into ``phi(S)``: the activation, the temperature and the normalised masks."""

    act: Activation
    t: float
    masks: Masks


def resolve_scores(
    q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, *, is_causal: bool = False
) -> ScoreSpec:
    """Resolve ``attention()``'s score arguments once, for it and for the diagnostics that mirror it."""
    act = get_activation(activation, scale=scale)
    t = q.shape[-1] ** -0.5 if temperature is None else float(temperature)
    masks = normalize_masks(q, k, key_padding_mask, attn_mask, softmax=act.is_softmax, is_causal=is_causal)
    if attn_bias is not None:
        check_broadcast("attn_bias", attn_bias, (*q.shape[:3], k.shape[-2]))
    return ScoreSpec(act, t, masks)


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}; expected one of {KERNELS}")
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, H, N, d); got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "shapes must be q (B, H, Nq, d), k (B, H, Nk, d), v (B, H, Nk, dv); "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _pick_kernel(q, act, allowed, attn_bias, dropout_p, key_padding_mask, causal: int | None = None) -> str:
    """``key_padding_mask`` is given only when ``allowed`` holds nothing else (no attn_mask);
    ``causal`` is the causal offset (``Masks.causal``) or None."""
    pairwise_mask = allowed is not None and key_padding_mask is None
    if act.associative and not pairwise_mask and attn_bias is None and dropout_p == 0.0:
        return "associative"  # causal too: chunked prefix sums, linear time
    from .fused_cpu import fused_cpu_supports
    from .triton_kernel import triton_compiles, triton_supports

    has_mask, has_bias, dropout = allowed is not None, attn_bias is not None, dropout_p > 0
    if triton_supports(q, act) and triton_compiles(q, act, has_mask, has_bias, dropout, causal is not None):
        return "triton"
    if fused_cpu_supports(q, act):  # with in-kernel dropout
        return "fused_cpu"
    return "blocked"


def _sdpa(q, k, v, masks, attn_bias, t, dropout_p) -> Tensor:
    """Softmax on SDPA; rows with no attendable key give zeros instead of NaN.

    A float mask or bias is cast to q's dtype: SDPA refuses one of another dtype (fp32 aside).
    Causal alone: SDPA's own ``is_causal`` for ``Nq == Nk`` (its fastest path), the lower-right
    ``CausalBias`` for ``Nq < Nk``; otherwise (``Nq > Nk``: rows with no key, or other masks)
    the causal mask is materialised into the boolean / additive mask.
    """
    nq, nk = q.shape[-2], k.shape[-2]
    if masks.causal is not None and masks.allowed is None and attn_bias is None and masks.causal >= 0:
        if masks.causal == 0:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=t)
        from torch.nn.attention.bias import causal_lower_right

        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(nq, nk), dropout_p=dropout_p, scale=t
        )
    if masks.causal is not None:
        tri = causal_mask(nq, nk, q.device)
        additive = None if masks.additive is None else masks.additive.masked_fill(~tri, float("-inf"))
        masks = Masks(tri if masks.allowed is None else masks.allowed & tri, additive)
    mask = masks.additive.to(q.dtype) if masks.additive is not None else masks.allowed
    if attn_bias is not None:
        bias = attn_bias.to(q.dtype)
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = bias.masked_fill(~mask, float("-inf"))
        else:
            mask = bias + mask
    empty = None
    if masks.allowed is not None:
        empty = ~masks.allowed.any(dim=-1, keepdim=True)
        # unmask empty rows so SDPA stays finite, then zero them; compiled: always, so no data-dependent branch
        if torch.compiler.is_compiling() or bool(empty.any()):
            mask = mask | empty if mask.dtype == torch.bool else mask.masked_fill(empty, 0.0)
        else:
            empty = None
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=t)
    return out.masked_fill(empty, 0.0) if empty is not None else out
