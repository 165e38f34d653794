"""``SwitchedAttention``: the mixin of every switched attention module, and the ``capture`` contract.

Every switch (timm's generic SDPA one and its adapters, Hugging Face's interface function) and our own models
(the LRA encoder) give their attention modules this mixin, so the diagnostics need nothing per model.

Each switched module has ``activation_spec`` (the spec it was given, so that it pickles), ``activation`` (the
resolved :class:`~polyattn_lightning.attention.Activation`), ``capture`` (None by default) and ``map_layout``
(a class attribute: ``"tokens"``; ``"channels"`` for attention over a head's channels, XCiT's ``XCA``,
DaViT's and EdgeNeXt's; ``"shifted_windows"`` for Swin's windows, rows ``B * windows``).

The ``capture`` contract, which every diagnostic (the norm and map callbacks, ``polyattn maps``, the spline
check) relies on:

* an attention layer is an instance of :class:`SwitchedAttention` (library modules through ``set_attention``;
  a model of ours subclasses it, sets ``activation_spec``, ``capture = None`` and ``attn_drop``, and attends
  through ``_attend`` or calls ``capture`` itself just before ``attention()``); :func:`attention_modules`
  lists them in ``named_modules`` order, which must be forward order: layer ``i`` of the diagnostics is the
  ``i``-th (1-based);
* ``capture(module, AttentionInputs(q, k, v, temperature, attn_mask, attn_bias, key_padding_mask))`` gets
  exactly what ``attention()`` is given (its shapes and mask conventions: bool masks are True = attend; the key
  axis is -2 of k; causality written out as a bool mask), so ``attention_map(inputs, module.activation) @ v``
  is the layer's output;
* it may be called several times in one forward (a two-tower model runs a layer twice); it must not change
  the tensors, which are live (not detached): detach or reduce them in the hook;
* the token layout is read from shapes and ``map_layout``: keys ``(B, H, Nk, d)`` with ``Nk`` a few prefix
  tokens plus a patch grid of the image's aspect ratio (ViT/DeiT, class attention, detection backbones),
  ``B * windows`` rows for windowed attention, token sequences for text.

A library class gets its switch with :func:`register_adapter`: the smallest subclass of it and of
:class:`SwitchedAttention` whose ``forward`` keeps the library's steps and calls ``self._attend`` where the
softmax was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from ..functional import attention
from ..masks import causal_mask, keys_per_row, normalize_masks
from ..registry import Activation, ActivationSpec, describe, get_activation


class AttentionInputs(NamedTuple):
    """What a switched module attends: ``out = phi(q k^T * temperature + attn_bias) @ v``.

    Shapes are those given to ``attention()``: q ``(B, H, Nq, d)``, k ``(B, H, Nk, d)``,
    v ``(B, H, Nk, dv)``; ``attn_mask`` and ``attn_bias`` broadcast to ``(B, H, Nq, Nk)``;
    ``key_padding_mask`` is bool ``(B, Nk)``, True = padding (padded sequences, e.g. LRA's).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    temperature: float
    attn_mask: Tensor | None = None
    attn_bias: Tensor | None = None
    key_padding_mask: Tensor | None = None


#: A ``capture`` hook: a switched module calls it with itself and what it attends just before ``attention()``.
Capture = Callable[[nn.Module, AttentionInputs], None]


def attention_map(inputs: AttentionInputs, activation: ActivationSpec) -> Tensor:
    """``phi(S)``, fp32 ``(B, H, Nq, Nk)``, with masked pairs at zero: ``attention_map(...) @ v`` is the output.

    Materialises the full map: meant for diagnostics on a few samples, not for training.
    """
    act = get_activation(activation)
    q, k = inputs.q.float(), inputs.k.float()
    masks = normalize_masks(q, k, inputs.key_padding_mask, inputs.attn_mask, softmax=act.is_softmax)
    scores = q @ k.transpose(-2, -1) * inputs.temperature
    if inputs.attn_bias is not None:
        scores = scores + inputs.attn_bias.float()
    if act.is_softmax and masks.additive is not None:
        scores = scores + masks.additive.float()
    elif act.is_softmax and masks.allowed is not None:
        scores = scores.masked_fill(~masks.allowed, float("-inf"))
    weights = act(scores, keys_per_row(masks.allowed, k.shape[-2], q.device))
    return weights if masks.allowed is None else weights.masked_fill(~masks.allowed, 0.0)


class SwitchedAttention(nn.Module):
    """Mixin of every switched attention class: the activation, ``capture`` and ``map_layout`` they share.

    Never instantiated: ``set_attention`` assigns a subclass to an existing
    module's ``__class__`` and then sets ``activation_spec`` and ``capture``.
    """

    activation_spec: ActivationSpec
    capture: Capture | None
    #: How the diagnostics read the map: ``"tokens"``, ``"channels"`` or ``"shifted_windows"`` (module docstring).
    map_layout: str = "tokens"
    #: Which of the projections' ``[q; k; v]`` blocks ``attention()`` gets as query, key and value (DaViT's channel
    #: attention: ``"kvq"``); the conversions edit only ``"qkv"`` modules.
    qkv_roles: str = "qkv"

    @property
    def activation(self) -> Activation:
        return get_activation(self.activation_spec)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        temperature: float,
        *,
        dropout_p: float | None = None,
        is_causal: bool = False,
        **masks: Tensor | None,
    ) -> Tensor:
        """The step that was softmax; ``masks`` are ``attn_mask``/``attn_bias``/``key_padding_mask`` and
        ``is_causal`` is bottom-right, as ``attention()`` takes them (padding as ``key_padding_mask`` keeps
        poly1's linear-time form and the fused kernels' padding skip, which a dense ``attn_mask`` would cost;
        ``is_causal`` their skip of the tiles above the diagonal). ``dropout_p`` defaults to the module's
        ``attn_drop`` in training mode (the generic switch passes what timm gave SDPA)."""
        if self.capture is not None:
            seen = masks
            if is_causal:  # the contract has no is_causal: the capture sees the causal (bool) mask written out
                causal = causal_mask(q.shape[-2], k.shape[-2], q.device)
                seen = {**masks, "attn_mask": causal if masks.get("attn_mask") is None else masks["attn_mask"] & causal}
            self.capture(self, AttentionInputs(q, k, v, temperature, **seen))
        if dropout_p is None:
            dropout_p = self.attn_drop.p if self.training else 0.0
        return attention(
            q, k, v, self.activation_spec, temperature=temperature, dropout_p=dropout_p, is_causal=is_causal, **masks
        )

    def extra_repr(self) -> str:
        return f"activation={describe(self.activation)}"


