"""Test helpers every task family's training tests share: a quiet CPU trainer and a simulated preemption.

On ``sys.path`` through ``pythonpath = ["tests"]`` in pyproject.toml (and ``PYTHONPATH`` for the
torchrun workers), so any test directory imports it as ``training_helpers``.
"""
from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

from polyattn_lightning.checkpoint import SafeCheckpointIO


def cpu_trainer(**overrides: Any) -> pl.Trainer:
    """A quiet, deterministic CPU trainer with the project's checkpoint IO; ``overrides`` win."""
    settings: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        deterministic=True,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        plugins=[SafeCheckpointIO()],
    )
    settings.update(overrides)
    return pl.Trainer(**settings)


class Killed(Exception):
    """Stands for the job being preempted."""


class KillAt(Callback):
    """Raises :class:`Killed` before optimizer step ``step`` (None: never), as a preemption would stop the run."""

    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed
