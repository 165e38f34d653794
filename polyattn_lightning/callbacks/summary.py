"""How a run went, said at its end: a short table on the terminal (whatever the progress bar) and ``metrics.json`` in
the run's folder, which tools (a grid's report) read.

``fit`` and every ``validate``/``test`` of a checkpoint end with it, also when the run ends otherwise: a Ctrl-C or a
SLURM requeue (status ``interrupted``) or an exception (``failed``, with the error's one-line summary). The file is
written on rank 0, atomically; a resumed run rewrites it, with the validations before the stop (kept in the
checkpoint). Its schema (``schema: 1``) is documented in docs/training.md ("What the end of a run says").

Where the data module knows its validation labels (:meth:`~polyattn_lightning.data.base.DataModule.chance_rate`),
the majority-class rate is written beside the scores, and a top-1 accuracy whose best value is no more than
:data:`NOISE_SE` binomial standard errors above it ends the run with one line saying so, and what to try.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..checkpoint import atomic_write
from ..data.base import ChanceRate

#: The metrics file's name in the run's folder, and the version of its layout.
FILENAME = "metrics.json"
SCHEMA = 1
#: The metric (after its ``val/``/``test/`` prefix) that the majority-class rate is a value of.
ACCURACY = "top1"
#: How many binomial standard errors (of the chance rate, on the validation split's size) above the chance rate a
#: best accuracy may lie and still count as at chance.
NOISE_SE = 2.0


class RunSummary(Callback):
    """At the end of ``fit``/``validate``/``test`` (and on Ctrl-C, requeue or an exception): the monitored metric's
    best and last value with their steps and epochs, the best checkpoint, the other logged ``val/`` and ``test/``
    metrics, printed as a short table and written to ``<run folder>/metrics.json`` (see the module docstring).

    The monitored metric is the best checkpoint's (a ModelCheckpoint with a ``monitor``, the task's first), else the
    task's ``monitor``/``mode``; ``test`` of a checkpoint reports the task's metric on the test split (``test/top1``
    for ``val/top1``). A ``fit`` that tests its best checkpoint at the end (``test_after_fit``) ends after that test,
    with its ``test/`` metrics."""

    def __init__(self) -> None:
        self._depth = 0  # setup() calls not yet torn down: a test run inside fit (test_after_fit) nests one
        self._ended = True
        self._verb = ""
        self._folder: Path | None = None
        self._monitor: str | None = None
        self._mode = "max"
        self._checkpoint: ModelCheckpoint | None = None
        self._chance: ChanceRate | None = None
        self._chance_class: str | int | None = None
        self._tips: list[str] = []
        self._start = 0.0
        self._history: list[dict[str, Any]] = []  # the monitored value at every validation: value, step, epoch
        self._metrics: dict[str, float | None] = {}
        self._restored: dict[str, Any] | None = None
        self._evaluated: dict[str, Any] = {}  # validate/test: the checkpoint's global_step and epoch
        self._error: str | None = None

    # -- what the run logs -----------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._depth == 0:
            self._begin(trainer, pl_module)
        self._depth += 1

    def _begin(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._ended, self._verb, self._start = False, trainer.state.fn.value, time.monotonic()
        self._error = self._restored = None
        self._history, self._metrics, self._evaluated = [], {}, {}
        log_dir = trainer.log_dir  # a collective (broadcast from rank 0): read here, where every rank is
        self._folder = Path(log_dir) if log_dir else None
        checkpoint = best_checkpoint(trainer, pl_module)
        self._checkpoint = checkpoint if self._verb == "fit" else None
        if checkpoint is not None:
            self._monitor, self._mode = checkpoint.monitor, checkpoint.mode
        else:
            self._monitor, self._mode = getattr(pl_module, "monitor", None), getattr(pl_module, "mode", None) or "min"
        split = "test" if self._verb == "test" else "val"
        if split == "test" and self._monitor and self._monitor.startswith("val/"):
            self._monitor = "test/" + self._monitor.removeprefix("val/")
        chance_rate = getattr(trainer.datamodule, "chance_rate", None)  # a DataModule of this project's
        self._chance = chance_rate(split) if chance_rate is not None and self._verb != "predict" else None
        if self._chance is not None:
            classes = getattr(trainer.datamodule, "classes", None)
            self._chance_class = classes[self._chance.label] if classes else self._chance.label
            self._tips = tips(trainer, pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A resumed fit goes on from the validations of the run it resumes (restored by now)."""
        if self._restored is not None:
            self._history = [*self._restored.get("history", []), *self._history]
            self._metrics = {**self._restored.get("metrics", {}), **self._metrics}
            self._restored = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self._note(trainer, "val/")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._note(trainer, "test/")

    def _note(self, trainer: pl.Trainer, prefix: str) -> None:
        logged = {key: plain(value) for key, value in trainer.callback_metrics.items() if key.startswith(prefix)}
        self._metrics.update(logged)
        if self._monitor in logged:
            self._history.append({"value": logged[self._monitor], **self._trained(trainer)})

    def _trained(self, trainer: pl.Trainer) -> dict[str, int | None]:
        """The optimizer steps done and the epoch: the run's (fit), or the evaluated checkpoint's."""
        if self._verb == "fit":
            return {"step": trainer.global_step, "epoch": trainer.current_epoch}
        return {"step": self._evaluated.get("global_step"), "epoch": self._evaluated.get("epoch")}

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._evaluated = {key: checkpoint.get(key) for key in ("global_step", "epoch")}

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self._history), "metrics": dict(self._metrics)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # every verb restores callbacks from its checkpoint; only a resumed fit goes on from them (on_train_start)
        self._restored = state_dict

    # -- the end ---------------------------------------------------------------------------------------------
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._end(trainer, "finished")

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Lightning calls no ``teardown`` after an exception: the run ends here. A Ctrl-C, SLURM's signals (the
        checkpoint written, :class:`~.preemption.StopOnSignal`) and any other exit are ``interrupted``; an
        exception is ``failed``. A test inside fit that fails is reported once, by the first call."""
        self._depth = 0
        if self._ended:
            return
        failed = isinstance(exception, Exception)
        self._error = one_line(exception) if failed else None
        self._end(trainer, "failed" if failed else "interrupted")

    def _end(self, trainer: pl.Trainer, status: str) -> None:
        if self._ended:
            return
        self._ended = True
        if not trainer.is_global_zero:
            return
        summary = self.summary(trainer, status)
        path = None if self._folder is None else self._folder / FILENAME
        if path is not None:
            try:
                atomic_write(path, lambda file: file.write(json.dumps(summary, indent=2).encode() + b"\n"))
            except OSError as err:  # a full disk must not hide the exception a failed run is ending with
                rank_zero_warn(f"could not write {path}: {err}")
                path = None
        for line in self.table(summary, path):
            rank_zero_info(line)

    def summary(self, trainer: pl.Trainer, status: str) -> dict[str, Any]:
        """The content of ``metrics.json`` (see its schema in docs/training.md)."""
        best, last = self._best(trainer), (dict(self._history[-1]) if self._history else None)
        chance = self._chance
        return {
            "schema": SCHEMA,
            "status": status,
            "verb": self._verb,
            "monitor": self._monitor,
            "mode": self._mode,
            "best": best,
            "last": last,
            "metrics": dict(sorted(self._metrics.items(), key=lambda item: (not item[0].startswith("val/"), item[0]))),
            "chance": None
            if chance is None
            else {"rate": chance.rate, "source": chance.source, "samples": chance.samples, "class": self._chance_class},
            "at_chance": self._at_chance(best),
            **dict(zip(("steps", "epochs"), self._trained(trainer).values())),
            "elapsed_s": round(time.monotonic() - self._start, 1),
            "config": self._config(trainer),
            "error": self._error,
        }

    def _best(self, trainer: pl.Trainer) -> dict[str, Any] | None:
        """The best checkpoint's score and file where it keeps the monitored metric (its state survives a resume),
        with the step and epoch of the validation that scored it; otherwise the best finite value logged."""
        scored = [entry for entry in self._history if entry["value"] is not None]
        checkpoint = self._checkpoint
        if checkpoint is not None and checkpoint.best_model_score is not None and checkpoint.best_model_path:
            value = plain(checkpoint.best_model_score)
            found = next((entry for entry in scored if entry["value"] == value), None)
            step, epoch = (found["step"], found["epoch"]) if found else (None, None)
            return {
                "value": value,
                "step": step,
                "epoch": epoch,
                "checkpoint": self._relative(checkpoint.best_model_path),
            }
        if not scored:
            return None
        pick = max if self._mode == "max" else min
        best = dict(pick(scored, key=lambda entry: entry["value"]))  # the first of equal values, as ModelCheckpoint
        evaluated = trainer.ckpt_path if self._verb != "fit" else None
        return {**best, "checkpoint": self._relative(evaluated) if evaluated else None}

    def _at_chance(self, best: dict[str, Any] | None) -> bool | None:
        """Whether the best accuracy is within :data:`NOISE_SE` standard errors of the chance rate, or below it;
        None where either is unknown or the monitored metric is not the accuracy."""
        chance = self._chance
        if chance is None or best is None or best["value"] is None or self._monitor.rpartition("/")[2] != ACCURACY:
            return None
        return best["value"] <= chance.rate + NOISE_SE * chance.standard_error()

    def _relative(self, path: str) -> str:
        """``path`` relative to the run's folder where it lies inside it (``checkpoints/best-epoch003.ckpt``), else
        absolute (the checkpoint an evaluation folder's run evaluated)."""
        resolved = Path(path).resolve()
        if self._folder is not None and resolved.is_relative_to(self._folder.resolve()):
            return str(resolved.relative_to(self._folder.resolve()))
        return str(resolved)

    def _config(self, trainer: pl.Trainer) -> str | None:
        """The config this run saved (``config.yaml``; ``config.1.yaml``... for a resumed run), if it saved one."""
        saving = next((cb for cb in trainer.callbacks if isinstance(cb, SaveConfigCallback)), None)
        if saving is None or self._folder is None or not (self._folder / saving.config_filename).is_file():
            return None
        return saving.config_filename

    # -- what the user reads ---------------------------------------------------------------------------------
    def table(self, summary: dict[str, Any], path: Path | None) -> list[str]:
        """The lines printed at the end: a header, the monitored metric's best and last, the other metrics, the best
        checkpoint, the file written, and the chance line where the accuracy ended at chance."""
        lines = [headline(summary)]
        rows = []
        best, last, monitor = summary["best"], summary["last"], summary["monitor"]
        if monitor is not None and (best or last):
            rows.append((f"{monitor} ({summary['mode']})", scored(best), scored(last)))
        rows += [(key, "", number(value)) for key, value in summary["metrics"].items() if key != monitor]
        if rows:
            header = ("metric", "best (step, epoch)", "last (step, epoch)")
            widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
            for row in [header, *rows]:
                lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
        chance = summary["chance"]
        if chance is not None:
            lines.append(f"  chance rate: {number(chance['rate'])} ({chance['source']})")
        if best is not None and best.get("checkpoint"):
            lines.append(
                f"  best checkpoint: {self._folder / best['checkpoint'] if self._folder else best['checkpoint']}"
            )
        if path is not None:
            lines.append(f"  written: {path}")
        if summary["at_chance"] and summary["verb"] == "fit":
            lines.append(self.chance_line(summary))
        return lines

    def chance_line(self, summary: dict[str, Any]) -> str:
        """One line: the accuracy ended at (or below) the chance rate, and concrete things to try."""
        chance, best = summary["chance"], summary["best"]["value"]
        where = "below" if best < chance["rate"] - NOISE_SE * self._chance.standard_error() else "at"
        return (
            f"{summary['monitor']} ended {where} the chance rate ({chance['rate']:.3f}, {chance['source']}): "
            f"best {best:.3f}; try {'; '.join(self._tips)}"
        )


def best_checkpoint(trainer: pl.Trainer, pl_module: pl.LightningModule) -> ModelCheckpoint | None:
    """The ModelCheckpoint that keeps the best value of a metric, the task's ``monitor`` first (as the test after
    fit chooses it); None without one."""
    keeping = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.monitor]
    keeping.sort(key=lambda cb: cb.monitor != getattr(pl_module, "monitor", None))
    return keeping[0] if keeping else None


