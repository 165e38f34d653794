"""What the project adds to LightningCLI's parser: the defaults of ``trainer.precision`` (by the hardware),
``trainer.logger`` (TensorBoard under ``runs/``) and ``trainer.plugins`` (the safe checkpoint IO), and the standard
callbacks under their short keys (``--nan_guard.on_nonfinite skip``) with ``callbacks_off``; and which of those
short keys a run gives or leaves out, which decides how they merge with ``trainer.callbacks``."""

from __future__ import annotations

import inspect
import re
from typing import Literal, get_args

import torch

from ..callbacks.standard import STANDARD_CALLBACKS, STANDARD_KEYS, resolve_checkpoint_monitor
from .config import component_class, init_args
from .runs import RUNS_DIR


def default_precision() -> str:
    """bf16 mixed precision where the GPU has it, fp16 mixed on older GPUs, fp32 on CPU."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


#: The Trainer's options where an int and a float mean different things: an int counts batches, a float is a
#: fraction of them (``limit_train_batches: 1`` is one batch, ``1.0`` the whole epoch).
BATCH_LIMITS = ("limit_train_batches", "limit_val_batches", "limit_test_batches", "limit_predict_batches")


def batch_limits_read_as_counts(trainer_class: type) -> None:
    """Make the CLI read ``--trainer.limit_train_batches 1`` as one batch, as Lightning's signature says, in every
    environment.

    Lightning annotates the :data:`BATCH_LIMITS` ``Optional[Union[int, float]]``, but Python's typing cache hands
    back an equal union made earlier, whatever its order, and ``lightning.fabric`` makes
    ``Optional[Union[float, int]]`` as it is imported. Unless an earlier import made the int-first union
    (torchvision's transforms do, and torchmetrics 1.9, which Lightning imports first, imports them; 1.4 does not),
    the Trainer's annotations list float first; jsonargparse tries a union's types in order, and reads ``1`` as
    ``1.0``: the whole epoch instead of one batch. Such an annotation is put back in the signature's order as
    ``int | float | None`` (a ``types.UnionType``, which typing does not cache)."""
    for cls in getattr(trainer_class, "__mro__", ()):  # a class (LightningCLI also takes a function)
        init = cls.__dict__.get("__init__")
        annotations = getattr(inspect.unwrap(init), "__annotations__", {}) if init else {}
        for name in BATCH_LIMITS:
            if get_args(annotations.get(name)) == (float, int, type(None)):
                annotations[name] = int | float | None


def add_defaults(parser) -> None:
    """The defaults of ``trainer.precision``, ``trainer.logger`` (TensorBoard under ``runs/``) and
    ``trainer.plugins`` (``SafeCheckpointIO``); :data:`STANDARD_CALLBACKS` under their short keys and
    ``callbacks_off``."""
    parser.set_defaults(
        {
            "trainer.precision": default_precision(),
            "trainer.logger": {
                "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                "init_args": {"save_dir": RUNS_DIR, "default_hp_metric": False},
            },
            "trainer.plugins": [{"class_path": "polyattn_lightning.checkpoint.SafeCheckpointIO"}],
        }
    )
    for spec in STANDARD_CALLBACKS:
        parser.add_lightning_class_args(spec.cls, spec.key)
        parser.set_defaults({f"{spec.key}.{key}": value for key, value in spec.defaults.items()})
    parser.add_argument(
        "--callbacks_off",
        type=list[Literal[STANDARD_KEYS]],
        default=[],
        help="standard callbacks to leave out, e.g. [norms, predictions] (each is set under its own key: "
        f"{', '.join(STANDARD_KEYS)}); trainer.enable_checkpointing false leaves out both checkpoints, "
        "trainer.logger false the lr_monitor",
    )


def standard_off(config) -> set[str]:
    """The standard callbacks a run leaves out: ``callbacks_off``, and those the trainer settings rule out."""
    off = set(config.get("callbacks_off") or [])
    if config.trainer.get("enable_checkpointing") is False:
        off |= {"checkpoint", "last_checkpoint"}
    if config.trainer.get("logger") is False:
        off.add("lr_monitor")  # LearningRateMonitor raises without a logger
    return off


def given_short_keys(config, defaults, given_args: list[str]) -> set[str]:
    """The standard callbacks' short keys a run gives: named on the command line (``given_args``), or set (by a
    config file) to other than their ``defaults`` (the parser's), the best checkpoint's monitor being the task's by
    default."""
    named = {key for key in STANDARD_KEYS if any(re.match(rf"--{key}(\.|=|$)", arg) for arg in given_args)}
    default_checkpoint = init_args({"init_args": defaults.get("checkpoint")})
    resolve_checkpoint_monitor(default_checkpoint, component_class(config.get("model")))
    changed = {
        key
        for key in STANDARD_KEYS
        if init_args({"init_args": config.get(key)})
        != (default_checkpoint if key == "checkpoint" else init_args({"init_args": defaults.get(key)}))
    }
    return named | changed
