"""A run stopped from outside loses no work and repeats no batch: a signal is only noted; the checkpoint waits for the
next training-step boundary, which every rank agrees on.

Ctrl-C (SIGINT), under every strategy: Lightning 2.6 alone raises ``KeyboardInterrupt`` wherever the signal lands,
runs ``on_exception`` and exits with status 1, saving nothing (its save-on-exception callbacks would save a half-done
step, running collectives mid-step), so an interrupt loses everything since the last validation. SLURM's signals:
Lightning saves ``hpc_ckpt_<n>.ckpt`` inside its requeue-signal handler, wherever the signal lands: between backward
and the optimizer step the checkpoint holds a half-done step whose batch the requeued job never trains, and under
DDP the save's barrier can meet a collective in flight. With auto-requeue its SIGTERM handler only logs, so a plain
SIGTERM (preemption without ``--signal``, ``scancel``) saves nothing.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from .. import deprecated
from ..errors import ConfigError

#: Lightning's name for requeue checkpoints: with ``ckpt_path=None`` under SLURM, ``fit`` resumes from the newest one.
HPC_PATTERN = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
#: The checkpoint's val-loop progress key (Lightning's loop state layout).
_VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"
#: Exit status of a run stopped by Ctrl-C: 128 + SIGINT, what a shell reports for a program that SIGINT ended.
EXIT_INTERRUPTED = 128 + signal.SIGINT
#: A number of validation batches no loader reaches (for a loader of unknown length).
_UNBOUNDED = 2**31 - 1


class Interrupted(SIGTERMException):
    """Raised on every rank once the Ctrl-C checkpoint ``path`` is written; the process exits with
    :data:`EXIT_INTERRUPTED`. A ``SIGTERMException`` (so a ``SystemExit``), as Lightning's own signal stop."""

    def __init__(self, path: str) -> None:
        super().__init__(EXIT_INTERRUPTED)
        self.path = path


