"""Switch the attention of a timm vision transformer to a registry activation, in place.

``set_attention(model, "poly3")`` finds every attention module timm built and
swaps its class for a subclass whose ``forward`` is timm's own, step for step,
except that the softmax goes through :func:`~polyattn_lightning.attention.attention`.
Swapping the class (rather than wrapping the module) keeps every parameter
where it was, so the state_dict keys are timm's and a timm checkpoint loads
before or after the switch. Calling it again re-switches (``softmax`` runs on
SDPA, so switching back to softmax gives timm's outputs).

Supported (timm 1.0.x; each forward follows the 1.0.31 source):

* ``timm.layers.Attention``: ViT, DeiT (``q_norm``/``k_norm``, ``attn_mask``,
  ``is_causal``, gate and scale norm as timm has them);
* Swin ``WindowAttention``: the relative-position bias is a score bias added
  before ``phi``; the 0/-100 shifted-window mask becomes "masked pairs count
  for nothing" for a non-softmax activation;
* XCiT ``XCA``: attention over the ``d x d`` channel map (so ``N`` in the
  length scale is the head dim); the learnable temperature is folded into q;
* CaiT ``ClassAttn`` (XCiT's class-attention blocks): the class token queries all tokens.

Any other module with timm's ``fused_attn`` flag (its mark on attention that
can run on SDPA) is an attention this file cannot switch; ``set_attention``
refuses the model rather than leave softmax in some layers. Attention timm
never runs on SDPA has no such flag: CaiT's ``TalkingHeadAttn`` is listed in
``_UNSWITCHABLE`` so CaiT is refused too; others would go unnoticed.

To add a family: subclass its timm class with :class:`SwitchedAttention`, write
``forward`` calling ``self._attend`` and decorate it with ``@_adapts(TimmClass)``.

Diagnostics: each switched module has ``activation`` (the resolved
:class:`~polyattn_lightning.attention.Activation`; the module stores the spec
it was given, ``activation_spec``, so that it still pickles) and ``capture``,
None by default. When set, ``capture(module, inputs)`` is called on every forward with
the :class:`AttentionInputs` about to be attended; :func:`attention_map` turns
them into the ``phi(S)`` map. The tensors are live (not detached): detach or
reduce them in the hook.

The ``capture`` contract, which every diagnostic (the norm and map callbacks,
``polyattn maps``, the spline check) relies on, so that a new model needs
nothing of its own:

* an attention layer is an instance of :class:`SwitchedAttention` (timm modules
  through ``set_attention``; a model of ours subclasses it, sets
  ``activation_spec``, ``capture = None`` and ``attn_drop``, and attends through
  ``_attend`` or calls ``capture`` itself just before ``attention()``);
  :func:`attention_modules` lists them in ``named_modules`` order, which must be
  forward order: layer ``i`` of the diagnostics is the ``i``-th (1-based);
* ``capture(module, AttentionInputs(q, k, v, temperature, attn_mask, attn_bias, key_padding_mask))``
  gets exactly what ``attention()`` is given (shapes and mask conventions of
  ``attention()``: bool masks are True = attend; the key axis is -2 of k), so
  ``attention_map(inputs, module.activation) @ v`` is the layer's output;
* it may be called several times in one forward (a two-tower model runs a layer
  twice); it must not change the tensors;
* the token layout is read from shapes: keys ``(B, H, Nk, d)`` with ``Nk`` a few
  prefix tokens plus a patch grid of the image's aspect ratio (ViT/DeiT, class
  attention, detection backbones), ``B * windows`` rows for Swin windows, token
  sequences for text; XCiT's :class:`XCiTAttention` attends over channels.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple

import torch
from timm.layers import Attention
from timm.models.cait import ClassAttn, TalkingHeadAttn
from timm.models.swin_transformer import WindowAttention
from timm.models.xcit import XCA
from torch import Tensor, nn

from .functional import attention
from .masks import keys_per_row, normalize_masks
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

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, temperature: float, **masks: Tensor | None) -> Tensor:
        """The step that was softmax; ``masks`` are ``attn_mask``/``attn_bias``/``key_padding_mask`` as
        ``attention()`` takes them (padding as ``key_padding_mask`` keeps poly1's linear-time form and the
        fused kernels' padding skip, which a dense ``attn_mask`` would cost)."""
        if self.capture is not None:
            self.capture(self, AttentionInputs(q, k, v, temperature, **masks))
        dropout_p = self.attn_drop.p if self.training else 0.0
        return attention(q, k, v, self.activation_spec, temperature=temperature, dropout_p=dropout_p, **masks)

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


# --------------------------------------------------------------------------- the families


@_adapts(Attention)
class ViTAttention(SwitchedAttention, Attention):
    """ViT / DeiT self-attention (``timm.layers.Attention``)."""

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        B, N, _ = x.shape
        gate = self.gate(x).sigmoid() if self.gate is not None else None
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if is_causal:  # as in timm, a causal mask takes the place of attn_mask
            attn_mask = torch.ones(N, N, dtype=torch.bool, device=x.device).tril()
        x = self._attend(q, k, v, self.scale, attn_mask=attn_mask)
        x = self.norm(x.transpose(1, 2).reshape(B, N, self.attn_dim))
        if gate is not None:
            x = x * gate
        return self.proj_drop(self.proj(x))


@_adapts(WindowAttention)
class SwinWindowAttention(SwitchedAttention, WindowAttention):
    """Swin (shifted) window attention: relative-position bias as ``attn_bias``, window mask as ``attn_mask``."""

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """x: ``(B * num_windows, N, C)``; mask: 0/-100 ``(num_windows, N, N)`` or None."""
        B_, N, _ = x.shape
        q, k, v = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4).unbind(0)
        if mask is not None:  # windows are batch-major: row b * num_windows + w uses mask[w]
            mask = mask.repeat(B_ // mask.shape[0], 1, 1).unsqueeze(1)
        x = self._attend(q, k, v, self.scale, attn_mask=mask, attn_bias=self._get_rel_pos_bias())
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B_, N, -1)))


