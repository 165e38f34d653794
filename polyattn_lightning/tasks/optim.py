"""AdamW with DeiT's learning-rate rule: scaled by the global batch, per-step warmup, cosine to a floor.

The pieces are timm's (``create_optimizer_v2`` for the weight-decay groups,
``CosineLRScheduler`` for the schedule), stepped by the number of optimizer
updates so that the schedule is the same for any number of devices.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import lightning.pytorch as pl
from timm.optim import create_optimizer_v2
from timm.scheduler import CosineLRScheduler
from torch import nn
from torch.optim import Optimizer

from ..checkpoint import checkpoint_safe


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
        min_lr: the floor the cosine decays to at the last step.
        layer_decay: timm's layer-wise lr decay (e.g. 0.65 when fine-tuning); None is off.
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

    def scaled_lr(self, global_batch: int) -> float:
        """The peak learning rate for ``global_batch`` images per optimizer step."""
        return self.lr if self.reference_batch is None else self.lr * global_batch / self.reference_batch


def global_batch_size(trainer: pl.Trainer, batch_size: int) -> int:
    """Images per optimizer step: batch x devices x nodes x gradient accumulation."""
    return batch_size * trainer.world_size * trainer.accumulate_grad_batches


def build_optimizer(model: nn.Module, recipe: OptimRecipe, lr: float) -> Optimizer:
    """AdamW whose weight decay skips 1-D parameters and ``model.no_weight_decay()``."""
    return create_optimizer_v2(
        model,
        opt="adamw",
        lr=lr,
        weight_decay=recipe.weight_decay,
        betas=recipe.betas,
        eps=recipe.eps,
        layer_decay=recipe.layer_decay,
    )


def build_scheduler(
    optimizer: Optimizer, recipe: OptimRecipe, total_steps: int, steps_per_epoch: int
) -> CosineLRScheduler:
    """Linear warmup for ``warmup_epochs`` then cosine to ``min_lr`` at ``total_steps``, in optimizer steps.

    Call ``step_update(num_updates=global_step)`` after every optimizer step.
    """
    if not math.isfinite(total_steps):
        raise ValueError("the cosine schedule needs a finite run: set trainer.max_epochs or trainer.max_steps")
    warmup = min(round(recipe.warmup_epochs * steps_per_epoch), total_steps - 1)
    return CosineLRScheduler(
        optimizer,
        t_initial=max(1, total_steps - warmup),
        lr_min=recipe.min_lr,
        warmup_t=warmup,
        warmup_lr_init=recipe.warmup_lr,
        warmup_prefix=True,
        t_in_epochs=False,
    )
