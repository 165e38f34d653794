"""The callbacks every CLI run has, each under a short key of its own: ``--nan_guard.on_nonfinite skip``.

The CLI adds each one with LightningCLI's ``add_lightning_class_args``, so its options are set alone
(no restating of the ``trainer.callbacks`` list) and ``--print_config`` shows them. ``callbacks_off``
(a top-level list, ``--callbacks_off [norms, predictions]``) leaves some out. Opt-in callbacks
(``EMA``, ``AttentionMaps``) stay under ``trainer.callbacks``.

``trainer.callbacks`` stays the user's list, as in Lightning (:func:`merge_callbacks`): an entry is the standard
callback whose Lightning identity (``Callback.state_key``) it has, and replaces it with its own settings, unless
that short key is given (on the command line, or set to other than its default), which then wins; every other
entry runs beside the standard ones. A user ``ModelCheckpoint`` that writes ``checkpoints/last.ckpt`` itself
(``save_last``, or ``filename: last``) turns the standard last checkpoint off. So a YAML written as Lightning's
docs show (own ``ModelCheckpoint``, ``EarlyStopping``, ``NonFiniteLossGuard(on_nonfinite: skip)``) runs as
written, and a ``config.yaml`` saved before these were standard (listing all of them) resumes with the settings
it ran with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from ..errors import ConfigError

from .attention_norms import AttentionNorms
from .memory import MemoryReport
from .nan_guard import NonFiniteLossGuard
from .predictions import PredictionWriter
from .preemption import StopOnSignal
from .progress_lines import ProgressLines
from .resume import ExactResume
from .summary import RunSummary

#: The best checkpoint's file name.
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


class LastCheckpoint(ModelCheckpoint):
    """The standard ``checkpoints/last.ckpt`` (resume, requeue): a ModelCheckpoint whose Lightning identity
    (``state_key``) holds its file name, so no user ModelCheckpoint (``monitor: null`` like this one, any
    ``save_last``) is taken for it. A checkpoint of a run made before it existed holds this callback's state under
    a plain ModelCheckpoint's key: :meth:`on_load_checkpoint` reads it from there."""

    @property
    def state_key(self) -> str:
        return self._generate_state_key(
            filename=self.filename,
            monitor=self.monitor,
            mode=self.mode,
            every_n_train_steps=self._every_n_train_steps,
            every_n_epochs=self._every_n_epochs,
            train_time_interval=self._train_time_interval,
        )

    @property
    def plain_state_key(self) -> str:
        """The key a plain ModelCheckpoint of these settings has (how runs before this class saved it)."""
        return ModelCheckpoint.__qualname__ + ModelCheckpoint.state_key.fget(self).removeprefix(type(self).__qualname__)

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict[str, Any]) -> None:
        states = checkpoint.get("callbacks") or {}
        if self.state_key not in states and self.plain_state_key in states:
            states[self.state_key] = states[self.plain_state_key]  # loaded by Lightning right after this hook