class StopOnSignal(Callback):
    """Ctrl-C everywhere, and SLURM's requeue signal and SIGTERM: a checkpoint at the next step boundary, then exit.

    * Every signal only sets a flag: no I/O, collective or barrier runs in a signal handler.
    * At every training-step boundary (``on_train_batch_end`` after an optimizer step: the loop counters where
      Lightning's own step checkpoints have them) the ranks agree on the flags with one small all-reduce (max: a
      signal any rank got counts), so all ranks act at the same step.
    * Ctrl-C (SIGINT, from the first training step to the end of training; a run without a ``ModelCheckpoint``
      keeps Lightning's immediate stop): rank 0 says at once that the run stops at the end of the step. At the
      boundary ``last.ckpt`` is written atomically where the run's ModelCheckpoint writes (the file the docs resume
      from), one line names it with the command that resumes (:attr:`resume_command`), and every rank raises
      :class:`Interrupted`: exit status 130, so nothing counts the run as finished. A second Ctrl-C before the
      checkpoint is written stops at once, without it (Lightning's ``KeyboardInterrupt`` shutdown).
    * Under SLURM (Lightning's ``SLURMEnvironment``, a job started by ``srun``), the requeue signal
      (``--signal=SIGUSR1@90``; ``SLURMEnvironment.requeue_signal``) and SIGTERM write an atomic
      ``hpc_ckpt_<n+1>.ckpt`` in ``default_root_dir`` (older ones are deleted once it is complete), rank 0 runs
      ``scontrol requeue $SLURM_JOB_ID`` for the requeue signal with auto-requeue, and the run exits
      (``SIGTERMException``). The requeued job's ``fit`` finds the checkpoint by itself and continues exactly.
      SIGTERM (SLURM kills after ``KillWait``, 30 s by default): the checkpoint is written only if the step boundary
      came soon enough that the write, timed by the last one, ends within ``kill_wait`` seconds of the signal;
      otherwise the run exits at once and the requeued job resumes from the last complete checkpoint.
    * During validation the flags are agreed after every validation batch that every rank has (evaluation loaders
      may give the ranks different numbers of batches); a signal there ends the pass. The checkpoint is of the state
      before it (validation changes no training state) and marks the pass as not yet run, so the resumed run runs it
      again in full before the next step. A signal at a step after which validation is due waits for that pass's
      first batch (Lightning resumes a checkpoint taken at the step's end past the pass). A Ctrl-C after the last
      step is acted on when training ends. Steps that only accumulate gradients are no boundary.

    Resuming is exact: the same batches, weights, optimizer, lr schedule and RNG states as without the stop. The
    ``--signal`` lead time a SLURM run needs: one training step plus one checkpoint write (docs/howto/slurm.md); under
    torchrun, a Ctrl-C reaches the agent, which forwards it to every rank and kills them
    ``--shutdown_timeout`` (30 s) later.
    """

    def __init__(self, kill_wait: float = 30.0) -> None:
        if kill_wait <= 0:
            raise ConfigError(f"StopOnSignal: kill_wait must be > 0 seconds (SLURM's KillWait), got {kill_wait}")
        self.kill_wait = kill_wait
        #: What the Ctrl-C line tells the user to run, given the checkpoint's path (the CLI sets its command line).
        self.resume_command: Callable[[str], str] | None = None
        self._environment: SLURMEnvironment | None = None
        self._requeue_signal: int | None = None
        self._got_requeue_signal = False
        self._sigterm_at: float | None = None
        self._sigints = 0
        self._sigint_path: str | None = None
        self._previous_sigint: Any = None
        self._sigint_installed = False
        self._says = False
        self._last_write_s = 0.0
        self._rewind_validation = False
        self._validation_start: dict[str, Any] | None = None
        self._common_val_batches: list[int] = []

    # -- signals ---------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the environment Lightning's own signal connector consults (one-device strategies have no attribute for it)
        environment = trainer._accelerator_connector.cluster_environment
        self._environment = environment if isinstance(environment, SLURMEnvironment) else None

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install_slurm()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install_slurm()
        self._install_sigint(trainer)

    def _install_slurm(self) -> None:
        """Replace the handlers Lightning registered just before (its own are put back at the trainer's teardown)."""
        if self._environment is None or threading.current_thread() is not threading.main_thread():
            return
        if self._environment.auto_requeue and self._environment.requeue_signal is not None:
            self._requeue_signal = self._environment.requeue_signal
            signal.signal(self._requeue_signal, self._note_requeue_signal)
        signal.signal(signal.SIGTERM, self._note_sigterm)

    def _install_sigint(self, trainer: pl.Trainer) -> None:
        self._sigints, self._sigint_path = 0, interrupt_path(trainer)
        if self._sigint_path is None or threading.current_thread() is not threading.main_thread():
            return
        self._says = trainer.is_global_zero
        self._previous_sigint = signal.signal(signal.SIGINT, self._note_sigint)
        self._sigint_installed = True

    def _note_requeue_signal(self, signum: int, frame: Any) -> None:
        self._got_requeue_signal = True

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()

    def _note_sigint(self, signum: int, frame: Any) -> None:
        self._sigints += 1
        if self._sigints == 1:
            self._say(
                "Ctrl-C: stopping at the end of this training step, after writing a checkpoint "
                "(Ctrl-C again: stop now, without one)"
            )
            return
        newest = f"; the newest is {self._sigint_path}" if os.path.exists(self._sigint_path) else ""
        self._say(f"Ctrl-C again: stopping now; no checkpoint written{newest}")
        self._uninstall_sigint()
        raise KeyboardInterrupt

    def _say(self, line: str) -> None:
        """A line on stderr from the signal handler: one unbuffered write (a buffered stream may be mid-write)."""
        if self._says:
            os.write(2, f"\n{line}\n".encode())

    def _uninstall_sigint(self) -> None:
        """Put back the SIGINT handler this callback replaced (Python's: ``KeyboardInterrupt`` at once)."""
        if self._sigint_installed:
            previous = self._previous_sigint
            signal.signal(signal.SIGINT, signal.default_int_handler if previous is None else previous)
            self._sigint_installed = False

    # -- step and validation boundaries ----------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.fit_loop._should_accumulate():
            return  # not a step boundary: gradients are half accumulated
        # a checkpoint taken here resumes past the validation due after this step: the signal waits for its first batch
        due = trainer.fit_loop.epoch_loop._should_check_val_fx(trainer.fit_loop._data_fetcher)
        self._act(trainer, mid_validation=False, validation_due=due)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if _fitting(trainer):
            self._validation_start = trainer.fit_loop.epoch_loop.val_loop.batch_progress.state_dict()
            counts = [_UNBOUNDED if n == float("inf") else int(n) for n in trainer.num_val_batches]
            self._common_val_batches = _reduce(trainer, counts, dist.ReduceOp.MIN)

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if _fitting(trainer) and batch_idx < self._common_val_batches[dataloader_idx]:
            self._act(trainer, mid_validation=True)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A Ctrl-C after the last step boundary: the run still stops with its checkpoint and status 130."""
        try:
            if self._agree(trainer)[3]:
                self._interrupt(trainer, mid_validation=False)
        finally:
            self._uninstall_sigint()

    def _act(self, trainer: pl.Trainer, mid_validation: bool, validation_due: bool = False) -> None:
        requeue, sigterm, too_late, sigint, validation_due = self._agree(trainer, validation_due)
        if validation_due:
            return
        if requeue or sigterm:
            self._preempt(trainer, mid_validation, requeue, too_late)
        if sigint:
            self._interrupt(trainer, mid_validation)

    def _agree(self, trainer: pl.Trainer, validation_due: bool = False) -> tuple[bool, ...]:
        """(requeue signal, SIGTERM, too late for a SIGTERM checkpoint, Ctrl-C, validation due), each true if it is
        on any rank."""
        too_late = self._sigterm_at is not None and (
            time.monotonic() - self._sigterm_at + self._last_write_s > self.kill_wait
        )
        flags = [self._got_requeue_signal, self._sigterm_at is not None, too_late, self._sigints > 0, validation_due]
        return tuple(bool(flag) for flag in _reduce(trainer, flags, dist.ReduceOp.MAX))

    # -- what each signal does -------------------------------------------------------------------------------
    def _preempt(self, trainer: pl.Trainer, mid_validation: bool, requeue: bool, too_late: bool) -> None:
        if requeue or not too_late:
            folder = Path(trainer.default_root_dir)
            path = self._save(
                trainer, str(folder / f"hpc_ckpt_{max(_hpc_numbers(folder), default=0) + 1}.ckpt"), mid_validation
            )
            if trainer.is_global_zero:
                for number in _hpc_numbers(folder):
                    if folder / f"hpc_ckpt_{number}.ckpt" != Path(path):  # a file, or a sharded strategy's folder
                        trainer.strategy.remove_checkpoint(folder / f"hpc_ckpt_{number}.ckpt")
            rank_zero_info(f"saved {path} at step {trainer.global_step} in {self._last_write_s:.1f} s")
        else:
            rank_zero_warn(
                f"SIGTERM came too late to write a checkpoint within kill_wait={self.kill_wait} s: exiting;"
                " the requeued job resumes from the last complete checkpoint"
            )
        if requeue and trainer.is_global_zero:
            _requeue()
        raise SIGTERMException

    def _interrupt(self, trainer: pl.Trainer, mid_validation: bool) -> None:
        path = self._save(trainer, self._sigint_path, mid_validation)
        self._uninstall_sigint()
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # written: the rest is the exit (teardown restores it)
        rerun = " (the validation it cut short runs again first)" if mid_validation else ""
        resume = self.resume_command(path) if self.resume_command else f"fit(..., ckpt_path={path!r})"
        rank_zero_info(f"Ctrl-C: saved {path} at step {trainer.global_step}{rerun}; resume with: {resume}")
        raise Interrupted(path)

    def _save(self, trainer: pl.Trainer, path: str, mid_validation: bool) -> str:
        """Every rank: write the checkpoint ``path`` (rank 0's); ``mid_validation``: the pass marked as not run."""
        path = trainer.strategy.broadcast(path)
        self._rewind_validation = mid_validation
        start = time.monotonic()
        try:
            # atomic with SafeCheckpointIO and the sharded strategy; ends in a barrier
            trainer.save_checkpoint(path, weights_only=False)
        finally:
            self._rewind_validation = False
        self._last_write_s = time.monotonic() - start
        return path

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A save during validation records the pass as started but not run, so the resumed run runs all of it.

        Lightning resumes a checkpoint whose val loop has one batch started and none processed by going
        back into validation ("restarted mid evaluation"); one taken at a step's end instead skips the
        validation due there. Counters are those from the start of this pass, plus that one batch."""
        if not self._rewind_validation or self._validation_start is None:
            return
        progress = copy.deepcopy(self._validation_start)
        progress["is_last_batch"] = False
        for part in ("total", "current"):
            progress[part]["ready"] += 1
            progress[part]["started"] += 1
        checkpoint["loops"]["fit_loop"][_VAL_PROGRESS] = progress

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._got_requeue_signal, self._sigterm_at = False, None


def interrupt_path(trainer: pl.Trainer) -> str | None:
    """Where a Ctrl-C checkpoint goes: ``last.ckpt`` in the folder of the run's ModelCheckpoint that writes one (the
    standard last checkpoint, or ``save_last``), else of its first ModelCheckpoint; None without one."""
    checkpoints = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint) and c.dirpath]
    writers = [c for c in checkpoints if c.save_last or c.filename == c.CHECKPOINT_NAME_LAST]
    if not checkpoints:
        return None
    chosen = (writers or checkpoints)[0]
    return os.path.join(chosen.dirpath, chosen.CHECKPOINT_NAME_LAST + chosen.FILE_EXTENSION)


def _reduce(trainer: pl.Trainer, values: list[int | bool], op: Any) -> list[int]:
    """``values`` reduced element-wise over the ranks with ``op`` (one small all-reduce; as they are on one rank)."""
    if not (dist.is_available() and dist.is_initialized() and trainer.world_size > 1):
        return [int(value) for value in values]
    tensor = torch.tensor([int(value) for value in values], dtype=torch.int64, device=trainer.strategy.root_device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def _fitting(trainer: pl.Trainer) -> bool:
    return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking


def _hpc_numbers(folder: Path) -> list[int]:
    if not folder.is_dir():
        return []
    return [int(match[1]) for name in os.listdir(folder) if (match := HPC_PATTERN.fullmatch(name))]


def _requeue() -> None:
    """``scontrol requeue`` this job (an array task as ``<array job>_<task>``), as Lightning does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ["SLURM_JOB_ID"]
    result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
    if result.returncode == 0:
        rank_zero_info(f"requeued SLURM job {job}")
    else:
        rank_zero_warn(f"scontrol requeue {job} failed ({result.returncode}): {result.stderr.strip()}")


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
