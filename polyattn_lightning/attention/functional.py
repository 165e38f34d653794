"""``attention()``: the one public entry point. It resolves the activation, temperature and masks once
(:func:`resolve_scores`) and hands them to a kernel backend (:mod:`~polyattn_lightning.attention.kernels`):
the one named by ``kernel=``, or the one ``auto`` picks (:func:`kernel_choice` says which and why).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from torch import Tensor

from .masks import Masks, check_broadcast, keys_per_row, normalize_masks
from .registry import Activation, ActivationSpec, get_activation

if TYPE_CHECKING:
    from .kernels import KernelChoice, KernelInputs


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
        q, k, v: ``(B, H, Nq, d)``, ``(B, Hkv, Nk, d)``, ``(B, Hkv, Nk, dv)``; ``Hkv`` divides ``H``
            (grouped-query attention: kv head ``h // (H / Hkv)`` serves query head ``h``).
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
        kernel: a backend's name (``polyattn_lightning.attention.KERNELS``), or ``auto``, which picks the fastest
            that applies (:func:`kernel_choice` says which and why).

    Non-softmax scores and activations are computed in fp32 (also under autocast);
    the output has the input dtype. A query with no attendable key gets a zero output.
    """
    _check_inputs(q, k, v, dropout_p)
    inputs = kernel_inputs(
        q, k, v, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, dropout_p, is_causal
    )
    from . import kernels

    return kernels.run(kernel, inputs)


#: The keywords of ``attention()`` that decide the kernel.
CHOICE_OPTIONS = ("scale", "temperature", "key_padding_mask", "attn_mask", "attn_bias", "dropout_p", "is_causal")


def kernel_choice(q: Tensor, k: Tensor, v: Tensor, activation: ActivationSpec = "softmax", **options) -> "KernelChoice":
    """Which kernel ``attention(q, k, v, activation, **options)`` runs with ``kernel="auto"``, and why each other
    one was passed over: ``print(kernel_choice(...))`` lists them. ``options`` are ``attention()``'s keywords."""
    unknown = sorted(set(options) - set(CHOICE_OPTIONS))
    if unknown:
        raise TypeError(f"kernel_choice() got unknown options {unknown}; expected attention()'s {CHOICE_OPTIONS}")
    _check_inputs(q, k, v, options.get("dropout_p", 0.0))
    from . import kernels

    return kernels.pick(
        kernel_inputs(
            q,
            k,
            v,
            activation,
            options.get("scale"),
            options.get("temperature"),
            options.get("key_padding_mask"),
            options.get("attn_mask"),
            options.get("attn_bias"),
            options.get("dropout_p", 0.0),
            options.get("is_causal", False),
        )
    )


def kernel_inputs(
    q, k, v, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, dropout_p, is_causal
) -> "KernelInputs":
    """``attention()``'s arguments as the kernels take them (:class:`~.kernels.base.KernelInputs`)."""
    from .kernels import KernelInputs  # on first use: importing the backends loads torch._dynamo (a second or so)

    act, t, masks = resolve_scores(
        q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, is_causal=is_causal
    )
    n = None if act.is_softmax else keys_per_row(masks.allowed, k.shape[-2], q.device, masks.causal)
    return KernelInputs(q, k, v, act, t, masks, attn_bias, n, float(dropout_p))


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


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be 4-D (B, H, N, d); got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    grouped = k.shape[1] == q.shape[1] or (k.shape[1] > 0 and q.shape[1] % k.shape[1] == 0)
    if q.shape[0] != k.shape[0] or not grouped or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            "shapes must be q (B, H, Nq, d), k (B, Hkv, Nk, d), v (B, Hkv, Nk, dv) with Hkv dividing H; "
            f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
