"""What the project adds to LightningCLI's parser: the defaults of ``trainer.precision`` (by the hardware),
``trainer.logger`` (TensorBoard under ``runs/``) and ``trainer.plugins`` (the safe checkpoint IO), and the standard
callbacks under their short keys (``--nan_guard.on_nonfinite skip``) with ``callbacks_off``; and which of those
short keys a run gives or leaves out, which decides how they merge with ``trainer.callbacks``."""

from __future__ import annotations

import re
from typing import Literal

import torch

from ..callbacks.standard import STANDARD_CALLBACKS, STANDARD_KEYS, resolve_checkpoint_monitor
from .config import component_class, init_args
from .runs import RUNS_DIR


def default_precision() -> str:
    """bf16 mixed precision where the GPU has it, fp16 mixed on older GPUs, fp32 on CPU."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


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
