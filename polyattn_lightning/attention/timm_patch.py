"""Switch the attention of a timm model to a registry activation, in place: ``set_attention(model, "poly3")``.

Each attention module timm built gets its class swapped for a subclass whose ``forward`` is timm's
own except that the softmax goes through :func:`~polyattn_lightning.attention.attention`. Swapping the
class (rather than wrapping the module) keeps every parameter where it was, so the state_dict keys
are timm's and a timm checkpoint loads before or after the switch. Calling it again re-switches
(``softmax`` runs on SDPA, so switching back to softmax gives timm's outputs).

Three kinds of switch (the README's support table, measured by ``timm_support``, lists per timm model
module what switches):

* the generic one (:mod:`~polyattn_lightning.attention.timm_sdpa`): classes that run on SDPA, on a
  reviewed list (class, timm versions, mask kinds); timm's forward runs with SDPA rebound in its
  globals, so RoPE, q/k norms, biases and layouts stay timm's -- ViT/DeiT, EVA, BEiT, MaxViT, CaiT
  and XCiT class attention, XCiT's XCA, PVT v2, Twins, DaViT windows, Hiera, SAM, TinyViT...;
* hand-written adapters, where timm's SDPA call or softmax needs more than that: Swin's
  ``WindowAttention`` here (its 0/-100 shift mask is added to the position bias, and ``x^3`` would
  not zero a -100), and one module per timm family in ``attention/timm_adapters/`` for classes that
  compute softmax by hand;
* refusals: attention that is not softmax over dot products of tokens (split attention, additive,
  factorised, outlook, linear attention) is named and left alone; attention pooling heads
  (``AttentionPoolLatent``...) stay softmax by decision and are named in a log line.

A model counts as switched only on evidence: after switching, ``set_attention`` runs a probe forward
(one random image at the size the model was built for) under a ``TorchFunctionMode`` that records
every softmax and SDPA call (:mod:`~polyattn_lightning.attention.timm_probe`); any call outside a
switched module, any module with timm's ``fused_attn`` flag (its mark on SDPA attention) but no
switch, and any module of a class the tables below name (``HAND_SOFTMAX``: hand-computed softmax
with no adapter; ``NOT_TOKEN_ATTENTION``) refuses the model with each module's path, class
(``timm.models.beit.Attention``) and reason, and nothing is changed. ``strict=False`` (YAML:
``model.init_args.attention_strict: false``) switches what can be switched and logs one line naming
what stays softmax.

To add a family:

1. timm calls SDPA for it (with ``fused_attn`` on) and does no other softmax: read its ``forward``,
   note what it passes as ``attn_mask`` (nothing, a bool mask, a float bias, ``-inf``/``finfo.min``
   sentinels -- never a finite sentinel mixed with a bias) and add a ``Reviewed(cls, masks)`` line to
   ``timm_sdpa.REVIEWED``; add its tiny constructor to ``tests/attention/timm_families.py``.
2. timm computes softmax by hand: write the smallest subclass of the timm class with
   :class:`SwitchedAttention` whose ``forward`` keeps timm's steps and calls ``self._attend`` where
   the softmax was, decorate it with ``@_adapts(TimmClass)``, put it in ``timm_adapters/<family>.py``
   and take the class off ``HAND_SOFTMAX``.
3. Regenerate the support table: ``python -m polyattn_lightning.attention.timm_support --write README.md``.

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
  attention, detection backbones), ``B * windows`` rows for Swin windows and
  MaxViT's windows and grids, token sequences for text; the channel attentions
  (XCiT's ``XCA``, DaViT's and EdgeNeXt's) attend over channels: ``Nk`` is a
  head's channels (``callbacks.attention_maps.CHANNEL_ATTENTION`` names them).
"""
from __future__ import annotations

