"""``SwitchedAttention``: the mixin of every switched attention module, and the ``capture`` contract.

The contract itself is documented in :mod:`~polyattn_lightning.attention.timm_patch`; this module holds
the pieces every switch (the generic SDPA one, the hand-written adapters) and our own models share.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from .functional import attention
from .masks import causal_mask, keys_per_row, normalize_masks
from .registry import Activation, ActivationSpec, describe, get_activation


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
    """Mixin of every switched timm attention class: the activation and ``capture`` they share.

    Never instantiated: ``set_attention`` assigns a subclass to an existing
    module's ``__class__`` and then sets ``activation_spec`` and ``capture``.
    """

    activation_spec: ActivationSpec
    capture: Capture | None

    @property
    def activation(self) -> Activation:
        return get_activation(self.activation_spec)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, temperature: float, *, dropout_p: float | None = None,
        is_causal: bool = False, **masks: Tensor | None,
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


#: timm attention class -> its switched subclass; filled by ``@_adapts``.
_ADAPTERS: dict[type[nn.Module], type[SwitchedAttention]] = {}


def _adapts(timm_class: type[nn.Module]):
    """Register the decorated ``SwitchedAttention`` subclass as the switch for ``timm_class`` (exactly
    that class: a timm subclass may have another forward, so it is not switched by inheritance)."""

    def add(cls: type[SwitchedAttention]) -> type[SwitchedAttention]:
        assert issubclass(cls, timm_class) and issubclass(cls, SwitchedAttention), cls
        _ADAPTERS[timm_class] = cls
        return cls

    return add
