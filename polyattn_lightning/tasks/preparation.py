"""Preparing a model a task has just built: four steps, in the one order they run (:data:`STEPS`).

1. **switch** (:mod:`.steps.switch`): the attention layers run the task's activation;
2. **convert** (:mod:`.steps.convert`): pretrained softmax weights converted to it, once, on training samples;
3. **LoRA** (:mod:`.steps.lora`): peft adapters on the (converted) attention, instead of full fine-tuning;
4. **shard** (:mod:`.steps.shard`): FSDP2 under the sharded strategy, on the prepared model.

The task base calls :func:`prepare` from ``configure_model``: right after building (``new``), and again once a
trainer is attached for a model built in ``__init__``, so each step runs when it can and once: the switch and LoRA
on a new model, the convert step when the trainer's data is there, sharding under the strategy. One exception to the
order: a model built on the meta device is sharded before the switch (:func:`~.steps.shard.first`). The base also
calls :func:`check_init_args` (a config, before any model is built) and the checkpoint hooks here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl

from .steps import convert, lora, shard, switch


@dataclass(frozen=True)
class Step:
    """One step: what it does to the task's model (``run(task, new)``; ``new``: the model was just built) and, where
    it has something to do there, what it checks in a config before anything is built and what it keeps in
    checkpoints."""

    name: str
    run: Callable[[pl.LightningModule, bool], None]
    check_init_args: Callable[[Mapping[str, Any]], None] | None = None
    on_save_checkpoint: Callable[[pl.LightningModule, dict[str, Any]], None] | None = None
    on_load_checkpoint: Callable[[pl.LightningModule, dict[str, Any]], None] | None = None


#: The steps, in the order they run.
STEPS = (
    Step("switch", switch.run, switch.check_init_args),
    Step("convert", convert.run, convert.check_init_args, convert.on_save_checkpoint, convert.on_load_checkpoint),
    Step("lora", lora.run, lora.check_init_args),
    Step("shard", shard.run),
)


def prepare(task: pl.LightningModule, new: bool) -> None:
    """Run the steps on the task's model, in order (a new model on the meta device: sharded first)."""
    if new:
        shard.first(task)
    for step in STEPS:
        step.run(task, new)


def check_init_args(init_args: Mapping[str, Any]) -> None:
    """Each step's check of a config's init arguments, in order; errors name the key."""
    for step in STEPS:
        if step.check_init_args is not None:
            step.check_init_args(init_args)


def on_save_checkpoint(task: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
    """What the steps keep, into ``checkpoint``."""
    for step in STEPS:
        if step.on_save_checkpoint is not None:
            step.on_save_checkpoint(task, checkpoint)


def on_load_checkpoint(task: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
    """What the steps kept, from ``checkpoint`` (before its weights are loaded)."""
    for step in STEPS:
        if step.on_load_checkpoint is not None:
            step.on_load_checkpoint(task, checkpoint)