@_adapts(XCA)
class XCiTAttention(SwitchedAttention, XCA):
    """XCiT cross-covariance attention: the ``d x d`` channel map, L2-normalised q, k and a learned temperature.

    The per-head temperature multiplies q (as timm's fused path does) and
    ``attention()`` gets ``temperature=1``, so the parameter keeps its gradient.
    """

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        # (B, heads, channels per head, N): the channels are the "tokens" attended over
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, C // self.num_heads).permute(2, 0, 3, 4, 1)
        q, k, v = qkv.unbind(0)
        q = nn.functional.normalize(q, dim=-1) * self.temperature
        k = nn.functional.normalize(k, dim=-1)
        x = self._attend(q, k, v, 1.0)
        return self.proj_drop(self.proj(x.permute(0, 3, 1, 2).reshape(B, N, C)))


@_adapts(ClassAttn)
class ClassAttention(SwitchedAttention, ClassAttn):
    """CaiT class attention (also XCiT's class-attention blocks): only the class token queries."""

    def forward(self, x: Tensor) -> Tensor:
        B, N, C = x.shape
        heads = (self.num_heads, C // self.num_heads)
        q = self.q(x[:, :1]).reshape(B, 1, *heads).transpose(1, 2)
        k = self.k(x).reshape(B, N, *heads).transpose(1, 2)
        v = self.v(x).reshape(B, N, *heads).transpose(1, 2)
        x_cls = self._attend(q, k, v, self.scale)
        return self.proj_drop(self.proj(x_cls.transpose(1, 2).reshape(B, 1, C)))


# --------------------------------------------------------------------------- public API


#: Softmax attention without the ``fused_attn`` flag that set_attention must still refuse.
_UNSWITCHABLE = (TalkingHeadAttn,)


def _adapter_for(module: nn.Module) -> type[SwitchedAttention] | None:
    if isinstance(module, SwitchedAttention):
        return type(module)
    return _ADAPTERS.get(type(module))


def set_attention(model: nn.Module, activation: ActivationSpec) -> int:
    """Switch every supported timm attention in ``model`` to ``activation``; returns how many were switched.

    Raises ValueError, changing nothing, if the model has no supported attention
    or has an attention module it cannot switch (see the module docstring).
    """
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)  # the caller's dict may change later
    found, unsupported = [], []
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is not None:
            found.append((module, adapter))
        elif hasattr(module, "fused_attn") or isinstance(module, _UNSWITCHABLE):
            unsupported.append(f"{name} ({type(module).__name__})")
    model_name = type(model).__name__
    supported = f"supported timm classes: {', '.join(sorted(c.__name__ for c in _ADAPTERS))}"
    if unsupported:
        raise ValueError(
            f"{model_name} has attention modules set_attention cannot switch: {', '.join(unsupported)}; {supported}"
        )
    if not found:
        raise ValueError(f"{model_name} has no attention module set_attention can switch; {supported}")
    for module, adapter in found:
        if type(module) is not adapter:
            module.__class__ = adapter
            module.capture = None
        module.activation_spec = activation
    return len(found)


def attention_modules(model: nn.Module) -> list[tuple[str, SwitchedAttention]]:
    """``(name, module)`` for every switched attention module, in ``named_modules`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SwitchedAttention)]


__all__ = ["AttentionInputs", "SwitchedAttention", "attention_map", "attention_modules", "set_attention"]

from . import timm_adapters  # noqa: E402,F401  registers the explicit adapters of the hand-computed families
