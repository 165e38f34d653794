"""SLURM preemption without a lost or repeated batch: the signal is only noted; the save waits for a step boundary.

Lightning 2.6 saves ``hpc_ckpt_<n>.ckpt`` inside its requeue-signal handler, wherever the
signal lands: between backward and the optimizer step the checkpoint holds a half-done step
whose batch the requeued job never trains, and under DDP the save's barrier can meet a
collective in flight. With auto-requeue its SIGTERM handler only logs, so a plain SIGTERM
(preemption without ``--signal``, ``scancel``) saves nothing.
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
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from ..errors import ConfigError

#: Lightning's name for requeue checkpoints: with ``ckpt_path=None`` under SLURM, ``fit`` resumes from the newest one.
HPC_PATTERN = re.compile(r"hpc_ckpt_(\d+)\.ckpt")
#: The checkpoint's val-loop progress key (Lightning's loop state layout).
_VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"


class SlurmPreemption(Callback):
    """Exact SLURM requeue and SIGTERM handling, replacing Lightning's in-handler save.

    Active only when the trainer runs in Lightning's ``SLURMEnvironment`` (a job started by
    ``srun``); elsewhere it does nothing and costs nothing.

    * The requeue signal (``--signal=SIGUSR1@90``; ``SLURMEnvironment.requeue_signal``) and
      SIGTERM only set a flag: no I/O, collective or barrier runs in a signal handler.
    * At every training-step boundary (``on_train_batch_end``: the optimizer step done, the
      loop counters where Lightning's own step checkpoints have them) the ranks agree on the
      flags with one small all-reduce (max: a signal any rank got counts), so all ranks act at
      the same step. Then: an atomic ``hpc_ckpt_<n+1>.ckpt`` in ``default_root_dir`` (older
      ones are deleted once it is complete), ``scontrol requeue $SLURM_JOB_ID`` for the
      requeue signal with auto-requeue, and the run exits (``SIGTERMException``). The
      requeued job's ``fit`` finds the checkpoint by itself and continues exactly: no batch
      skipped or trained twice.
    * During validation the flags are agreed after every validation batch; a signal there
      ends the pass. The checkpoint is of the state before it (validation changes no
      training state) and marks the pass as not yet run, so the requeued job runs it again
      in full before the next step.
    * SIGTERM (SLURM kills after ``KillWait``, 30 s by default): the checkpoint is written
      only if the step boundary came soon enough that the write, timed by the last one, ends
      within ``kill_wait`` seconds of the signal; otherwise the run exits at once and the
      requeued job resumes from the last complete checkpoint.

    The ``--signal`` lead time a run needs: one training step plus one checkpoint write
    (docker/README.md has measured numbers).
    """

    def __init__(self, kill_wait: float = 30.0) -> None:
        if kill_wait <= 0:
            raise ConfigError(f"SlurmPreemption: kill_wait must be > 0 seconds (SLURM's KillWait), got {kill_wait}")
        self.kill_wait = kill_wait
        self._environment: SLURMEnvironment | None = None
        self._requeue_signal: int | None = None
        self._got_requeue_signal = False
        self._sigterm_at: float | None = None
        self._last_write_s = 0.0
        self._rewind_validation = False
        self._validation_start: dict[str, Any] | None = None

    # -- signals ---------------------------------------------------------------------------------------------
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # the environment Lightning's own signal connector consults (one-device strategies have no attribute for it)
        environment = trainer._accelerator_connector.cluster_environment
        self._environment = environment if isinstance(environment, SLURMEnvironment) else None

    def on_sanity_check_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._install()

    def _install(self) -> None:
        """Replace the handlers Lightning registered just before (its own are put back at the trainer's teardown)."""
        if self._environment is None or threading.current_thread() is not threading.main_thread():
            return
        if self._environment.auto_requeue and self._environment.requeue_signal is not None:
            self._requeue_signal = self._environment.requeue_signal
            signal.signal(self._requeue_signal, self._note_requeue_signal)
        signal.signal(signal.SIGTERM, self._note_sigterm)

    def _note_requeue_signal(self, signum: int, frame: Any) -> None:
        self._got_requeue_signal = True

    def _note_sigterm(self, signum: int, frame: Any) -> None:
        if self._sigterm_at is None:
            self._sigterm_at = time.monotonic()

    # -- step and validation boundaries ----------------------------------------------------------------------
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._environment is not None:
            self._act(trainer, mid_validation=False)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._environment is not None and _fitting(trainer):
            self._validation_start = trainer.fit_loop.epoch_loop.val_loop.batch_progress.state_dict()

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._environment is not None and _fitting(trainer):
            self._act(trainer, mid_validation=True)

    def _act(self, trainer: pl.Trainer, mid_validation: bool) -> None:
        requeue, sigterm, too_late = self._agree(trainer)
        if not (requeue or sigterm):
            return
        if requeue or not too_late:
            self._rewind_validation = mid_validation
            try:
                self._save(trainer)
            finally:
                self._rewind_validation = False
        else:
            rank_zero_warn(
                f"SIGTERM came too late to write a checkpoint within kill_wait={self.kill_wait} s: exiting;"
                " the requeued job resumes from the last complete checkpoint"
            )
        if requeue and trainer.is_global_zero:
            _requeue()
        raise SIGTERMException

    def _agree(self, trainer: pl.Trainer) -> tuple[bool, bool, bool]:
        """(requeue signal, SIGTERM, too late for a SIGTERM checkpoint), each true if it is on any rank."""
        too_late = self._sigterm_at is not None and (
            time.monotonic() - self._sigterm_at + self._last_write_s > self.kill_wait
        )
        flags = [self._got_requeue_signal, self._sigterm_at is not None, too_late]
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            tensor = torch.tensor(flags, dtype=torch.int32, device=trainer.strategy.root_device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            flags = [bool(flag) for flag in tensor.tolist()]
        return flags[0], flags[1], flags[2]

    # -- the checkpoint --------------------------------------------------------------------------------------
    def _save(self, trainer: pl.Trainer) -> None:
        folder = Path(trainer.default_root_dir)
        path = trainer.strategy.broadcast(str(folder / f"hpc_ckpt_{max(_hpc_numbers(folder), default=0) + 1}.ckpt"))
        start = time.monotonic()
        trainer.save_checkpoint(path)  # atomic with SafeCheckpointIO and the sharded strategy; ends in a barrier
        self._last_write_s = time.monotonic() - start
        if trainer.is_global_zero:
            for number in _hpc_numbers(folder):
                if folder / f"hpc_ckpt_{number}.ckpt" != Path(path):  # a file, or a sharded strategy's folder
                    trainer.strategy.remove_checkpoint(folder / f"hpc_ckpt_{number}.ckpt")
        rank_zero_info(f"saved {path} at step {trainer.global_step} in {self._last_write_s:.1f} s")

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A save during validation records the pass as started but not run, so the resumed job runs all of it.

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
