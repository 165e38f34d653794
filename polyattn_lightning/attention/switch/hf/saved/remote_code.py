"""A saved switched model that loads with ``trust_remote_code=True`` where the project is not installed.

:func:`write_remote_code` puts ``modeling_polyattn.py`` (:mod:`.standalone`: the attention written out with torch
alone) into a ``save_pretrained`` folder and an ``auto_map`` into its ``config.json`` that names, for each of
transformers' auto classes that has the model's architecture, its class through that file. transformers then
imports the file (which registers the attention) before it reads the config's ``attn_implementation``, and builds
its own class: ``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` in a process that never
imported the project gives the switched model. The route exists for models switched through the
``AttentionInterface`` alone, to a built-in activation; a model with hand-switched modules (``families/``), one that
attends with HF's float masks, or a custom activation is refused in one line: ``load_pretrained`` loads those.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from torch import nn

from .....errors import ConfigError
from ....registry import get_activation
from . import standalone
from ..interface import CONFIG_KEY, IMPLEMENTATION

#: The file's name in the folder; the ``auto_map`` entries name it.
MODELING_FILE = "modeling_polyattn.py"
#: The auto classes an ``auto_map`` may name (each where transformers maps the config's class to a model class).
AUTO_CLASSES = (
    "AutoModel",
    "AutoModelForCausalLM",
    "AutoModelForMaskedLM",
    "AutoModelForSequenceClassification",
    "AutoModelForTokenClassification",
    "AutoModelForQuestionAnswering",
    "AutoModelForImageClassification",
)


def remote_code_refusal(model: nn.Module) -> str | None:
    """Why ``model`` (switched, about to be saved) cannot load through :data:`MODELING_FILE`; None: it can."""
    spec = getattr(model.config, CONFIG_KEY, None)
    if spec is None or get_activation(spec).is_softmax:
        return "it is not switched to an activation other than softmax (it loads anywhere as it is)"
    implementation = vars(model.config).get("attn_implementation")
    if implementation != IMPLEMENTATION:
        return (
            f"it loads with attn_implementation={implementation!r} (hand-switched modules or HF's float masks), "
            "which only the project implements"
        )
    try:
        standalone.activation(spec)
    except ValueError as error:
        return str(error)
    return None


def auto_map(model: nn.Module) -> dict[str, str]:
    """``{auto class: "modeling_polyattn.<model class>"}`` for each of :data:`AUTO_CLASSES` that maps the model's
    config class (where it maps it to several classes, as DeiT's image classifiers: the model's own, else the
    first)."""
    import transformers

    found = {}
    for name in AUTO_CLASSES:
        mapping = getattr(transformers, name)._model_mapping
        try:
            model_class = mapping[type(model.config)]
        except KeyError:
            continue
        if isinstance(model_class, tuple):
            model_class = type(model) if type(model) in model_class else model_class[0]
        found[name] = f"{Path(MODELING_FILE).stem}.{model_class.__name__}"
    return found


def write_remote_code(model: nn.Module, folder: str | Path) -> Path:
    """Add :data:`MODELING_FILE` and the ``auto_map`` to ``folder``, a ``save_pretrained`` folder of ``model``;
    returns the file. Raises :class:`ConfigError` (one line: why, and that ``load_pretrained`` loads it) where the
    route cannot hold the model (:func:`remote_code_refusal`)."""
    folder = Path(folder)
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{folder} is not a save_pretrained folder: no config.json in it")
    why = remote_code_refusal(model)
    if why is not None:
        raise ConfigError(
            f"{type(model).__name__} cannot load through trust_remote_code: {why}; "
            "load it with polyattn_lightning.attention.switch.hf.load_pretrained"
        )
    config = json.loads(config_file.read_text())
    config["auto_map"] = {**config.get("auto_map", {}), **auto_map(model)}
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    target = folder / MODELING_FILE
    shutil.copyfile(standalone.__file__, target)
    return target


__all__ = ["AUTO_CLASSES", "MODELING_FILE", "auto_map", "remote_code_refusal", "write_remote_code"]