import importlib
import logging
import pkgutil
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import timm.layers.attention2d as attention2d
import timm.layers.attention_pool as attention_pool
import timm.layers.attention_pool2d as attention_pool2d
import timm.layers.global_context as global_context
import timm.layers.lambda_layer as lambda_layer
import timm.layers.non_local_attn as non_local_attn
import timm.layers.other_pool as other_pool
import timm.layers.selective_kernel as selective_kernel
import timm.layers.split_attn as split_attn
import timm.models.coat as coat
import timm.models.efficientvim as efficientvim
import timm.models.efficientvit_mit as efficientvit_mit
import timm.models.mobilevit as mobilevit
import timm.models.mvitv2 as mvitv2
import timm.models.swiftformer as swiftformer
import timm.models.volo as volo
from timm.models.cait import ClassAttn
from timm.models.swin_transformer import WindowAttention
from timm.models.xcit import XCA
from torch import Tensor, nn

from ..errors import ConfigError
from . import timm_adapters
from .registry import ActivationSpec, get_activation
from .switched import _ADAPTERS, AttentionInputs, Capture, SwitchedAttention, _adapts, attention_map
from .timm_probe import SoftmaxCall, image_probe, softmax_calls
from .timm_sdpa import GENERIC

log = logging.getLogger(__name__)

# --------------------------------------------------------------------------- hand-written adapters

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


#: The generic switches of XCiT's channel attention and of CaiT/XCiT class attention, by name: the attention-map
#: callback tells the channel maps apart by class.
XCiTAttention = GENERIC[XCA]
ClassAttention = GENERIC[ClassAttn]


def _load_adapters() -> None:
    """Import every module of ``timm_adapters`` so its ``@_adapts`` classes are registered."""
    for info in pkgutil.iter_modules(timm_adapters.__path__):
        importlib.import_module(f"{timm_adapters.__name__}.{info.name}")


# --------------------------------------------------------------------------- what is not switched

#: Softmax that is not attention over tokens (dot products of queries and keys): never switched.
NOT_TOKEN_ATTENTION: dict[type[nn.Module], str] = {
    split_attn.SplitAttn: "split attention (softmax over the radix groups of channels), not attention over tokens",
    selective_kernel.SelectiveKernelAttn: "selective-kernel attention (softmax over kernel branches), not attention over tokens",
    swiftformer.EfficientAdditiveAttention: "additive attention (one learned global query), not dot-product attention",
    coat.FactorAttnConvRelPosEnc: "factorised attention (softmax over keys, then k^T v), not a dot-product map",
    volo.OutlookAttention: "outlook attention (weights made by a linear layer, no q k^T); VOLO's class attention is another class",
    efficientvit_mit.LiteMLA: "LiteMLA is already linear (ReLU) attention; it has no softmax to switch",
    mobilevit.LinearSelfAttention: "MobileViTv2's separable linear attention (softmax over one context vector), not q k^T",
    lambda_layer.LambdaLayer: "lambda layer (softmax over keys, then k^T v), not a dot-product map",
    global_context.GlobalContext: "global-context pooling (softmax over positions of one learned score)",
    efficientvim.HSMSSD: "hidden-state mixer of a state-space model, not attention",
    efficientvim.EfficientViM: "the head's softmax over learned fusion weights, not attention",
}

#: Attention pooling heads: they stay softmax by decision (named in the log line, never a refusal).
POOLING_HEADS: tuple[type[nn.Module], ...] = (
    attention_pool.AttentionPoolLatent, attention_pool.AttentionPoolPrr,
    attention_pool2d.AttentionPool2d, attention_pool2d.RotAttentionPool2d,
    other_pool.SimPool1d, other_pool.SimPool2d,
)

#: timm classes that compute softmax attention by hand and have no adapter in ``timm_adapters`` (its package
#: docstring says why): refused by class, so also where no probe forward runs. A class that gets an adapter
#: leaves this list (``tests/attention/test_timm_refusals.py`` checks that none is on both).
HAND_SOFTMAX: tuple[type[nn.Module], ...] = (
    mvitv2.MultiScaleAttentionPoolFirst, non_local_attn.NonLocalAttn, attention2d.MultiQueryAttentionV2,
)


