"""Never train on a NaN or inf loss: stop the run, or skip the step, for any LightningModule."""

from __future__ import annotations

from typing import Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.optim import Optimizer


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or inf; the message names the step."""


class NonFiniteLossGuard(Callback):
    """Checks every training loss before its backward pass.

    ``on_nonfinite="raise"`` (the default) stops the run with :class:`NonFiniteLossError`
    naming the global step, epoch and batch. ``"skip"`` warns and drops the step's
    gradients (set to None, so the optimizer leaves every weight and its moments
    as they were); training goes on with the next batch. With gradient
    accumulation the whole accumulated step is dropped.

    The decision is reduced across ranks (one non-finite rank is enough), so DDP
    replicas stay identical and no rank is left waiting in a collective. A finite
    loss with inf gradients under fp16 is the gradient scaler's business, not this
    callback's.
    """

    def __init__(self, on_nonfinite: Literal["raise", "skip"] = "raise"):
        if on_nonfinite not in ("raise", "skip"):
            raise ValueError(f"on_nonfinite must be 'raise' or 'skip', got {on_nonfinite!r}")
        self.on_nonfinite = on_nonfinite
        self._batch_idx = 0
        self._drop_gradients = False

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self._batch_idx = batch_idx

    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        local = not bool(torch.isfinite(loss.detach()).all())
        if not trainer.strategy.reduce_boolean_decision(local, all=False):
            return
        where = f"global step {trainer.global_step} (epoch {trainer.current_epoch}, batch {self._batch_idx})"
        if self.on_nonfinite == "raise":
            raise NonFiniteLossError(
                f"non-finite training loss at {where}"
                + (f": loss = {loss.detach().float().item()}" if local else " on another rank")
                + ". Lower the learning rate, check the data, resume from the last checkpoint,"
                " or set NonFiniteLossGuard(on_nonfinite='skip') to skip such steps."
            )
        rank_zero_warn(f"non-finite training loss at {where}: skipping this optimizer step")
        self._drop_gradients = True

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if self._drop_gradients:
            optimizer.zero_grad(set_to_none=True)
            self._drop_gradients = False
