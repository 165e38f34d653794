"""``attention()``: the one public entry point, for training and decoding alike. It resolves the activation,
temperature and masks once (:func:`resolve_scores`) and hands them to a kernel backend
(:mod:`~polyattn_lightning.attention.kernels`): the one named by ``kernel=``, or the one ``auto`` picks
(:func:`kernel_choice` says which and why).

Decoding goes through the same door. A KV-cache step (a few query rows, no mask, no gradient) is a kind of call the
backends declare a form for; a step from a recurrent state is ``attention(..., state=...)`` with a state from
:func:`recurrent_state`. ``auto``'s choice for a step is kept by the kernels per activation, device, dtype and kind,
so a generation step is a lookup and one call (``kernels.dispatch.decoding_step``).
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from .masks import Masks, check_broadcast, keys_per_row, normalize_masks
from .registry import Activation, ActivationSpec, get_activation

if TYPE_CHECKING:
    from .kernels import KernelChoice, KernelInputs
    from .kernels.base.state import RecurrentState

#: Where the kept decoding steps live; consulted only once the kernels are imported (before, none is kept).
_DISPATCH = "polyattn_lightning.attention.kernels.dispatch"


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
    state: RecurrentState | None = None,
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
        state: decode from a recurrent state (:func:`recurrent_state`; poly1-poly4): ``k``, ``v`` are the new tokens,
            one per query row, folded into ``state`` in place; query ``i`` attends the state's keys and the new keys up
            to ``i`` (``is_causal=True`` for more than one row). Takes a ``key_padding_mask`` over the new keys (they
            enter neither the state nor ``N``), no ``attn_mask``, bias or dropout.
        kernel: a backend's name (``polyattn_lightning.attention.KERNELS``), or ``auto``, which picks the fastest
            that applies (:func:`kernel_choice` says which and why).

    Non-softmax scores and activations are computed in fp32 (also under autocast);
    the output has the input dtype. A query with no attendable key gets a zero output.

    Example:
        x^3 attention over 2 sequences of 16 tokens, 4 heads of 32 channels, against the formula written out
        (scores scaled by 1/sqrt(d), cubed, then scaled by 1/sqrt(N)):

        >>> import torch
        >>> from polyattn_lightning.attention import attention
        >>> _ = torch.manual_seed(0)
        >>> q, k, v = torch.randn(3, 2, 4, 16, 32).unbind(0)
        >>> out = attention(q, k, v, "poly3")
        >>> out.shape
        torch.Size([2, 4, 16, 32])
        >>> scores = q @ k.transpose(-2, -1) / 32**0.5
        >>> torch.allclose(out, scores**3 / 16**0.5 @ v, rtol=1e-4, atol=1e-4)
        True
    """
    _check_inputs(q, k, v, dropout_p)
    if kernel == "auto" and scale is None and attn_mask is None and attn_bias is None and not dropout_p:
        dispatch = sys.modules.get(_DISPATCH)  # None until the kernels are imported: no step is kept before
        if dispatch is not None:
            out = dispatch.decoding_step(q, k, v, activation, temperature, key_padding_mask, is_causal, state)
            if out is not None:
                return out
    inputs = kernel_inputs(
        q, k, v, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, dropout_p, is_causal, state
    )
    from . import kernels

    return kernels.run(kernel, inputs)


#: The keywords of ``attention()`` that decide the kernel.
CHOICE_OPTIONS = (
    "scale",
    "temperature",
    "key_padding_mask",
    "attn_mask",
    "attn_bias",
    "dropout_p",
    "is_causal",
    "state",
)


def kernel_choice(q: Tensor, k: Tensor, v: Tensor, activation: ActivationSpec = "softmax", **options) -> "KernelChoice":
    """Which kernel ``attention(q, k, v, activation, **options)`` runs with ``kernel="auto"``, and why each other
    one was passed over: ``print(kernel_choice(...))`` lists them. ``options`` are ``attention()``'s keywords.

    Example:
        >>> import torch
        >>> from polyattn_lightning import kernel_choice
        >>> q, k, v = torch.randn(3, 1, 2, 64, 32).unbind(0)
        >>> choice = kernel_choice(q, k, v, "poly3")
        >>> choice.passed_over["sdpa"]
        ["activation 'poly3' is not softmax (SDPA computes softmax only)"]
        >>> print(choice)  # doctest: +ELLIPSIS
        auto picks '...'
          sdpa: activation 'poly3' is not softmax (SDPA computes softmax only)
        ...
    """
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
            options.get("state"),
        )
    )