#: Library attention class -> its switched subclass; filled by :func:`register_adapter`.
ADAPTERS: dict[type[nn.Module], type[SwitchedAttention]] = {}


def register_adapter(library_class: type[nn.Module], registry: dict | None = None):
    """Register the decorated ``SwitchedAttention`` subclass as the switch for ``library_class`` (exactly that
    class: a subclass of it may have another forward, so it is not switched by inheritance), in ``registry``
    (:data:`ADAPTERS`, the timm door's, by default; the Hugging Face door keeps its own)::

        @register_adapter(timm.models.tnt.Attention)
        class TNTAttention(SwitchedAttention, timm.models.tnt.Attention):
            def forward(self, x): ...  # timm's steps, with self._attend(q, k, v, self.scale) for the softmax
    """

    def add(cls: type[SwitchedAttention]) -> type[SwitchedAttention]:
        if not (issubclass(cls, library_class) and issubclass(cls, SwitchedAttention)):
            raise TypeError(f"{cls.__qualname__} must subclass SwitchedAttention and {library_class.__qualname__}")
        (ADAPTERS if registry is None else registry)[library_class] = cls
        return cls

    return add


def attention_modules(model: nn.Module) -> list[tuple[str, SwitchedAttention]]:
    """``(name, module)`` for every switched attention module, in ``named_modules`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SwitchedAttention)]
