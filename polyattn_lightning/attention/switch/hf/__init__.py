"""Switch a Hugging Face ``transformers`` model's attention to a registry activation, through transformers' own door.

Reached through :func:`polyattn_lightning.attention.set_attention`. Registers the interface function
(``interface.py``) under ``attn_implementation="polyattn"`` and calls ``model.set_attn_implementation``.

Why a probe: ``set_attn_implementation`` on a model whose attention does not call the interface (DeBERTa,
Swin V2, ...) only logs a warning. After switching, :func:`set_attention` runs one small forward, counts the
calls into the function per module, and refuses the model (putting its implementation back) unless every
attention module was called. The modules it found are then given the project's
:class:`~polyattn_lightning.attention.switch.base.SwitchedAttention` mixin (their class is swapped for a
subclass; HF's ``forward`` and parameters are untouched), so the diagnostics' ``capture`` contract holds:
``attention_modules`` lists them in forward order and ``capture`` gets what ``attention()`` is given. The
probe's inputs are set_attention's ``probe=`` (a callable running one forward, or a mapping of the model's
keyword arguments). ``calibrate=True`` runs one more probe forward, with softmax, and folds a temperature per
head into the query weights (``calibration.py``): what makes a pretrained softmax model fine-tune into ``x^3``
(configs/README.md).

Saved models: :func:`set_attention` writes the spec into ``config.polyattn_attention``, so a
``save_pretrained`` folder carries it; :func:`load_pretrained` loads such a folder and switches it back.

Generation: ``model.generate(ids, cache=RecurrentCache(model))`` keeps a fixed-size state per layer instead of keys
and values once the context passes the crossover (``cache.py``).

This package imports transformers; nothing else in the project does unless it is given an HF model.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

from ....errors import ConfigError, MissingPathError
from ...registry import ActivationSpec, get_activation
from ..base import AttentionInputs, SwitchedAttention
from . import interface
from .cache import RecurrentCache
from .calibration import fold_temperatures
from .interface import IMPLEMENTATION, Probe, polyattn_attention
from .masks import split_mask

#: The config attribute that stores the activation spec (saved by ``save_pretrained``).
CONFIG_KEY = "polyattn_attention"
#: Tokens per row of the probe forward (a few, so a causal model has more than one query row).
PROBE_TOKENS = 6


# --------------------------------------------------------------------------- switching


def set_attention(
    model: PreTrainedModel,
    activation: ActivationSpec,
    *,
    probe: Mapping | Callable[[], object] | None = None,
    calibrate: bool = False,
) -> int:
    """Switch every attention layer of an HF ``PreTrainedModel`` to ``activation``; returns how many.

    Args:
        model: a ``transformers`` model whose attention goes through ``AttentionInterface`` (BERT, ViT, Llama...).
        activation: a registry activation (``"poly3"``, ``{name: poly3, scale: 0.0714}``...); ``softmax`` too.
        probe: the forward that shows every layer goes through the interface (and that ``calibrate`` measures):
            a mapping of ``model``'s keyword arguments (``{"input_ids": ..., "attention_mask": ...}``) or, as for
            timm models, a callable running one forward of ``model``; None makes a few token ids (two rows, the
            second padded) or one blank image, as the model's ``main_input_name`` asks. A batch of real inputs
            (e.g. training data) gives ``calibrate`` real scores to measure.
        calibrate: also fold one temperature per head into the query projections, chosen so that each layer's
            output starts nearest to the softmax output of the weights it was given
            (:mod:`~polyattn_lightning.attention.switch.hf.calibration`): once, when switching a pretrained softmax
            model.

    Raises :class:`ConfigError`, leaving the model as it was, when the model's attention does not go through
    transformers' ``AttentionInterface`` in every layer, passes a keyword argument the activation cannot honour,
    or (``calibrate``) has no query projection to fold the temperatures into.
    """
    get_activation(activation)  # fail on a bad spec before changing anything
    if isinstance(activation, Mapping):
        activation = dict(activation)
    model_name = type(model).__name__
    for sub in model.modules():
        if isinstance(sub, PreTrainedModel) and not type(sub)._can_set_attn_implementation():
            raise ConfigError(
                f"{model_name} cannot be switched: {type(sub).__name__}'s attention does not go through transformers' "
                "AttentionInterface (set_attention needs models whose attention modules call "
                "ALL_ATTENTION_FUNCTIONS.get_interface, e.g. BERT, ViT, Llama, Qwen2, Mistral, GPT-2)"
            )
    run = _probe_forward(model, probe)
    interface.register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    try:
        found = _check_every_layer(model, _run_probe(model, run, Probe(activation)).calls)
        if calibrate:  # every check before a weight changes: a refusal leaves the model as it was
            fold_temperatures(found, _softmax_inputs(model, run), activation)
    except BaseException:
        model.set_attn_implementation(previous)
        raise
    for module in found:
        if not isinstance(module, SwitchedAttention):
            module.__class__ = switched_class(type(module))
            module.capture = None
        module.activation_spec = activation
    setattr(model.config, CONFIG_KEY, activation)
    return len(found)


def _probe_forward(model: PreTrainedModel, probe: Mapping | Callable[[], object] | None) -> Callable[[], object]:
    """``probe`` as a callable running one forward of ``model``."""
    if callable(probe):
        return probe
    if probe is not None and not isinstance(probe, Mapping):
        raise ConfigError(
            f"{type(model).__name__}: probe= must be a mapping of the model's keyword arguments or a "
            f"callable running one forward, got {type(probe).__name__}"
        )
    inputs = dict(probe) if probe is not None else _default_probe_inputs(model)
    return lambda: model(**inputs)


def _run_probe(model: PreTrainedModel, run: Callable[[], object], probe: Probe) -> Probe:
    """One eval, no-grad forward (``run``) with every polyattn call going through ``probe``."""
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), interface.probing(probe):
            run()
        return probe
    except ConfigError as error:
        raise ConfigError(f"{type(model).__name__}: {error}") from None
    finally:
        model.train(was_training)


def _softmax_inputs(model: PreTrainedModel, run: Callable[[], object]) -> dict[int, AttentionInputs]:
    """What each attention module attends in a softmax forward of ``run`` (its first call), by module id."""
    recorded: dict[int, AttentionInputs] = {}
    _run_probe(model, run, Probe("softmax", capture=lambda module, inputs: recorded.setdefault(id(module), inputs)))
    return recorded


def _default_probe_inputs(model: PreTrainedModel) -> dict[str, Tensor]:
    """A few tokens (two rows, the second padded) or one image, on the model's device."""
    config = model.config.get_text_config() if model.main_input_name == "input_ids" else model.config
    device = next(model.parameters()).device
    if model.main_input_name == "input_ids":
        ids = torch.arange(2 * PROBE_TOKENS, device=device).reshape(2, PROBE_TOKENS) % config.vocab_size
        mask = torch.ones_like(ids)
        mask[1, -2:] = 0
        inputs = {"input_ids": ids, "attention_mask": mask}
        if getattr(model.config, "is_encoder_decoder", False):
            inputs["decoder_input_ids"] = ids
        return inputs
    if model.main_input_name == "pixel_values":
        size = config.image_size if isinstance(config.image_size, (tuple, list)) else (config.image_size,) * 2
        return {"pixel_values": torch.zeros(1, config.num_channels, *size, device=device, dtype=model.dtype)}
    raise ConfigError(
        f"{type(model).__name__} takes {model.main_input_name!r}: pass probe= (the keyword arguments of one "
        "small forward) to set_attention"
    )


