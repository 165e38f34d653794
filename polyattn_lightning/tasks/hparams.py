"""The task base's hyperparameters: recipes given as plain mappings, and the values the data determines.

* **Recipes** (``optim``, ``convert``, ``lora``, ``mixup``...) are dataclasses; the CLI saves them in the
  hyperparameters as plain mappings, which :func:`as_dataclass` rebuilds, and :func:`check_recipe` checks one in a
  config before anything is built.
* **Values the data determines** (a task's ``data_args`` and ``optional_data_args``: class count, vocabulary,
  length, image size): a hyperparameter left ``None`` takes the DataModule's value of the same name once its
  ``setup()`` has run (:func:`fill_from_data`), and is saved with the hyperparameters, so a checkpoint rebuilds the
  same model without the data; a given value that differs from the data's is a
  :class:`~polyattn_lightning.errors.ConfigError` naming both; a required one neither gives is one too
  (:func:`require_data_values`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

import lightning.pytorch as pl

from ..errors import ConfigError, UserInputError

T = TypeVar("T")


def as_dataclass(value: T | Mapping[str, Any], cls: type[T]) -> T:
    """``value`` as a ``cls`` dataclass: the CLI saves hyperparameters as plain mappings, which rebuild it."""
    return cls(**value) if isinstance(value, Mapping) else value


def check_recipe(init_args: Mapping[str, Any], key: str, cls: type) -> None:
    """The ``key`` recipe of a config's init arguments rebuilt as ``cls``, when given: its own refusal, or an unknown
    field, as one error naming ``model.init_args.<key>``."""
    if init_args.get(key) is None:
        return
    try:
        as_dataclass(init_args[key], cls)
    except UserInputError as err:
        raise type(err)(f"model.init_args.{err}") from err
    except TypeError as err:
        raise ConfigError(f"model.init_args.{key}: {err}") from None


def fill_from_data(task: pl.LightningModule, datamodule: pl.LightningDataModule | None) -> None:
    """Take the values of the task's ``data_args`` and ``optional_data_args`` left None from ``datamodule`` (set up)
    into its hyperparameters, while the model is not built; a value given that differs from the data's is an error
    naming both (:func:`mismatch_message`)."""
    if datamodule is None:
        return
    data_name = type(datamodule).__name__
    for name in (*task.data_args, *task.optional_data_args):
        data_value = getattr(datamodule, name, None)
        value = task.hparams.get(name)
        if data_value is None or value == data_value:
            continue
        if value is None and not task.built:
            task.hparams[name] = data_value  # saved with the checkpoint's hyperparameters
        elif value is not None:
            raise ConfigError(mismatch_message(task, name, value, data_name, data_value))


def require_data_values(task: pl.LightningModule) -> None:
    """Refuse to build while a value of the task's ``data_args`` is neither given nor taken from the data."""
    missing = [name for name in task.data_args if task.hparams.get(name) is None]
    if missing:
        raise ConfigError(
            f"{type(task).__name__} needs {', '.join(missing)}: give model.init_args.{missing[0]} or use a "
            "DataModule that has it"
        )


def mismatch_message(task: pl.LightningModule, name: str, value: Any, data_name: str, data_value: Any) -> str:
    """Why a value given for ``name`` cannot be used with this data, and what to do: the checkpoint's saved value
    when the task was built from one (``hparams_checkpoint``), else the config's."""
    if task.hparams_checkpoint:
        return (
            f"checkpoint {task.hparams_checkpoint} has {name}={value} (its saved hyperparameters replace the "
            f"config's model.init_args.{name}) but {data_name} has {name}={data_value}; use it on data like "
            "the data it was trained on, or fine-tune from it with --model.pretrained instead of --ckpt_path"
        )
    return (
        f"model.init_args.{name} is {value} but {data_name} has {name}={data_value}; leave "
        f"model.init_args.{name} out (the data's value is used) or set it to {data_value}"
    )