def tips(trainer: pl.Trainer, pl_module: pl.LightningModule) -> list[str]:
    """What to try when the accuracy stays at chance, with the options this run has: lighter augmentation (an
    image data module whose training augmentation, given or chosen from the data, has RandAugment or random erasing
    on), a lower learning rate, more epochs, and softmax
    attention to tell the activation's part from the recipe's."""
    found = []
    data = trainer.datamodule
    augment = getattr(data, "recipe", None) or getattr(data, "augment", None)  # the recipe in use, given or chosen
    if getattr(augment, "auto_augment", None) or getattr(augment, "re_prob", 0):
        found.append("lighter augmentation on small data (--data.augment.auto_augment null --data.augment.re_prob 0)")
    hparams = getattr(pl_module, "hparams", {})
    optim = hparams.get("optim")
    lr = optim.get("lr") if isinstance(optim, dict) else getattr(optim, "lr", None)
    found.append(
        f"a lower learning rate (--model.optim.lr {lr / 10:g}; this run: {lr:g})" if lr else "a lower learning rate"
    )
    if trainer.max_epochs is not None and trainer.max_epochs > 0:
        found.append(f"more epochs (--trainer.max_epochs {3 * trainer.max_epochs}; this run: {trainer.max_epochs})")
    elif trainer.max_steps > 0:
        found.append(f"more steps (--trainer.max_steps {3 * trainer.max_steps}; this run: {trainer.max_steps})")
    attention = hparams.get("attention")
    name = attention if isinstance(attention, str) or attention is None else dict(attention).get("name")
    if name not in (None, "softmax"):
        found.append(f"softmax attention to compare (--model.attention softmax; this run: {name})")
    return found


def plain(value: Any) -> float | None:
    """A logged value as a plain float; None for NaN and infinities, which JSON has no numbers for."""
    value = float(value)
    return value if math.isfinite(value) else None


def one_line(exception: BaseException) -> str:
    """``Type: first line of the message``."""
    message = str(exception).strip().splitlines()
    return f"{type(exception).__name__}: {message[0]}" if message else type(exception).__name__


def number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def scored(entry: dict[str, Any] | None) -> str:
    if entry is None:
        return ""
    where = "" if entry.get("step") is None else f" ({entry['step']}, {entry['epoch']})"
    return number(entry["value"]) + where


def headline(summary: dict[str, Any]) -> str:
    """``fit finished: 150 steps, 5 epochs, 40.2 s``; an evaluation names the checkpoint's step and epoch; a failed
    run ends with its error."""
    if summary["verb"] == "fit":
        counted = f"{summary['steps']} steps, {summary['epochs']} epochs"
    else:
        counted = f"a checkpoint of step {summary['steps']}, epoch {summary['epochs']}"
    line = f"{summary['verb']} {summary['status']}: {counted}, {summary['elapsed_s']} s"
    return line + (f"; {summary['error']}" if summary["error"] else "")