def _check_every_layer(model: PreTrainedModel, calls: dict[int, int]) -> list[nn.Module]:
    """The modules the probe reached, in ``named_modules`` order; refuse the model if an attention layer
    (a leaf-most module whose class name says ``Attention``) was not reached."""
    reached = [module for module in model.modules() if id(module) in calls]
    missed = [f"{name} ({type(m).__name__})" for name, m in _attention_like(model) if id(m) not in calls]
    if missed or not reached:
        raise ConfigError(
            f"{type(model).__name__} cannot be switched: the probe forward reached "
            f"{len(reached)} attention call(s) through transformers' AttentionInterface but not "
            f"{', '.join(missed) or 'any attention layer'}; these layers compute attention themselves"
        )
    return reached


def _attention_like(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of modules whose class name contains ``Attention`` and which hold no such module."""
    candidates = [(name, m) for name, m in model.named_modules() if "Attention" in type(m).__name__]
    inner = {id(m) for _, m in candidates}
    return [(name, m) for name, m in candidates if not any(id(c) in inner for c in m.modules() if c is not m)]


# --------------------------------------------------------------------------- switched classes


_SWITCHED_PREFIX = "Switched__"
_switched: dict[type[nn.Module], type[SwitchedAttention]] = {}


def switched_class(cls: type[nn.Module]) -> type[SwitchedAttention]:
    """``SwitchedAttention`` + the HF class (its forward unchanged), one per class, picklable by name."""
    if cls not in _switched:
        name = _SWITCHED_PREFIX + f"{cls.__module__}.{cls.__qualname__}".replace(".", "__")
        _switched[cls] = type(name, (SwitchedAttention, cls), {"__module__": __name__, "__qualname__": name})
    return _switched[cls]


def __getattr__(name: str) -> type[SwitchedAttention]:
    """Unpickling finds a switched class by its name: rebuild it from the HF class it names."""
    if not name.startswith(_SWITCHED_PREFIX):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module_name, _, qualname = name[len(_SWITCHED_PREFIX) :].replace("__", ".").rpartition(".")
    __import__(module_name)
    return switched_class(getattr(sys.modules[module_name], qualname))


# --------------------------------------------------------------------------- saved models


def load_pretrained(folder: str | Path, auto_class: type | None = None, **kwargs: Any) -> PreTrainedModel:
    """Load a ``save_pretrained`` folder of a switched model (offline) and switch it back to its activation.

    ``auto_class``: e.g. ``AutoModelForSequenceClassification`` (default ``AutoModel``); ``kwargs`` go to
    ``from_pretrained``. A folder saved without an activation loads as it is (softmax).
    """
    from transformers import AutoModel

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise MissingPathError(f"{folder} is not a saved model folder: no config.json in it")
    model = (auto_class or AutoModel).from_pretrained(folder, local_files_only=True, **kwargs)
    spec = getattr(model.config, CONFIG_KEY, None)
    if spec is not None:
        set_attention(model, spec)
    return model


__all__ = [
    "CONFIG_KEY",
    "IMPLEMENTATION",
    "RecurrentCache",
    "load_pretrained",
    "polyattn_attention",
    "set_attention",
    "split_mask",
    "switched_class",
]
