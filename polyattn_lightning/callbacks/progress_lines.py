"""Training progress as lines, for runs whose output is a file: the standard ``--progress_lines``.

A progress bar redraws one line of a terminal; where stdout is not a terminal (a SLURM job's output file, a pipe) or
the run has no bar (``--trainer.enable_progress_bar false``), a run said nothing between its start and its end
(Rich's bar writes to a file only when it stops). This callback says, there, a line every ``every_n_steps`` optimizer
steps or every ``every_seconds`` seconds, whichever comes first::

    train: step 120/1000 (epoch 3), loss 0.6931, 2.41 steps/s, about 6.1 min left

(the total from ``max_steps``/``max_epochs``: Lightning's ``estimated_stepping_batches``; the rate over this run's
steps, so a resumed run's first line is not inflated by the steps it resumed from), and, from a timer thread, a
heartbeat while a single training step or validation pass runs longer than ``heartbeat_seconds``::

    train: step 121 running for 45 s

Lines go to stderr and to the run's ``run.log`` (:func:`polyattn_lightning.waits.say`), from rank 0.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback

from ..errors import ConfigError
from ..waits import Ticker, duration, is_terminal, say


class ProgressLines(Callback):
    """Progress lines where no progress bar shows the run (see the module docstring). ``always``: also when one does
    (a terminal with a bar), as in a run that wants them in ``run.log`` too."""

    def __init__(
        self,
        every_n_steps: int = 50,
        every_seconds: float = 30.0,
        heartbeat_seconds: float = 30.0,
        always: bool = False,
    ):
        bad = {
            name: value
            for name, value, ok in (
                ("every_n_steps", every_n_steps, every_n_steps >= 1),
                ("every_seconds", every_seconds, every_seconds > 0),
                ("heartbeat_seconds", heartbeat_seconds, heartbeat_seconds > 0),
            )
            if not ok
        }
        if bad:
            raise ConfigError(
                "progress_lines: every_n_steps must be >= 1, every_seconds and heartbeat_seconds > 0; got "
                + ", ".join(f"{name}={value}" for name, value in bad.items())
            )
        self.every_n_steps, self.every_seconds = every_n_steps, every_seconds
        self.heartbeat_seconds, self.always = heartbeat_seconds, always
        self._ticker: Ticker | None = None
        self._busy: str | None = None  # what runs now (a step, a validation), for the heartbeat
        self._busy_since = self._last_line = self._start = 0.0
        self._start_step = self._last_step = 0
        self._total: int | float = float("inf")

    def active(self, trainer: pl.Trainer) -> bool:
        """Whether this run gets the lines: ``always``, no progress bar, or a stdout that is not a terminal."""
        return self.always or trainer.progress_bar_callback is None or not is_terminal(sys.stdout)

    def _say(self, line: str) -> None:
        say(line)
        self._last_line = time.perf_counter()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.active(trainer) or not trainer.is_global_zero:
            return
        self._start = self._last_line = time.perf_counter()
        self._start_step = self._last_step = trainer.global_step
        self._total = trainer.estimated_stepping_batches  # inf where neither max_steps nor max_epochs bounds it
        self._ticker = Ticker(min(1.0, self.heartbeat_seconds / 2), self._heartbeat, name="polyattn-progress").start()

    def _stop(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None
        self._busy = None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._stop()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._stop()

    def _begin(self, what: str) -> None:
        self._busy, self._busy_since = what, time.perf_counter()

    def _heartbeat(self) -> None:
        busy, now = self._busy, time.perf_counter()
        if busy is not None and now - max(self._busy_since, self._last_line) >= self.heartbeat_seconds:
            self._say(f"train: {busy} running for {duration(now - self._busy_since)}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int):
        if self._ticker is not None:
            self._begin(f"step {trainer.global_step + 1}")

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._ticker is None:
            return
        self._busy = None
        step, now = trainer.global_step, time.perf_counter()
        if step == self._last_step or (
            step - self._last_step < self.every_n_steps and now - self._last_line < self.every_seconds
        ):
            return
        self._last_step = step
        self._say(self.line(trainer, outputs, step, now))

    def line(self, trainer: pl.Trainer, outputs: Any, step: int, now: float) -> str:
        """``train: step 120/1000 (epoch 3), loss 0.6931, 2.41 steps/s, about 6.1 min left``."""
        total = self._total
        known = total != float("inf")
        text = f"train: step {step}{f'/{int(total)}' if known else ''} (epoch {trainer.current_epoch})"
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            text += f", loss {loss.item():.4g}"
        rate = (step - self._start_step) / max(now - self._start, 1e-9)
        if rate > 0:
            text += f", {rate:.3g} steps/s"
            if known:
                text += f", about {duration(max(int(total) - step, 0) / rate)} left"
        return text

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ticker is not None and not trainer.sanity_checking:
            self._begin(f"validation after step {trainer.global_step}")

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._ticker is not None:
            self._busy = None