def class_name(cls: type) -> str:
    """``timm.models.beit.Attention``: the class with its module, as refusals name it."""
    return f"{cls.__module__}.{cls.__qualname__}"


@dataclass(frozen=True)
class Unswitched:
    """A module that keeps softmax: where, what, why, and whether that is by decision (a pooling head)."""

    path: str
    cls: type[nn.Module]
    reason: str
    by_decision: bool = False

    def __str__(self) -> str:
        return f"{self.path or '<model>'} ({class_name(self.cls)}): {self.reason}"


def _static_verdict(module: nn.Module) -> tuple[str, bool] | None:
    """Why ``module`` keeps softmax, read from its class alone (None: nothing known against it)."""
    cls = type(module)
    if cls in NOT_TOKEN_ATTENTION:
        return NOT_TOKEN_ATTENTION[cls], False
    if isinstance(module, POOLING_HEADS):
        return "attention pooling head: stays softmax by decision", True
    if cls in HAND_SOFTMAX:
        return "computes softmax by hand; no adapter in attention/timm_adapters yet", False
    if hasattr(module, "fused_attn"):
        return "runs softmax attention (timm's fused_attn flag) but is not on the reviewed list (timm_sdpa.REVIEWED)", False
    return None


def _probe_verdict(call: SoftmaxCall) -> Unswitched:
    """The innermost module of a leftover softmax call that a table explains, else the module that made it."""
    for path, module in reversed(call.stack):
        verdict = _static_verdict(module)
        if verdict is not None and not isinstance(module, SwitchedAttention):
            return Unswitched(path, type(module), *verdict)
    path, module = call.stack[-1] if call.stack else ("", None)
    where = "calls SDPA" if call.function == "scaled_dot_product_attention" else f"calls {call.function}"
    if isinstance(module, SwitchedAttention) and getattr(module, "keeps_softmax", None):
        return Unswitched(path, type(module), module.keeps_softmax, by_decision=True)  # e.g. ConViT's GPSA
    if isinstance(module, SwitchedAttention):
        reason = f"is switched but still {where} in the probe forward (an adapter misses a step)"
    else:
        reason = f"{where} in the probe forward and has no switch"
    return Unswitched(path, type(module) if module is not None else nn.Module, reason)


# --------------------------------------------------------------------------- public API


def _adapter_for(module: nn.Module) -> type[SwitchedAttention] | None:
    if isinstance(module, SwitchedAttention):
        return type(module)
    return _ADAPTERS.get(type(module))


#: What probes a switched model: a non-softmax activation, so every softmax call left is outside a switch.
_PROBE_ACTIVATION = "relu"

Probe = Callable[[], object]


class AttentionRefused(ConfigError):
    """set_attention refused a model (nothing changed): ``unswitched`` says which modules keep softmax and why."""

    def __init__(self, message: str, unswitched: list[Unswitched]):
        super().__init__(message)
        self.unswitched = unswitched


