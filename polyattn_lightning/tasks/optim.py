"""AdamW with per-step warmup, then cosine (DeiT), linear (LRA's one-cycle) or step (mmdet's 3x) decay.

The pieces are timm's (``create_optimizer_v2`` for the weight-decay groups,
``CosineLRScheduler`` / ``PolyLRScheduler`` / ``MultiStepLRScheduler`` for the schedule), stepped by the
number of optimizer updates so that the schedule is the same for any number of devices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Any

import lightning.pytorch as pl
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler, MultiStepLRScheduler, PolyLRScheduler
from timm.scheduler.scheduler import Scheduler
from torch import nn
from torch.optim import Optimizer

from ..checkpoint import checkpoint_safe
from ..errors import ConfigError


@checkpoint_safe
@dataclass
class OptimRecipe:
    """Optimizer and schedule hyperparameters; the defaults are DeiT's.

    Attributes:
        lr: the learning rate at ``reference_batch`` images per optimizer step.
        reference_batch: the lr is multiplied by ``global_batch / reference_batch``
            (DeiT: 512); None uses ``lr`` as given.
        weight_decay: AdamW decay; never applied to norms, biases, position
            embeddings or other parameters the model lists in ``no_weight_decay()``.
        warmup_epochs: linear warmup from ``warmup_lr``, stepped per optimizer update.
        warmup_steps: the warmup in optimizer updates; when set, it replaces ``warmup_epochs``.
        min_lr: the floor the decay reaches at the last step.
        layer_decay: timm's layer-wise lr decay (e.g. 0.65 when fine-tuning); None is off.
        schedule: the decay after warmup: ``cosine`` (DeiT), ``linear`` (with linear warmup,
            the lr shape of PyTorch's ``OneCycleLR(anneal_strategy="linear")`` that LRA recipes use), or
            ``step`` (mmdet's ``MultiStepLR``: x ``decay_rate`` at the start of each of ``decay_epochs``).
        decay_epochs, decay_rate: the ``step`` schedule's milestones (0-based epochs) and factor.
        no_decay_keys: when set, the weight-decay groups of mmdet/mmcv's ``paramwise_cfg.custom_keys``
            with ``decay_mult=0``: exactly the parameters whose name contains one of these strings get
            no decay (biases and other 1-D parameters are decayed). Unset, timm's rule above applies.
    """

    lr: float = 5e-4
    reference_batch: int | None = 512
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    warmup_epochs: float = 5.0
    warmup_lr: float = 1e-6
    min_lr: float = 1e-5
    layer_decay: float | None = None
    warmup_steps: int | None = None
    schedule: str = "cosine"
    decay_epochs: list[int] | None = None
    decay_rate: float = 0.1
    no_decay_keys: list[str] | None = None

    def scaled_lr(self, global_batch: int) -> float:
        """The peak learning rate for ``global_batch`` images per optimizer step."""
        return self.lr if self.reference_batch is None else self.lr * global_batch / self.reference_batch


def global_batch_size(trainer: pl.Trainer, batch_size: int) -> int:
    """Images per optimizer step: batch x devices x nodes x gradient accumulation."""
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches


def build_optimizer(model: nn.Module, recipe: OptimRecipe, lr: float) -> Optimizer:
    """AdamW whose weight decay skips 1-D parameters and ``model.no_weight_decay()``, or, with
    ``recipe.no_decay_keys``, exactly the parameters whose names contain one of those keys."""
    params: nn.Module | list[dict[str, Any]] = model
    if recipe.no_decay_keys is not None:
        if recipe.layer_decay is not None:
            raise ConfigError("the optim recipe sets both no_decay_keys and layer_decay; only one is supported")
        named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        no_decay = [p for name, p in named if any(key in name for key in recipe.no_decay_keys)]
        decay = [p for name, p in named if not any(key in name for key in recipe.no_decay_keys)]
        params = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return create_optimizer_v2(
        params,
        opt="adamw",
        lr=lr,
        weight_decay=recipe.weight_decay,
        betas=recipe.betas,
        eps=recipe.eps,
        layer_decay=recipe.layer_decay,
    )


#: ``OptimRecipe.schedule`` -> the timm scheduler that decays the lr after warmup.
SCHEDULES = {"cosine": CosineLRScheduler, "linear": partial(PolyLRScheduler, power=1.0)}


def build_scheduler(optimizer: Optimizer, recipe: OptimRecipe, total_steps: int, steps_per_epoch: int) -> Scheduler:
    """Linear warmup (``warmup_steps``, else ``warmup_epochs``) then ``recipe.schedule`` down to ``min_lr`` at
    ``total_steps``, in optimizer steps.

    Call ``step_update(num_updates=global_step)`` after every optimizer step.
    """
    if not math.isfinite(total_steps):
        raise ConfigError(
            f"the {recipe.schedule} schedule needs a finite run: set trainer.max_epochs or trainer.max_steps"
        )
    if recipe.schedule not in (*SCHEDULES, "step"):
        raise ConfigError(
            f"unknown schedule {recipe.schedule!r} in the optim recipe; expected one of {sorted([*SCHEDULES, 'step'])}"
        )
    warmup = recipe.warmup_steps if recipe.warmup_steps is not None else round(recipe.warmup_epochs * steps_per_epoch)
    warmup = min(warmup, total_steps - 1)
    if recipe.schedule == "step":
        if not recipe.decay_epochs:
            raise ConfigError("the step schedule needs decay_epochs in the optim recipe, e.g. [27, 33]")
        # timm decays once t + 1 reaches a milestone: +1 makes the lr drop exactly at the epoch's first update
        return MultiStepLRScheduler(
            optimizer,
            decay_t=[epoch * steps_per_epoch + 1 for epoch in recipe.decay_epochs],
            decay_rate=recipe.decay_rate,
            warmup_t=warmup,
            warmup_lr_init=recipe.warmup_lr,
            warmup_prefix=False,  # milestones count from the first update, warmup included, as in mmdet
            t_in_epochs=False,
        )
    return SCHEDULES[recipe.schedule](
        optimizer,
        t_initial=max(1, total_steps - warmup),
        lr_min=recipe.min_lr,
        warmup_t=warmup,
        warmup_lr_init=recipe.warmup_lr,
        warmup_prefix=True,
        t_in_epochs=False,
    )


def configure_recipe(module: pl.LightningModule, model: nn.Module, recipe: OptimRecipe) -> dict[str, Any]:
    """``configure_optimizers``' return value for ``model`` trained with ``recipe`` (pair it with
    :func:`step_scheduler` as the module's ``lr_scheduler_step``)."""
    trainer = module.trainer
    total_steps = trainer.estimated_stepping_batches  # also sets up the train loader read below...
    if trainer.train_dataloader is None:  # ...unless max_steps alone bounds the run: then load it here
        trainer.fit_loop.setup_data()
    lr = recipe.scaled_lr(global_batch_size(trainer, trainer.train_dataloader.batch_size))
    optimizer = build_optimizer(model, recipe, lr)
    steps_per_epoch = math.ceil(trainer.num_training_batches / trainer.accumulate_grad_batches)
    scheduler = build_scheduler(optimizer, recipe, total_steps, steps_per_epoch)
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def step_scheduler(module: pl.LightningModule, scheduler: Scheduler) -> None:
    """timm schedulers are set from the update count, which also makes resuming exact."""
    scheduler.step_update(num_updates=module.global_step)
