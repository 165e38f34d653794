"""Switch a Hugging Face ``transformers`` model's attention to a registry activation, through transformers' own door.

Reached through :func:`polyattn_lightning.attention.set_attention`. Two routes, both on one model if it needs
them (SigLIP: its encoders through the interface, its pooling head's ``nn.MultiheadAttention`` by adapter):

* the interface (most models): the function of ``interface.py`` is registered under
  ``attn_implementation="polyattn"`` and the model gets ``model.set_attn_implementation("polyattn")``; it honours
  the masks (``masks.py``: BEiT's, Doge's, Swin's and ALiBi Falcon's carry a score bias) and the keyword
  arguments some families pass (``extras.py``: T5's ``position_bias``, GPT-OSS's ``s_aux`` sinks, Gemma 2's
  ``softcap``); a model without SDPA support gets HF's float eager masks instead of boolean ones
  (``interface.implementation_for``);
* an adapter (``families/``: DeBERTa, MPNet, RoFormer, Megatron-BERT, RemBERT, TAPAS, VisualBERT,
  Data2Vec-Vision, Swin V2, GPT-Neo, Falcon, BLOOM; ``switch/mha.py``: PyTorch's ``nn.MultiheadAttention``)
  for each module whose class computes attention itself: its class is swapped for a subclass that keeps HF's
  steps and calls ``attention()``.

Why a probe: ``set_attn_implementation`` on a model whose attention does not call the interface only logs a
warning. After switching, :func:`set_attention` runs one small forward (``probe=``, else inputs built from the
config: ``probe.py``) on a non-softmax activation under the softmax recorder (``switch/recorder.py``): every module
of the model is given the probe's activation and a ``capture`` that counts its calls (:class:`Probe`), so the
interface function and the adapters attend with it and are counted, and the model is refused (everything put back)
unless every attention layer (a leaf-most module whose class name says ``Attention``) attended through one of them
and no softmax or SDPA call is left inside an attention layer. The modules the interface reached are then given the
project's :class:`~polyattn_lightning.attention.switch.base.SwitchedAttention` mixin (``classes.py``: their class is
swapped for a subclass; HF's ``forward`` and parameters are untouched), so the diagnostics' ``capture`` contract
holds: ``attention_modules`` lists them in forward order and ``capture`` gets what ``attention()`` is given.
Converting a pretrained softmax model without losing what it learned (calibration, attention transfer) is
:func:`polyattn_lightning.convert`'s (``polyattn_lightning/conversion/``).

A switched model is saved with its activation (``saved/``); :func:`load_pretrained` loads such a folder and
switches it back.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PreTrainedModel

from ....errors import ConfigError, MissingPathError
from ...registry import ActivationSpec, get_activation
from ..base import AttentionInputs, Capture, SwitchedAttention
from ..recorder import SoftmaxCall, softmax_calls
from ..reviewed import UnreviewedCode
from . import interface
from .classes import switched_class
from .families import adapter_for
from .probe import probe_inputs
from .saved import CONFIG_KEY, LOAD_PRETRAINED, mark_config

#: The activation of the probe forward: not softmax, so a softmax or SDPA call left in an attention layer shows.
PROBE_ACTIVATION = "relu"


class Probe:
    """The probe in progress: the spec to attend with, how often each module attended (through the interface
    function or an adapter's ``_attend``), and the ``capture`` every module gets meanwhile (None: none, the
    diagnostics' hooks are off during a probe)."""

    def __init__(self, spec: ActivationSpec, capture: Capture | None = None):
        self.spec = spec
        self.calls: dict[int, int] = {}
        self.capture = capture

    def seen(self, module: nn.Module, inputs: AttentionInputs) -> None:
        """A module's capture during the probe: counts the call, then hands it to ``capture``."""
        self.calls[id(module)] = self.calls.get(id(module), 0) + 1
        if self.capture is not None:
            self.capture(module, inputs)


def set_attention(
    model: PreTrainedModel,
    activation: ActivationSpec,
    *,
    probe: Mapping | Callable[[], object] | None = None,
) -> int:
    """Switch every attention layer of an HF ``PreTrainedModel`` to ``activation``; returns how many.

    Args:
        model: a ``transformers`` model (docs/reference/hf-models.md lists the families and their state).
        activation: a registry activation (``"poly3"``, ``{name: poly3, scale: 0.0714}``...); ``softmax`` too.
        probe: the forward that shows every layer is switched: a mapping of
            ``model``'s keyword arguments (``{"input_ids": ..., "attention_mask": ...}``) or, as for timm models,
            a callable running one forward of ``model``; None builds inputs from the model's config (text,
            image, video, waveform, log-mel features, image + text: ``probe.py``).

    Raises :class:`ConfigError`, leaving the model as it was, when an attention layer is neither reached through
    transformers' ``AttentionInterface`` nor has an adapter, still computes softmax, has a configuration its
    adapter refuses, or has code its adapter was not reviewed against in the installed transformers release
    (:class:`~..reviewed.UnreviewedCode`, ``switch/reviewed.py``).
    """
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)
    model_name = type(model).__name__
    adapted = _adapted(model)
    refused = [f"{name} ({type(m).__name__}): {why}" for name, m, adapter in adapted if (why := _refusal(adapter, m))]
    if refused:
        raise ConfigError(f"{model_name} cannot be switched: {'; '.join(refused)}")
    run = _probe_forward(model, probe)
    through_interface = type(model)._can_set_attn_implementation()
    previous = model.config._attn_implementation
    undo = [_swap(module, adapter) for _, module, adapter in adapted]
    if through_interface:
        interface.register()
        model.set_attn_implementation(interface.implementation_for(model))
    try:
        state = Probe(PROBE_ACTIVATION)
        left = _run_probe(model, run, state, default=probe is None)
        found = _check_every_layer(model, state.calls, left)
    except BaseException:
        for restore in reversed(undo):
            restore()
        if through_interface:
            model.set_attn_implementation(previous)
        raise
    for module in found:
        if not isinstance(module, SwitchedAttention):
            module.__class__ = switched_class(type(module))
            module.capture = None
        module.activation_spec = activation
    setattr(model.config, CONFIG_KEY, activation)
    mark_config(model.config, activation, LOAD_PRETRAINED if adapted else interface.implementation_for(model))
    return len(found)


