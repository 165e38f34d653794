"""The callbacks every CLI run has, each under a short key of its own: ``--nan_guard.on_nonfinite skip``.

The CLI adds each one with LightningCLI's ``add_lightning_class_args``, so its options are set alone
(no restating of the ``trainer.callbacks`` list) and ``--print_config`` shows them. ``callbacks_off``
(a top-level list, ``--callbacks_off [norms, predictions]``) leaves some out. Opt-in callbacks
(``EMA``, ``AttentionMaps``) stay under ``trainer.callbacks``.

A config saved before they were standard (a run's ``config.yaml``) lists them in ``trainer.callbacks``:
:func:`drop_restated` removes such copies with a warning naming the short key, so a resumed run never
has two ``ExactResume``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from .attention_norms import AttentionNorms
from .memory import MemoryReport
from .nan_guard import NonFiniteLossGuard
from .predictions import PredictionWriter
from .preemption import SlurmPreemption
from .resume import ExactResume

#: The best checkpoint's file name (also how a saved ``trainer.callbacks`` entry is recognised as that callback).
BEST_FILENAME = "best-epoch{epoch:03d}"
#: The last checkpoint's file name, rewritten at every validation (or epoch end), for resuming and requeues.
LAST_FILENAME = "last"


@dataclass(frozen=True)
class StandardCallback:
    """One standard callback: its short key, class, defaults that differ from the class's, and what it does."""

    key: str
    cls: type[Callback]
    help: str
    defaults: dict[str, Any] = field(default_factory=dict)

    def matches(self, cls: type | None, init_args: dict[str, Any]) -> bool:
        """Whether a ``trainer.callbacks`` entry is this callback (a ModelCheckpoint by its file name: another
        one, e.g. every 1000 steps, is the user's own)."""
        if cls is not self.cls:
            return False
        return self.cls is not ModelCheckpoint or init_args.get("filename") == self.defaults["filename"]


STANDARD_CALLBACKS = (
    StandardCallback(
        "checkpoint",
        ModelCheckpoint,
        "the best checkpoint; monitor and mode default to the task's (val/top1 max, val/bbox_mAP max)",
        {"filename": BEST_FILENAME, "auto_insert_metric_name": False, "monitor": None, "mode": None},
    ),
    StandardCallback(
        # a second ModelCheckpoint: Lightning 2.6's save_last on the best one rewrites last.ckpt only when a new
        # best is saved, so a resume from it would lose every step since the last improvement
        "last_checkpoint",
        ModelCheckpoint,
        "checkpoints/last.ckpt, rewritten at every validation, for resuming",
        {"filename": LAST_FILENAME, "save_top_k": 1, "enable_version_counter": False},
    ),
    StandardCallback("lr_monitor", LearningRateMonitor, "logs the learning rate", {"logging_interval": "step"}),
    StandardCallback("resume", ExactResume, "a resumed run continues exactly (RNG states, mid-epoch loader position)"),
    StandardCallback(
        "preemption",
        SlurmPreemption,
        "under SLURM, the requeue signal and SIGTERM checkpoint at the next step boundary (exact requeue)",
    ),
    StandardCallback(
        "nan_guard", NonFiniteLossGuard, "a NaN or inf loss stops the run (on_nonfinite: skip skips the step)"
    ),
    StandardCallback("predictions", PredictionWriter, "`predict` saves its outputs to <log dir>/predictions/"),
    StandardCallback("norms", AttentionNorms, "attention norms per layer and head every every_n_steps steps"),
    StandardCallback(
        "memory", MemoryReport, "per-rank memory: the DDP and FSDP2 estimate before training, what is held after"
    ),
)
STANDARD_KEYS = tuple(callback.key for callback in STANDARD_CALLBACKS)


def task_monitor(task_class: type | None) -> tuple[str | None, str]:
    """The metric a task's best checkpoint keeps and whether higher is better (``monitor``, ``mode``
    class attributes; a LightningModule without them: none, and the latest checkpoint is kept)."""
    return getattr(task_class, "monitor", None), getattr(task_class, "mode", None) or "min"


def resolve_checkpoint_monitor(settings: dict[str, Any], task_class: type | None) -> None:
    """Fill the best checkpoint's ``monitor``/``mode`` left unset (None) with the task's, in place. A ``monitor``
    given without ``mode`` gets the task's mode when it is the task's metric, else ModelCheckpoint's ``min``."""
    monitor, mode = task_monitor(task_class)
    if settings.get("monitor") is None:
        settings["monitor"] = monitor
        settings["mode"] = settings.get("mode") or mode
    elif settings.get("mode") is None:
        settings["mode"] = mode if settings["monitor"] == monitor else "min"


def drop_restated(
    callbacks: list[tuple[type | None, dict[str, Any]]], standard: dict[str, dict[str, Any]], off: set[str]
) -> tuple[list[int], list[str]]:
    """Which ``trainer.callbacks`` entries (``(class, init_args)``) are standard callbacks the CLI adds
    anyway (not one in ``off``): their indices and a warning for each, naming its short key and any setting of
    the listed copy that differs from the short key's (``standard``: the short keys' settings)."""
    dropped, warnings = [], []
    for index, (cls, init_args) in enumerate(callbacks):
        spec = next((s for s in STANDARD_CALLBACKS if s.key not in off and s.matches(cls, init_args)), None)
        if spec is None:
            continue
        dropped.append(index)
        differ = {k: v for k, v in init_args.items() if k in standard[spec.key] and standard[spec.key][k] != v}
        message = (
            f"trainer.callbacks: {spec.cls.__name__} is a standard callback now, under "
            f"--{spec.key}; the copy in trainer.callbacks is dropped"
        )
        if differ:
            message += (
                " and its "
                + ", ".join(f"{k}={v!r}" for k, v in differ.items())
                + " not used ("
                + ", ".join(f"--{spec.key}.{k} {v}" for k, v in differ.items())
                + " keeps it)"
            )
        warnings.append(message)
    return dropped, warnings
