"""The ``AttentionInterface`` function: what every switched Hugging Face attention module calls.

transformers 5.x routes attention through ``AttentionInterface``: each attention module calls
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, dropout=, scaling=, **kwargs)``
and the model builds its mask with the ``AttentionMaskInterface`` function of the same name. :func:`register`
registers one attention function (:func:`polyattn_attention`) and one boolean mask function under
:data:`IMPLEMENTATION` (once per process; the registry is global). The activation is not global: it is read
from the module being called (``module.activation_spec``), so two models with different activations live in
one process.

What the function honours: HF's boolean masks ((B, 1, Q, KV), True = attend: padding, causal, sliding
window, chunked; causal and padding masks become ``is_causal`` and ``key_padding_mask``, see
:func:`~.masks.split_mask`), causality without a mask (``is_causal`` kwarg, else ``module.is_causal``, else
causal as HF's SDPA path assumes; only when more than one query row), grouped-query attention (the kv heads
go to ``attention()`` as they are: the linear ``power`` kernel builds one state per kv head, the others get
them repeated), ``scaling`` as the temperature, attention dropout (HF
passes 0 in eval), and the (B, L, H, D) output layout. A cached-generation step (a few query rows, no mask, no
gradient) takes :func:`decode_step`, two products without the general path's per-call overhead. What it
refuses, naming the module's class: ``softcap``, ``s_aux`` (attention sinks) and ``position_bias``, which a
non-softmax activation cannot take as they are meant. Keys returned by a :class:`~.cache.RecurrentCache` layer go
to that layer, which folds them into its state (``cache.py``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ....errors import ConfigError
from ...functional import attention
from ...kernels.materialized import materialized
from ...masks import causal_mask
from ...registry import Activation, ActivationSpec, get_activation
from ..base import AttentionInputs, Capture
from .masks import split_mask

#: The name the attention and mask functions are registered under (``config._attn_implementation``).
IMPLEMENTATION = "polyattn"
#: Keyword arguments of HF attention calls that a non-softmax activation cannot honour.
UNSUPPORTED_KWARGS = ("softcap", "s_aux", "position_bias")
#: Query rows up to which an unmasked, non-causal inference call takes :func:`decode_step` (a KV-cache step:
#: one row, which no causal mask restricts; a few unmasked rows of an encoder's short input).
DECODE_ROWS = 8
#: The attribute a ``RecurrentCache`` layer tags the keys its ``update`` returns with (``cache.py``).
CACHE_TAG = "_polyattn_cache_layer"


class Probe:
    """The probe in progress: the spec to attend with, how often each module called the function, and the
    ``capture`` every module gets meanwhile (None: none, the diagnostics' hooks are off during a probe)."""

    def __init__(self, spec: ActivationSpec, capture: Capture | None = None):
        self.spec = spec
        self.calls: dict[int, int] = {}
        self.capture = capture


_probe: Probe | None = None


@contextmanager
def probing(probe: Probe) -> Iterator[Probe]:
    """Route every polyattn call through ``probe`` meanwhile (one probe forward at a time)."""
    global _probe
    _probe = probe
    try:
        yield probe
    finally:
        _probe = None


def polyattn_attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """The ``AttentionInterface`` function: ``attention()`` with the activation of ``module``.

    q ``(B, H, Q, D)``, k/v ``(B, H_kv, KV, D)``; returns ``((B, Q, H, D), None)`` (no attention weights).
    """
    for name in UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ConfigError(
                f"{type(module).__name__} passes {name}= to its attention, which polyattn attention cannot honour "
                f"(supported: models whose attention takes q, k, v, a mask, dropout and scaling only)"
            )
    spec = _spec_of(module)
    q_len = query.shape[2]
    temperature = query.shape[-1] ** -0.5 if scaling is None else float(scaling)
    layer = cache_layer(key)
    if layer is not None:  # keys from a RecurrentCache: the layer folds them in where the mask is known
        args = (module, query, key, value, attention_mask, dropout, scaling, is_causal)
        regular = lambda: polyattn_attention(*args, **kwargs)[0]  # noqa: E731 (the path below, for a KV layer)
        return layer.attend(query, key, value, attention_mask, get_activation(spec), temperature, regular), None
    causal, masks = False, {}
    if attention_mask is None:
        causal = q_len > 1 and (is_causal if is_causal is not None else getattr(module, "is_causal", True))
        if (
            not causal
            and q_len <= DECODE_ROWS
            and not torch.is_grad_enabled()
            and not dropout
            and getattr(module, "capture", None) is None
            and _probe is None
        ):
            act = get_activation(spec)
            if not act.is_softmax:
                return decode_step(query, key, value, act, temperature), None
    capture = _probe.capture if _probe is not None else getattr(module, "capture", None)
    groups = query.shape[1] // key.shape[1]
    if groups > 1 and capture is not None:  # attention() takes grouped kv heads; the capture contract has q's
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    if attention_mask is None:
        if causal and key.shape[2] > q_len:
            # HF skips the mask only in a prefill of an empty static cache: the keys past q_len are empty slots
            key, value = key[:, :, :q_len], value[:, :, :q_len]
    else:
        causal, masks = split_mask(attention_mask)
    if capture is not None:  # the capture contract has no is_causal: it gets the causal mask written out
        seen = dict(masks, attn_mask=causal_mask(q_len, key.shape[2], query.device)) if causal else masks
        capture(module, AttentionInputs(query, key, value, temperature, **seen))
    out = attention(query, key, value, spec, temperature=temperature, dropout_p=dropout, is_causal=causal, **masks)
    return out.transpose(1, 2).contiguous(), None


def cache_layer(key: Tensor):
    """The ``RecurrentCache`` layer ``key`` came from, if that layer's ``update`` returned it just now."""
    layer = getattr(key, CACHE_TAG, None)
    return layer if layer is not None and layer.pending is key else None


def decode_step(query: Tensor, key: Tensor, value: Tensor, act: Activation, temperature: float) -> Tensor:
    """A cached-generation step: a few query rows attending every key of the cache, no mask, no gradient.

    The materialized kernel on the small ``(rows x cache)`` scores, grouped-query heads side by side on their kv
    head (broadcast, so the cache is not repeated). The general path's checks, mask handling and kernel layout
    cost several times these products at this size (BENCHMARKS.md). Returns HF's ``(B, Q, H, D)`` layout. Only
    taken without a mask and without causality (one query row is never causal-masked), so every row attends all
    ``Nk`` keys: ``N = Nk``.
    """
    batch, heads, rows, dim = query.shape
    kv_heads, num_keys = key.shape[1], key.shape[2]
    grouped = query.reshape(batch, kv_heads, (heads // kv_heads) * rows, dim)
    keys = torch.full((1, 1, 1, 1), float(num_keys), device=query.device)
    out = materialized(grouped, key, value, act, temperature, None, None, keys, 0.0)
    return out.view(batch, heads, rows, -1).transpose(1, 2).contiguous()


def _spec_of(module: nn.Module) -> ActivationSpec:
    if _probe is not None:
        _probe.calls[id(module)] = _probe.calls.get(id(module), 0) + 1
        return _probe.spec
    spec = getattr(module, "activation_spec", None)
    if spec is None:
        raise ConfigError(
            f"{type(module).__name__} attends through attn_implementation={IMPLEMENTATION!r} but was not switched by "
            "polyattn_lightning's set_attention(model, activation); call it on the model"
        )
    return spec


def register() -> None:
    if AttentionInterface._global_mapping.get(IMPLEMENTATION) is not polyattn_attention:
        AttentionInterface.register(IMPLEMENTATION, polyattn_attention)
        # HF's boolean (B, 1, Q, KV) mask, True = attend; None where SDPA could rely on is_causal or no mask
        AttentionMaskInterface.register(IMPLEMENTATION, sdpa_mask)
