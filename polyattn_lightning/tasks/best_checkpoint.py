"""Testing the best checkpoint at the end of ``fit``: a callback every task with ``test_after_fit`` gets from the
task base (its ``configure_callbacks``), so a run made with a plain ``Trainer`` tests as a CLI run does.

The checkpoint is the best one by the task's ``monitor`` (the CLI's best-checkpoint callback keeps it by that
metric), else by the first checkpoint callback that monitors something; the test names its file explicitly. When
none was saved, the weights at the end of training are saved to ``end_of_fit.ckpt`` in the run's folder and tested
from there, also by an explicit path: under SLURM Lightning resolves ``ckpt_path=None`` to the newest requeue
("hpc") checkpoint. Callbacks' ``on_fit_end`` runs before the task's, so the task's own (the HF export) sees the
tested weights.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn


class BestCheckpointTest(Callback):
    """``trainer.test`` of the best checkpoint at the end of ``fit``, when the trainer has data (see the module
    docstring). Afterwards the task holds the tested weights, not the last step's."""

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.datamodule is None:
            return
        keeping = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.monitor]
        keeping.sort(key=lambda cb: cb.monitor != getattr(pl_module, "monitor", None))
        best = next((cb for cb in keeping if cb.best_model_path), None)
        if best is not None:
            score = best.best_model_score
            rank_zero_info(
                f"testing the best checkpoint by {best.monitor}: {best.best_model_path}"
                + (f" ({best.monitor} {float(score):.4f})" if score is not None else "")
            )
            trainer.test(pl_module, datamodule=trainer.datamodule, ckpt_path=best.best_model_path)
            return
        # in the run's folder (the working directory only without a logger), where no other run overwrites it
        ckpt_path = os.path.join(trainer.log_dir or trainer.default_root_dir, "checkpoints", "end_of_fit.ckpt")
        rank_zero_warn(f"no best checkpoint was saved: testing the weights at the end of training ({ckpt_path})")
        trainer.save_checkpoint(ckpt_path)
        trainer.test(pl_module, datamodule=trainer.datamodule, ckpt_path=ckpt_path)
