"""Step one: the attention of a model just built switched to the task's activation, in the one place it is.

Every attention layer of the task's ``attention_target()`` runs the registry activation its ``attention_spec()``
names (softmax too, so every model takes the registry path), with the ``set_attention`` options its
``attention_options()`` gives (``strict``, the probe batch).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl

from ...attention import get_activation
from ...attention.switch import set_attention
from ...errors import UserInputError


def check_init_args(init_args: Mapping[str, Any]) -> None:
    """The attention spec of a config, before anything is built; the error names the key."""
    if init_args.get("attention") is None:
        return
    try:
        get_activation(init_args["attention"])
    except UserInputError as err:
        raise type(err)(f"model.init_args.attention: {err}") from err


def run(task: pl.LightningModule, new: bool) -> None:
    """Switch a new model's attention (a model already prepared is left as it is)."""
    target = task.attention_target()
    if new and target is not None:
        set_attention(target, task.attention_spec(), **task.attention_options())
