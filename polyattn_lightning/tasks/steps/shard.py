"""Step four: under :class:`~...sharding.ShardedStrategy`, the task's ``optimized_module()`` sharded (FSDP2, one
block per unit), last: the switch and the convert step run on the plain model, and LoRA's adapters are sharded with
the layers they wrap.

A model the task builds inside its ``init_context()`` (from a config, no weight file) is made on the meta device
there, and is sharded first instead (:func:`first`): the switch's probe forward needs weights, which sharding gives
it (storage and the model's own init). The convert step and LoRA need pretrained weights, which such a model never
had: they are refused.
"""

from __future__ import annotations

import contextlib

import lightning.pytorch as pl

from ...errors import ConfigError
from ...sharding import sharded_strategy
from . import convert, lora


def init_context(task: pl.LightningModule) -> contextlib.AbstractContextManager:
    """Where a task builds a model that comes from a config: the meta device under the sharded strategy (no rank
    holds it whole), else a no-op."""
    sharded = sharded_strategy(task)
    return sharded.init_context() if sharded is not None else contextlib.nullcontext()


def first(task: pl.LightningModule) -> None:
    """Shard a model just built on the meta device now, before the other steps; refuse LoRA and the convert step on
    it. (Any other model is left to :func:`run`.)"""
    sharded = sharded_strategy(task)
    if sharded is None or not any(p.is_meta for p in task.optimized_module().parameters()):
        return
    if lora.recipe(task) is not None or convert.recipe(task).method != "none":
        raise ConfigError(
            "model.init_args.lora / convert under the sharded strategy need a model loaded with its weights "
            "(model: a pretrained folder or checkpoint), which is adapted, then sharded; this one is built "
            "from a config on the meta device and sharded first"
        )
    sharded.shard(task, task.optimized_module())


def run(task: pl.LightningModule, new: bool) -> None:
    """Shard under the sharded strategy (once: the strategy leaves a sharded model as it is)."""
    sharded = sharded_strategy(task)
    if sharded is not None:
        sharded.shard(task, task.optimized_module())