STANDARD_CALLBACKS = (
    StandardCallback(
        "checkpoint",
        ModelCheckpoint,
        "the best checkpoint; monitor and mode default to the task's (val/top1 max, val/bbox_mAP max)",
        {"filename": BEST_FILENAME, "auto_insert_metric_name": False, "monitor": None, "mode": None},
    ),
    StandardCallback(
        # its own callback, not the best one's save_last: it stays when the best one is turned off or replaced
        "last_checkpoint",
        LastCheckpoint,
        "checkpoints/last.ckpt, rewritten at every validation, for resuming",
        {"filename": LAST_FILENAME, "save_top_k": 1, "enable_version_counter": False},
    ),
    StandardCallback("lr_monitor", LearningRateMonitor, "logs the learning rate", {"logging_interval": "step"}),
    StandardCallback("resume", ExactResume, "a resumed run continues exactly (RNG states, mid-epoch loader position)"),
    StandardCallback(
        "preemption",
        StopOnSignal,
        "Ctrl-C (and under SLURM the requeue signal and SIGTERM) checkpoints at the next step boundary, then exits "
        "(130 on Ctrl-C); resuming is exact",
    ),
    StandardCallback(
        "nan_guard", NonFiniteLossGuard, "a NaN or inf loss stops the run (on_nonfinite: skip skips the step)"
    ),
    StandardCallback("predictions", PredictionWriter, "`predict` saves its outputs to <log dir>/predictions/"),
    StandardCallback("norms", AttentionNorms, "attention norms per layer and head every every_n_steps steps"),
    StandardCallback(
        "memory", MemoryReport, "per-rank memory: the DDP and FSDP2 estimate before training, what is held after"
    ),
    StandardCallback(
        "summary",
        RunSummary,
        "at the end of fit/validate/test (also on Ctrl-C or an error): the monitored metric's best and last value and "
        "the other val/ and test/ metrics, printed and written to <run folder>/metrics.json",
    ),
    StandardCallback(
        "progress_lines",
        ProgressLines,
        "where stdout is not a terminal or the run has no progress bar: a line every every_n_steps steps or "
        "every_seconds s (step, loss, steps/s, time left), and a heartbeat while one step runs over heartbeat_seconds",
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


def writes_last(callback: Callback, last: LastCheckpoint) -> bool:
    """Whether ``callback`` (another ModelCheckpoint) writes the file ``last`` writes: ``save_last`` or its
    ``filename`` naming ``last.ckpt`` in the same folder."""
    if not isinstance(callback, ModelCheckpoint) or callback is last or callback.dirpath != last.dirpath:
        return False
    return (
        callback.filename == last.filename
        or bool(callback.save_last)
        and callback.CHECKPOINT_NAME_LAST == last.filename
    )


def settings_text(settings: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value!r}" for key, value in settings.items())


@dataclass
class Merged:
    """What :func:`merge_callbacks` decided: the standard keys left out, the ``trainer.callbacks`` entries left out
    (their indices) and one info line per decision."""

    off: set[str] = field(default_factory=set)
    dropped: list[int] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)


def merge_callbacks(
    standard: dict[str, Callback],
    listed: list[tuple[Callback, dict[str, Any]]],
    settings: dict[str, dict[str, Any]],
    given: set[str],
) -> Merged:
    """Which of the standard callbacks (``standard``: short key -> instance, the ones this run has) and the user's
    ``trainer.callbacks`` (``listed``: instance and its init args) run.

    An entry with a standard callback's ``state_key`` is that callback: the entry is used (the short key left
    out), unless the short key is in ``given`` (named on the command line, or set to other than its default),
    which is then used and the entry left out. A ModelCheckpoint that writes ``last.ckpt`` where the standard
    last checkpoint does (:func:`writes_last`) turns it off; with ``last_checkpoint`` given too, the two would
    write one file: an error. ``settings``: the short keys' settings, for the info lines.
    """
    merged = Merged()
    by_identity = {callback.state_key: key for key, callback in standard.items()}
    for index, (callback, init_args) in enumerate(listed):
        key = by_identity.get(callback.state_key)
        if key is None:
            continue
        name = type(callback).__name__
        differ = {k: v for k, v in init_args.items() if k in settings.get(key, {}) and settings[key][k] != v}
        if key in given:
            merged.dropped.append(index)
            merged.messages.append(
                f"trainer.callbacks: {name} has the identity (state key) of the standard --{key}, which is given: "
                f"--{key} is used, the listed one left out" + (f" (its {settings_text(differ)})" if differ else "")
            )
        else:
            merged.off.add(key)
            merged.messages.append(
                f"trainer.callbacks: {name} has the identity (state key) of the standard --{key}: the listed one is "
                "used" + (f", with its {settings_text(differ)}" if differ else "")
            )
    last = standard.get("last_checkpoint")
    if last is not None and "last_checkpoint" not in merged.off:
        kept = [cb for index, (cb, _) in enumerate(listed) if index not in merged.dropped]
        kept += [cb for key, cb in standard.items() if key != "last_checkpoint" and key not in merged.off]
        writers = [cb for cb in kept if writes_last(cb, last)]
        if writers:
            where = f"ModelCheckpoint(filename={writers[0].filename!r}, save_last={writers[0].save_last!r})"
            if "last_checkpoint" in given:
                raise ConfigError(
                    f"{where} and --last_checkpoint both write checkpoints/{last.filename}.ckpt: "
                    "give one (--callbacks_off [last_checkpoint], or the other without save_last)"
                )
            merged.off.add("last_checkpoint")
            merged.messages.append(
                f"trainer.callbacks: {where} writes checkpoints/{last.filename}.ckpt itself: the standard "
                "--last_checkpoint is left out (resume from that file as before)"
            )
    return merged