def set_attention(
    model: nn.Module, activation: ActivationSpec, *, strict: bool = True, probe: Probe | Mapping | bool | None = None,
    calibrate: bool = False,
) -> int:
    """Switch every attention of ``model`` that has a switch to ``activation``; returns how many were switched.

    Args:
        model: a timm model, a part of one (a block, one attention module) or a module holding switched ones;
            or a Hugging Face ``transformers`` ``PreTrainedModel`` (switched by
            :func:`polyattn_lightning.attention.hf.set_attention`, with the same arguments).
        activation: a registry activation (``"poly3"``, ``{name: poly3, scale: 0.0714}``...); ``softmax`` too.
        strict: refuse (:class:`AttentionRefused`, a ``ConfigError``; nothing changed) when any module would
            keep softmax, attention pooling heads aside; False switches the rest and logs one line naming what
            stays softmax. With nothing to switch it always refuses. An HF model is always switched whole.
        probe: the forward that shows what still computes softmax after the switch (a callable running one
            forward of ``model``); None makes one at the image size the model was built for
            (:func:`image_probe`), skipped where it keeps none (a bare block: then only the class tables
            count); False skips it. A given probe that fails on the model as built (before any switch) is a
            :class:`ProbeInputError` naming the class: the input does not fit the model. An HF model also takes a
            mapping of its keyword arguments (``{"input_ids": ..., "attention_mask": ...}``), and is always probed
            (None: a few token ids or one blank image).
        calibrate: HF models only: fold a temperature per head into the query weights so that each layer starts
            nearest to its softmax output on the probe's inputs (for fine-tuning a pretrained softmax model;
            :mod:`~polyattn_lightning.attention.hf_calibration`).

    To add a timm family: if it calls SDPA and no other softmax, add ``Reviewed(cls, mask_kinds)`` to
    ``timm_sdpa.REVIEWED`` after reading its forward; if it computes softmax by hand, write the smallest
    ``SwitchedAttention`` subclass calling ``self._attend`` with ``@_adapts(cls)`` in
    ``timm_adapters/<family>.py`` (and take ``cls`` off ``HAND_SOFTMAX``); add a tiny build to
    ``tests/attention/timm_families.py`` and rewrite the README's table
    (``python -m polyattn_lightning.attention.timm_support --write README.md``). The module docstring
    has the details.
    """
    hf_models = sys.modules.get("transformers.modeling_utils")  # an HF model exists only once this is imported
    if hf_models is not None and isinstance(model, hf_models.PreTrainedModel):
        from .hf import set_attention as set_hf_attention

        if not strict or probe is False:
            raise ConfigError(f"{type(model).__name__}: a Hugging Face model is switched whole, after its probe "
                              "forward; strict=False and probe=False are for timm models")
        return set_hf_attention(model, activation, probe=None if probe is True else probe, calibrate=calibrate)
    if calibrate:
        raise ConfigError(f"{type(model).__name__}: calibrate=True is for Hugging Face transformers models")
    if isinstance(probe, Mapping):
        raise ConfigError(f"{type(model).__name__}: probe= is a callable running one forward (a mapping of keyword "
                          "arguments is for Hugging Face models)")
    return len(_set_attention(model, activation, strict, probe)[0])


def _set_attention(model, activation, strict, probe) -> tuple[list[nn.Module], list[Unswitched]]:
    """set_attention's work; returns the switched modules and those that keep softmax."""
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)  # the caller's dict may change later
    _load_adapters()
    found, unswitched = [], {}
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is not None:
            found.append((module, adapter))
        elif (verdict := _static_verdict(module)) is not None:
            unswitched[name] = Unswitched(name, type(module), *verdict)
    model_name = type(model).__name__
    undo = [_switch(module, adapter) for module, adapter in found]
    probe_error = None
    try:
        derived = probe is None or probe is True
        run = None if probe is False else image_probe(model) if derived else probe
        if run is not None:
            try:
                calls = _probe(model, run)
            except Exception as err:  # noqa: BLE001 - a guessed input size may not fit the model
                if not derived:
                    probe_error = err
                    raise
                log.warning("%s: the probe forward at the model's stated input size failed (%s); only the class "
                            "tables were checked: pass probe= to set_attention", model_name, _reason(err))
                calls = []
            for call in calls:
                verdict = _probe_verdict(call)
                unswitched.setdefault(verdict.path, verdict)
        refused = [u for u in unswitched.values() if not u.by_decision]
        if not found:
            detail = _listed(unswitched.values())
            raise AttentionRefused(
                f"{model_name} has no attention module set_attention can switch" + (f": {detail}" if detail else "")
                + " (the support table in the README lists what switches)", list(unswitched.values())
            )
        if refused and strict:
            raise AttentionRefused(
                f"{model_name} has attention set_attention cannot switch, so it would keep softmax there: "
                + _listed(refused)
                + ". Set strict=False (YAML: model.init_args.attention_strict: false) to switch the rest",
                list(unswitched.values()),
            )
    except BaseException as err:
        for restore in reversed(undo):
            restore()
        if err is probe_error:
            _raise_if_input_does_not_fit(model, run)
        raise
    for module, _ in found:
        module.activation_spec = activation
    if unswitched:
        level = logging.WARNING if any(not u.by_decision for u in unswitched.values()) else logging.INFO
        log.log(level, "%s: %d attention modules switched to %s; stays softmax: %s", model_name, len(found),
                activation, _listed(unswitched.values()))
    return [module for module, _ in found], list(unswitched.values())


