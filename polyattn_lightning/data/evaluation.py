"""Evaluation loaders: every sample counted once across ranks, and, where evaluation is collective, the same number
of batches on every rank.

Counted once: under DDP Lightning gives evaluation loaders a DistributedSampler, which pads the set to a multiple of
the world size with repeated samples, and the repeats count in the metrics. :func:`eval_sampler` splits the set
across ranks without repeats (Lightning's own ``UnrepeatedDistributedSampler``): the first ``N % W`` ranks hold one
sample more, and may make one batch more (12 batches against 11).

The same number of batches: under DDP an evaluation forward is local, and the rank with fewer batches simply
finishes first. Under a strategy that shards the parameters (FSDP2: ``ModelParallelStrategy`` and the project's
``ShardedStrategy``; Lightning's FSDP; DeepSpeed) every forward all-gathers each block from every rank: the rank with
one batch more waits forever in its extra forward while the others wait in the epoch-end metric reduction. There
:class:`EvenSampler` ends a short rank's share with one padding sample (the data set's first), which makes one
padding batch on its own, and :class:`EvalDataLoader` hands that batch on as a :class:`PaddingBatch`: the tasks run
it through the same forward, so every rank joins every all-gather, and score nothing from it
(``tasks/base.py``); ``predict`` returns None for it, which the prediction writer leaves out. The metrics stay those
of each sample once.

:func:`eval_loader` makes such a loader, with a generator of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from torch.utils.data import DataLoader, Dataset

from ..errors import ConfigError
from .resumable import global_seed

#: Lightning's strategies whose forward gathers parameters from every rank (``ShardedStrategy`` is a
#: ``ModelParallelStrategy``)
COLLECTIVE_FORWARD = (ModelParallelStrategy, FSDPStrategy, DeepSpeedStrategy)


@dataclass
class PaddingBatch:
    """A batch a rank evaluates only so that it joins the other ranks' collectives: run ``batch`` through the
    forward, score and log nothing. A dataclass, so Lightning moves ``batch`` to the device like any batch."""

    batch: Any


class EvenSampler(UnrepeatedDistributedSampler):
    """This rank's share of the set without repeats, then, when it makes fewer batches of ``batch_size`` than the
    largest share, one padding sample (index 0): the share's batches are then all full, so the padding sample makes
    a batch of its own, and every rank makes the same number of batches (shares differ by one sample at most)."""

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, batch_size: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False)
        largest = -(-len(dataset) // num_replicas)  # type: ignore[arg-type]
        #: this rank's batches of real samples; padding samples after them (0 or 1)
        self.batches = -(-self.num_samples // batch_size)
        self.padding = -(-largest // batch_size) - self.batches

    def __iter__(self) -> Iterator[int]:
        yield from super().__iter__()
        yield from [0] * self.padding

    def __len__(self) -> int:
        return self.num_samples + self.padding


class EvalDataLoader(DataLoader):
    """A DataLoader (DataLoader's arguments) whose batches after the first ``batches`` are padding: handed on as
    :class:`PaddingBatch`. (``batches``, not a count from the batch size: Lightning rebuilds a predict loader
    with a batch sampler of its own and batch size 1.)"""

    def __init__(self, dataset: Dataset, *args: Any, batches: int | None = None, **kwargs: Any):
        super().__init__(dataset, *args, **kwargs)
        self.batches = batches

    def __iter__(self) -> Iterator[Any]:
        batches = super().__iter__()
        return batches if self.batches is None else self._padded(batches)

    def _padded(self, batches: Iterator[Any]) -> Iterator[Any]:
        for index, batch in enumerate(batches):
            yield batch if index < self.batches else PaddingBatch(batch)


def eval_loader(dataset: Dataset, trainer: pl.Trainer | None, **kwargs: Any) -> DataLoader:
    """A validation/test/predict DataLoader (DataLoader's arguments): in order, each sample once across ranks
    (:func:`eval_sampler`), the same number of batches on every rank where the forward is collective, and a generator
    of its own. Without one, DataLoader draws its worker seeds from the global torch RNG at every pass, and evaluation
    inside a training run would shift the training's later random draws (a resumed run, which skips the sanity
    check, would then draw differently from the original run)."""
    generator = torch.Generator().manual_seed(global_seed())
    sampler = eval_sampler(dataset, trainer, kwargs.get("batch_size", 1))
    batches = sampler.batches if isinstance(sampler, EvenSampler) and sampler.padding else None
    return EvalDataLoader(dataset, shuffle=False, sampler=sampler, generator=generator, batches=batches, **kwargs)


def eval_sampler(
    dataset: Dataset, trainer: pl.Trainer | None, batch_size: int = 1
) -> UnrepeatedDistributedSampler | None:
    """On several ranks, this rank's share of ``dataset`` with no sample repeated, padded to the same number of
    batches of ``batch_size`` on every rank when the strategy's forward is collective (:class:`EvenSampler`); None
    (Lightning's default) on one process. A non-empty set smaller than the world size is an error (a rank without a
    sample)."""
    if trainer is None or trainer.world_size == 1:
        return None
    size = len(dataset)  # type: ignore[arg-type]
    if 0 < size < trainer.world_size:
        raise ConfigError(
            f"an evaluation split of {size} samples on {trainer.world_size} ranks: each rank needs one "
            "(Lightning's UnrepeatedDistributedSampler); evaluate on fewer ranks or on a larger split"
        )
    if isinstance(trainer.strategy, COLLECTIVE_FORWARD):
        return EvenSampler(dataset, trainer.world_size, trainer.global_rank, batch_size)
    return UnrepeatedDistributedSampler(
        dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False
    )
