"""Switch the attention of a timm model to a registry activation, in place: :func:`set_attention` and the work
behind it (:func:`switch_modules`: find the switchable modules, swap their classes, prove the switch by a probe
forward, undo it all on a refusal). The package's docstring says what the three kinds of switch are,
``families/__init__.py`` how to add a family.

A model counts as switched only on evidence: after switching, ``set_attention`` runs a probe forward (one
random image at the size the model was built for) under a ``TorchFunctionMode`` that records every softmax and
SDPA call (``probe.py``); any call outside a switched module, any module with timm's ``fused_attn`` flag (its
mark on SDPA attention) but no switch, and any module of a class the tables name refuses the model with each
module's path, class (``timm.models.beit.Attention``) and reason, and nothing is changed. ``strict=False``
(YAML: ``model.init_args.attention_strict: false``) switches what can be switched and logs one line naming
what stays softmax.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from torch import nn

from ....errors import ConfigError
from ...registry import ActivationSpec, get_activation
from .. import mha  # noqa: F401  (registers torch's nn.MultiheadAttention switch, for any model holding one)
from ..base import ADAPTERS, SwitchedAttention
from ..reviewed import UnreviewedCode, adapter_route
from . import families, sdpa  # noqa: F401  (register the hand-written and the generic adapters)
from .probe import SoftmaxCall, image_probe, softmax_calls
from .tables import Unswitched, class_name, probe_verdict, static_verdict

log = logging.getLogger(__package__)  # the package's name: what its log lines have always said

# --------------------------------------------------------------------------- public API


def _adapter_for(module: nn.Module) -> type[SwitchedAttention] | None:
    if isinstance(module, SwitchedAttention):
        return type(module)
    return ADAPTERS.get(type(module))


def _unreviewed(module: nn.Module, adapter: type[SwitchedAttention]) -> str | None:
    """Why ``module``'s library code is not the code its adapter was reviewed against (``switch/reviewed.py``), or
    None (reviewed; a module switched before passed this already)."""
    if isinstance(module, SwitchedAttention):
        return None
    try:
        adapter_route(type(module), adapter)
    except UnreviewedCode as error:
        return str(error)
    return None


#: What probes a switched model: a non-softmax activation, so every softmax call left is outside a switch.
_PROBE_ACTIVATION = "relu"

Probe = Callable[[], object]


class AttentionRefused(ConfigError):
    """set_attention refused a model (nothing changed): ``unswitched`` says which modules keep softmax and why."""

    def __init__(self, message: str, unswitched: list[Unswitched]):
        super().__init__(message)
        self.unswitched = unswitched


def set_attention(
    model: nn.Module, activation: ActivationSpec, *, strict: bool = True, probe: Probe | bool | None = None
) -> int:
    """Switch every attention of a timm ``model`` (or of any module holding switchable ones) to ``activation``;
    returns how many were switched. The arguments are :func:`polyattn_lightning.attention.set_attention`'s."""
    if isinstance(probe, Mapping):
        raise ConfigError(
            f"{type(model).__name__}: probe= is a callable running one forward (a mapping of keyword "
            "arguments is for Hugging Face models)"
        )
    return len(switch_modules(model, activation, strict, probe)[0])


def switch_modules(model, activation, strict, probe) -> tuple[list[nn.Module], list[Unswitched]]:
    """set_attention's work; returns the switched modules and those that keep softmax (the support table reads both)."""
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)  # the caller's dict may change later
    found, unswitched = [], {}
    for name, module in model.named_modules():
        adapter = _adapter_for(module)
        if adapter is not None and (unreviewed := _unreviewed(module, adapter)) is not None:
            unswitched[name] = Unswitched(name, type(module), unreviewed)
        elif adapter is not None:
            found.append((module, adapter))
        elif (verdict := static_verdict(module)) is not None:
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
                log.warning(
                    "%s: the probe forward at the model's stated input size failed (%s); only the class "
                    "tables were checked: pass probe= to set_attention",
                    model_name,
                    _reason(err),
                )
                calls = []
            for call in calls:
                verdict = probe_verdict(call)
                unswitched.setdefault(verdict.path, verdict)
        refused = [u for u in unswitched.values() if not u.by_decision]
        if not found:
            detail = _listed(unswitched.values())
            raise AttentionRefused(
                f"{model_name} has no attention module set_attention can switch"
                + (f": {detail}" if detail else "")
                + " (the support table in docs/reference/timm-models.md lists what switches)",
                list(unswitched.values()),
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
        log.log(
            level,
            "%s: %d attention modules switched to %s; stays softmax: %s",
            model_name,
            len(found),
            activation,
            _listed(unswitched.values()),
        )
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
        raise ProbeInputError(
            f"{type(model).__name__} cannot run one forward on the probe input, switched or not "
            f"({_reason(err)}): build the model for the input size it is given"
        ) from err


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


__all__ = ["AttentionRefused", "ProbeInputError", "Unswitched", "set_attention", "switch_modules"]
