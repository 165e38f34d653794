"""Step three: LoRA adapters (peft) on a new model's attention instead of full fine-tuning (the ``lora`` option).

The adapters go on the q/k/v/o layers of the task's ``attention_target()`` (:func:`~...conversion.lora.add_lora`);
only they, and the modules its ``lora_trainable()`` names (a new head), train. They come after the convert step, so
they adapt the converted weights; a model built before a trainer was attached (in ``__init__``) has its adapters
from the start, and the convert step later edits the base layers under them (the adapters are still zero).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ...conversion.lora import LoraRecipe, add_lora
from ..hparams import as_dataclass, check_recipe


def recipe(task: pl.LightningModule) -> LoraRecipe | None:
    """The ``lora`` hyperparameter (None: full fine-tuning, also for a task without the option)."""
    value = task.hparams.get("lora")
    return None if value is None else as_dataclass(value, LoraRecipe)


def check_init_args(init_args: Mapping[str, Any]) -> None:
    """The ``lora`` recipe of a config, before anything is built."""
    check_recipe(init_args, "lora", LoraRecipe)


def run(task: pl.LightningModule, new: bool) -> None:
    """Put the adapters on a new model (once: a model already prepared has them), and say how many train."""
    target, lora = task.attention_target(), recipe(task)
    if not new or target is None or lora is None:
        return
    summary = add_lora(target, lora, task.lora_trainable())
    rank_zero_info(
        f"lora: {summary['adapters']:,} adapter parameters ({100 * summary['adapter_fraction']:.2f}% "
        f"of {summary['base']:,}); {summary['trainable']:,} trainable with the new head"
    )
