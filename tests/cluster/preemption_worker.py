"""A SLURM job of the tiny classifier, preempted by a real signal at a chosen point, and its requeued restart.

One task of a job: ``SLURM_*`` variables in the environment (set by the test, one process per task,
no torchrun), a stand-in ``scontrol`` on PATH. In a 2-task job each task runs

    PYTHONPATH=tests python preemption_worker.py ROOT OUT WHERE SIGNAL RANKS

and saves what the test compares to OUT (rank 0). WHERE names the point at which the task sends
itself SIGNAL (``none``: an uninterrupted run); RANKS (e.g. ``0``, ``1``, ``0,1``) which tasks do.
The restart runs the same command with WHERE ``none``; ``fit(ckpt_path=None)`` finds the hpc
checkpoint by itself as Lightning does under SLURM, or the test passes CKPT as a 6th argument.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from cluster_harness import MemoryLogger, RecordBatches, augmented_digits, tiny_classifier
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import ExactResume, StopOnSignal
from polyattn_lightning.rng import capture_rng_state
from polyattn_lightning.checkpoint import SafeCheckpointIO
from polyattn_lightning.distributed import distributed_teardown, gather_objects
from polyattn_lightning.sharding import ShardedStrategy, full_state_dict

STEPS_PER_EPOCH, EPOCHS, VAL_BATCHES = 4, 3, 3
SIGNAL_STEP = 5  # epoch 1, batch 1


class RecordValidation(Callback):
    """The validation passes that ran to their end: (global step, logged val/loss)."""

    def __init__(self) -> None:
        self.passes: list[tuple[int, float]] = []

    def on_validation_epoch_end(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self.passes.append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))


class SendSignal(Callback):
    """Sends this process ``signum`` (``times`` in a row: an insisting Ctrl-C) once, at ``where``:

    * ``mid_step``: after backward, before the optimizer step of step SIGNAL_STEP (``first_step``: of step 0;
      ``last_step_of_epoch``: of the last step of epoch 0, whose validation is due after it);
    * ``validation``: between the first and second batch of the validation at the end of epoch 0;
    * ``epoch_boundary``: at the start of epoch 1, before its first batch (``epoch_2_boundary``: of epoch 2);
    * ``checkpoint_write``: while last.ckpt is written at the end of epoch 0 (by :class:`SignallingIO`).
    """

    def __init__(self, where: str, signum: int, times: int = 1) -> None:
        self.where, self.signum, self.times, self.sent = where, signum, times, False

    def send(self) -> None:
        if not self.sent:
            self.sent = True
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_after_backward(self, trainer, pl_module) -> None:
        steps = {"mid_step": SIGNAL_STEP, "first_step": 0, "last_step_of_epoch": STEPS_PER_EPOCH - 1}
        if trainer.global_step == steps.get(self.where):
            self.send()

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if self.where == "validation" and not trainer.sanity_checking and trainer.current_epoch == 0 and batch_idx == 0:
            self.send()

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if (self.where, trainer.current_epoch) in (("epoch_boundary", 1), ("epoch_2_boundary", 2)):
            self.send()


class SignallingIO(SafeCheckpointIO):
    """The project's checkpoint IO, sending the signal from its test hook: the file written, not yet renamed."""

    def __init__(self, sender: SendSignal | None) -> None:
        super().__init__()
        self.sender = sender

    def on_written(self, path: Path) -> None:
        if self.sender is not None and self.sender.where == "checkpoint_write" and path.name == "last.ckpt":
            self.sender.send()


def train(root: Path, where: str = "none", signum: int = signal.SIGUSR1, ranks: tuple[int, ...] = (0,),
          ckpt_path: str | None = None, kill_wait: float = 30.0) -> dict | None:
    """Fit 3 epochs of 4 steps as one task of the job; None when the run was stopped by the signal."""
    world = int(os.environ["SLURM_NTASKS"])
    rank = int(os.environ["SLURM_PROCID"])
    pl.seed_everything(0, workers=True)
    model, logger = tiny_classifier(mixup=True, drop_path=0.1), MemoryLogger()
    record, validation = RecordBatches(), RecordValidation()
    sender = SendSignal(where, signum) if rank in ranks and where != "none" else None
    trainer = cpu_trainer(
        devices=world,
        strategy=DDPStrategy(process_group_backend="gloo") if world > 1 else "auto",
        default_root_dir=root,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=VAL_BATCHES,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=True,
        plugins=[SignallingIO(sender)],
        callbacks=[ExactResume(), StopOnSignal(kill_wait=kill_wait), record, validation,
                   *([sender] if sender else []), ModelCheckpoint(dirpath=root / "checkpoints", save_last=True)],
    )
    try:
        trainer.fit(model, augmented_digits(batch_size=32 // world), ckpt_path=ckpt_path)
    except SIGTERMException:
        return None
    return outcome(trainer, logger, record, validation)


def outcome(trainer: pl.Trainer, logger: MemoryLogger, record: RecordBatches, validation: RecordValidation) -> dict:
    """What a resumed run must end with as the uninterrupted one does (every rank calls it): the whole weights and
    optimizer state (gathered under the sharded strategy), lr schedule, every rank's RNG states, and rank 0's batches,
    losses and validation passes."""
    model, optimizer = trainer.lightning_module, trainer.optimizers[0]
    if isinstance(trainer.strategy, ShardedStrategy):
        full = StateDictOptions(full_state_dict=True, cpu_offload=True)
        optimizer_state = get_optimizer_state_dict(model, optimizer, options=full)
    else:
        optimizer_state = optimizer.state_dict()
    return {
        "weights": {key: value.detach().cpu().clone() for key, value in full_state_dict(model).items()},
        "optimizer": optimizer_state,
        "lr_schedule": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "rng": capture_all_rng(),
        "batches": record.seen,
        "loss": logger.history.get("train/loss", {}),
        "validation": validation.passes,
        "start_step": record.seen[0][0] if record.seen else None,
    }


def capture_all_rng() -> list:
    """Every rank's RNG states at the end, in rank order (as a checkpoint holds them)."""
    return gather_objects(capture_rng_state())


@distributed_teardown()
def main(root: str, out: str, where: str, signame: str, ranks: str, ckpt_path: str | None = None) -> None:
    result = train(Path(root), where, getattr(signal, signame), tuple(int(r) for r in ranks.split(",")), ckpt_path)
    if int(os.environ["SLURM_PROCID"]) == 0:
        torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:])