def _switch(module: nn.Module, adapter: type[SwitchedAttention]) -> Callable[[], None]:
    """Swap ``module``'s class to ``adapter`` on the probe activation (``fused_attn`` on, a ``capture`` kept);
    return what undoes it."""
    keys = ("activation_spec", "capture", "fused_attn")
    saved_class, saved = type(module), {k: module.__dict__[k] for k in keys if k in module.__dict__}

    def restore() -> None:
        module.__class__ = saved_class
        for key in keys:
            module.__dict__.pop(key, None)
        module.__dict__.update(saved)

    if type(module) is not adapter:
        module.__class__ = adapter
        module.capture = None
    if hasattr(module, "fused_attn"):
        module.fused_attn = True
    module.activation_spec = _PROBE_ACTIVATION
    return restore


def _probe(model: nn.Module, run: Probe) -> list[SoftmaxCall]:
    """The softmax calls of one eval-mode forward, ``capture`` hooks off (training flags and hooks restored)."""
    modes = [(m, m.training) for m in model.modules()]
    hooks = [(m, m.capture) for m in model.modules() if isinstance(m, SwitchedAttention)]
    try:
        model.eval()
        for m, _ in hooks:
            m.capture = None
        return softmax_calls(model, run)
    finally:
        for m, training in modes:
            m.training = training
        for m, capture in hooks:
            m.capture = capture


class ProbeInputError(ConfigError):
    """The probe forward given to set_attention fails on the model as it was built, before any switch: the input
    does not fit the model (an image size it was not built for), so nothing a switch did is to blame."""


def _raise_if_input_does_not_fit(model: nn.Module, run: Probe) -> None:
    """After a given probe failed on the switched model (and the switch was undone): run it on the model as built;
    if it fails there too, raise a :class:`ProbeInputError` naming the model's class and why."""
    try:
        _probe(model, run)
    except Exception as err:  # noqa: BLE001 - any failure of the unswitched model is the input's
        raise ProbeInputError(f"{type(model).__name__} cannot run one forward on the probe input, switched or not "
                              f"({_reason(err)}): build the model for the input size it is given") from err


def _reason(err: BaseException) -> str:
    """``Type: first line`` of an error (at most 200 characters of it)."""
    return f"{type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''}"


def _listed(unswitched) -> str:
    """``a, b (+3 more) (timm.x.Class): reason; ...``: the modules grouped by class and reason."""
    groups: dict[tuple[type, str], list[str]] = {}
    for u in unswitched:
        groups.setdefault((u.cls, u.reason), []).append(u.path or "<model>")
    parts = []
    for (cls, reason), paths in groups.items():
        more = f" (+{len(paths) - 3} more)" if len(paths) > 3 else ""
        parts.append(f"{', '.join(paths[:3])}{more} ({class_name(cls)}): {reason}")
    return "; ".join(parts)


def attention_modules(model: nn.Module) -> list[tuple[str, SwitchedAttention]]:
    """``(name, module)`` for every switched attention module, in ``named_modules`` order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, SwitchedAttention)]


__all__ = [
    "AttentionInputs", "AttentionRefused", "Capture", "ProbeInputError", "SwitchedAttention", "Unswitched", "attention_map",
    "attention_modules", "set_attention",
]