def _adapted(model: PreTrainedModel) -> list[tuple[str, nn.Module, type[SwitchedAttention]]]:
    """``(name, module, adapter)`` of the modules switched by an adapter; a module whose library code was not
    reviewed refuses the model (one line naming the module)."""
    adapted = []
    for name, module in model.named_modules():
        try:
            adapter = adapter_for(module)
        except UnreviewedCode as error:
            raise UnreviewedCode(f"{type(model).__name__} cannot be switched: {name}: {error}") from None
        if adapter is not None:
            adapted.append((name, module, adapter))
    return adapted


def _refusal(adapter: type[SwitchedAttention], module: nn.Module) -> str | None:
    """Why ``adapter`` does not switch ``module`` as configured (DeBERTa's talking heads), or None."""
    refusal = getattr(adapter, "refusal", None)
    return None if refusal is None else refusal(module)


def _swap(module: nn.Module, adapter: type[SwitchedAttention]) -> Callable[[], None]:
    """Give ``module`` its adapter's class (``capture`` None); return what puts it back."""
    saved_class, saved = (
        type(module),
        {k: module.__dict__[k] for k in ("activation_spec", "capture") if k in module.__dict__},
    )

    def restore() -> None:
        module.__class__ = saved_class
        for key in ("activation_spec", "capture"):
            module.__dict__.pop(key, None)
        module.__dict__.update(saved)

    if type(module) is not adapter:
        module.__class__ = adapter
        module.capture = None
    return restore


def _probe_forward(model: PreTrainedModel, probe: Mapping | Callable[[], object] | None) -> Callable[[], object]:
    """``probe`` as a callable running one forward of ``model``."""
    if callable(probe):
        return probe
    if probe is not None and not isinstance(probe, Mapping):
        raise ConfigError(
            f"{type(model).__name__}: probe= must be a mapping of the model's keyword arguments or a "
            f"callable running one forward, got {type(probe).__name__}"
        )
    inputs = dict(probe) if probe is not None else probe_inputs(model)
    return lambda: model(**inputs)