def kernel_inputs(
    q, k, v, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, dropout_p, is_causal, state=None
) -> "KernelInputs":
    """``attention()``'s arguments as the kernels take them (:class:`~.kernels.base.KernelInputs`)."""
    from .kernels import KernelInputs  # on first use: importing the backends loads torch._dynamo (a second or so)
    from .kernels.base.state import RecurrentState

    if state is not None and not isinstance(state, RecurrentState):
        raise TypeError(
            f"state must be a RecurrentState (polyattn_lightning.attention.recurrent_state(k, v, activation)), got "
            f"{type(state).__name__}"
        )
    act, t, masks = resolve_scores(
        q, k, activation, scale, temperature, key_padding_mask, attn_mask, attn_bias, is_causal=is_causal
    )
    counted = act.is_softmax or state is not None  # a step from a state counts the state's keys itself
    n = None if counted else keys_per_row(masks.allowed, k.shape[-2], q.device, masks.causal)
    return KernelInputs(q, k, v, act, t, masks, attn_bias, n, float(dropout_p), state)


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


def recurrent_state(
    k: Tensor, v: Tensor, activation: ActivationSpec, *, key_padding_mask: Tensor | None = None
) -> RecurrentState:
    """A recurrent state holding the keys ``k`` and values ``v`` ``(B, Hkv, N, d / dv)`` of a causal layer with
    ``activation`` (poly1-poly4), the padded keys (``key_padding_mask`` ``(B, N)``, True = padding) left out: what
    ``attention(..., state=...)`` steps from. ``N`` may be 0: an empty state. fp32 (fp64 for fp64 keys)."""
    from .kernels.base.state import RECURRENT_POWERS, RecurrentState, power_of
    from .kernels.power.recurrent import fold

    act = get_activation(activation)
    p = power_of(act)
    if p not in RECURRENT_POWERS or act.shift is not None:
        raise ValueError(f"activation {act.name!r} has no recurrent state (poly1-poly4 have one)")
    if k.dim() != 4 or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k, v must be (B, Hkv, N, d) and (B, Hkv, N, dv); got {tuple(k.shape)}, {tuple(v.shape)}")
    padding = key_padding_mask
    if padding is not None and (padding.dtype != torch.bool or tuple(padding.shape) != (k.shape[0], k.shape[2])):
        raise ValueError(
            f"key_padding_mask must be bool (B, N) = {(k.shape[0], k.shape[2])}, True = padding; got {padding.dtype} "
            f"{tuple(padding.shape)}"
        )
    state = RecurrentState.empty(k.shape[0], k.shape[1], k.shape[-1], v.shape[-1], p, k)
    with torch.no_grad():
        fold(state, k, v, None if padding is None else ~padding)
    return state


def decode_crossover(device: torch.device, d: int, activation: ActivationSpec) -> float:
    """The context length from which a step from a recurrent state beats a KV-cache step on ``device`` for head dim
    ``d`` (the crossover table's ``decode`` rows; ``python -m polyattn_lightning.bench decode --write``); ``inf``
    for an activation without a recurrent state or a device without a row."""
    from .kernels.base.costs import decode_crossover as measured

    return measured(device, d, get_activation(activation))


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, dropout_p: float) -> None:
    qs, ks, vs = q.shape, k.shape, v.shape  # read once: every decoding step passes here
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise ValueError(f"q, k, v must be 4-D (B, H, N, d); got shapes {tuple(qs)}, {tuple(ks)}, {tuple(vs)}")
    batch, heads, _, dim = qs
    kv_batch, kv_heads, keys, kv_dim = ks
    grouped = kv_heads == heads or (kv_heads > 0 and heads % kv_heads == 0)
    if kv_batch != batch or not grouped or dim != kv_dim or vs[0] != batch or vs[1] != kv_heads or vs[2] != keys:
        raise ValueError(
            "shapes must be q (B, H, Nq, d), k (B, Hkv, Nk, d), v (B, Hkv, Nk, dv) with Hkv dividing H; "
            f"got {tuple(qs)}, {tuple(ks)}, {tuple(vs)}"
        )
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