def _run_probe(
    model: PreTrainedModel,
    run: Callable[[], object],
    probe: Probe,
    default: bool = False,
) -> list[SoftmaxCall]:
    """One eval, no-grad forward (``run``) with every module of ``model`` attending with the probe's activation and
    counted by its capture (the interface function and the adapters read both from the module they are called with);
    returns the softmax calls it made. A default probe that fails is a one-line error."""
    was_training = model.training
    keys = ("activation_spec", "capture")
    saved = [(m, {key: m.__dict__[key] for key in keys if key in m.__dict__}) for m in model.modules()]
    try:
        model.eval()
        for module, _ in saved:
            module.activation_spec, module.capture = probe.spec, probe.seen
        with torch.no_grad():
            return softmax_calls(model, run)
    except ConfigError as error:
        raise ConfigError(f"{type(model).__name__}: {error}") from None
    except Exception as error:
        if not default:
            raise
        first = str(error).splitlines()[0][:200] if str(error) else ""
        raise ConfigError(
            f"{type(model).__name__}: the default probe forward (inputs built from its config) failed "
            f"({type(error).__name__}: {first}); pass probe= to set_attention (a mapping of the keyword "
            "arguments of one small forward, or a callable)"
        ) from error
    finally:
        model.train(was_training)
        for module, attributes in saved:
            for key in keys:
                module.__dict__.pop(key, None)
            module.__dict__.update(attributes)


def _check_every_layer(model: PreTrainedModel, calls: dict[int, int], left: list[SoftmaxCall]) -> list[nn.Module]:
    """The modules the probe reached, in ``named_modules`` order; refuse the model if an attention layer (a
    leaf-most module whose class name says ``Attention``) was not reached or still calls softmax itself."""
    reached = [module for module in model.modules() if id(module) in calls]
    attention_like = _attention_like(model)
    missed = [f"{name} ({type(m).__name__})" for name, m in attention_like if id(m) not in calls]
    inside = {id(m) for _, m in attention_like} | {id(m) for m in reached}
    softmax = {}
    for call in left:  # made by an attention layer itself: a gate or router inside one (JetMoE's) is not attention
        if call.stack and id(call.stack[-1][1]) in inside:
            path, module = call.stack[-1]
            softmax.setdefault(path, f"{path} ({type(module).__name__}) calls {call.function}")
    problems = []
    if missed:
        problems.append(
            f"{', '.join(missed[:3])}{f' (+{len(missed) - 3} more)' if len(missed) > 3 else ''} did not attend "
            "in the probe forward through transformers' AttentionInterface or an adapter (attention/switch/hf/"
            "families): they compute attention themselves, or the probe did not run them (pass probe= that does)"
        )
    if softmax:
        problems.append("softmax left in an attention layer: " + ", ".join(list(softmax.values())[:3]))
    if problems or not reached:
        raise ConfigError(
            f"{type(model).__name__} cannot be switched: "
            + ("; ".join(problems) or "the probe forward reached no attention layer")
        )
    return reached


def _attention_like(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of modules whose class name contains ``Attention`` and which hold no such module."""
    candidates = [(name, m) for name, m in model.named_modules() if "Attention" in type(m).__name__]
    inner = {id(m) for _, m in candidates}
    return [(name, m) for name, m in candidates if not any(id(c) in inner for c in m.modules() if c is not m)]


def load_pretrained(folder: str | Path, auto_class: type | None = None, **kwargs: Any) -> PreTrainedModel:
    """Load a ``save_pretrained`` folder of a switched model (offline) and switch it back to its activation.

    ``auto_class``: e.g. ``AutoModelForSequenceClassification`` (default ``AutoModel``); ``kwargs`` go to
    ``from_pretrained`` (``attn_implementation`` defaults to transformers' choice, not the saved
    :data:`IMPLEMENTATION`: the switch sets the one the model needs). A folder saved without an activation loads as
    it is (softmax).
    """
    from transformers import AutoModel

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MissingPathError(f"{folder} is not a saved model folder: no config.json in it")
    kwargs.setdefault("attn_implementation", None)
    model = (auto_class or AutoModel).from_pretrained(folder, local_files_only=True, **kwargs)
    spec = getattr(model.config, CONFIG_KEY, None)
    if spec is not None:
        set_attention(model, spec)
    return model


__all__ = ["PROBE_ACTIVATION", "Probe", "load_pretrained", "set_attention"]
