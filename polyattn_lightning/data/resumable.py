"""Data loading that resumes mid-epoch and counts evaluation samples once under DDP.

Resuming: Lightning stores the train loader's ``state_dict()`` in every
checkpoint and hands it back through ``load_state_dict()`` after a restart,
for any loader that has those two methods (its ``_Stateful`` check in
``loops/fit_loop.py``; :class:`~polyattn_lightning.callbacks.ExactResume`
hands it back where Lightning forgets to). Without them a run resumed
mid-epoch starts the epoch over and trains twice on its first batches.
:class:`ResumableDataLoader` saves ``(epoch, batches done)``; on resume it
rebuilds the epoch's order and skips the finished batches without loading
them. Its order is a function of the seed and the epoch only, the very
permutation DistributedSampler draws, so one process with batch ``2B`` and two
DDP ranks with batch ``B`` see the same global batches.

Evaluating: under DDP Lightning gives evaluation loaders a DistributedSampler,
which pads the set to a multiple of the world size with repeated samples, and
the repeats count in the metrics. :func:`eval_sampler` splits the set across
ranks without repeats (Lightning's own ``UnrepeatedDistributedSampler``).
"""
from __future__ import annotations

import itertools
import os
from typing import Iterator

import lightning.pytorch as pl
import torch
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler, SequentialSampler


class EpochShuffleSampler(RandomSampler):
    """A shuffle that depends only on ``(seed, epoch)``: DistributedSampler's permutation on one process.

    Being a RandomSampler, Lightning swaps it for ``DistributedSampler(shuffle=True)``
    with the same seed (``PL_GLOBAL_SEED``, set by ``seed_everything``) under DDP.
    Lightning calls ``set_epoch`` before every epoch.
    """

    def __init__(self, data_source: Dataset):
        super().__init__(data_source)
        self.seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=generator).tolist())


class ResumableBatchSampler(BatchSampler):
    """A BatchSampler whose next pass starts ``skip`` batches in; the skipped batches are never loaded.

    A BatchSampler subclass, so Lightning can rebuild it around a DistributedSampler.
    """

    skip = 0

    def __iter__(self) -> Iterator[list[int]]:
        skip, self.skip = self.skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class ResumableDataLoader(DataLoader):
    """A training DataLoader that Lightning resumes mid-epoch; it takes DataLoader's arguments.

    With ``shuffle=True`` the order is an :class:`EpochShuffleSampler`'s. Worker
    seeds are drawn from the loader's own generator, reseeded each epoch, so
    iterating never consumes the global RNG (which a resumed run restores, see
    :class:`~polyattn_lightning.callbacks.ExactResume`).

    With ``num_workers=0`` a resumed run is bitwise identical to an
    uninterrupted one. With workers, the order is still exact but random
    augmentations after a mid-epoch resume are not: each worker's RNG restarts
    from its seed rather than from where it stood.
    """

    def __init__(
        self,
        dataset: Dataset,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | None = None,
        batch_sampler: ResumableBatchSampler | None = None,
        drop_last: bool = False,
        generator: torch.Generator | None = None,
        **kwargs,
    ):
        if batch_sampler is None:
            if sampler is None:
                sampler = EpochShuffleSampler(dataset) if shuffle else SequentialSampler(dataset)
            batch_sampler = ResumableBatchSampler(sampler, batch_size, drop_last)
        if not isinstance(batch_sampler, ResumableBatchSampler):
            raise TypeError(f"ResumableDataLoader needs a ResumableBatchSampler, got {type(batch_sampler).__name__}")
        super().__init__(dataset, batch_sampler=batch_sampler, generator=generator or torch.Generator(), **kwargs)
        # DataLoader reports batch_size=None when given a batch sampler; code that sizes the global batch reads it.
        object.__setattr__(self, "batch_size", batch_sampler.batch_size)
        self._seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        self._epoch = 0
        self._batches_done = 0
        self._resume: dict[str, int] | None = None

    def __iter__(self) -> Iterator:
        # A generator: nothing below runs until the first batch is asked for, after Lightning's set_epoch.
        self._epoch = getattr(self.batch_sampler.sampler, "epoch", 0)
        resume, self._resume = self._resume, None
        if resume is not None and resume["epoch"] == self._epoch:
            self.batch_sampler.skip = resume["batches_done"]
        self._batches_done = self.batch_sampler.skip
        self.generator.manual_seed(self._seed + self._epoch)
        for batch in super().__iter__():
            self._batches_done += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self._epoch, "batches_done": self._batches_done}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip ``batches_done`` batches if the next pass is the saved epoch (not if that epoch had ended)."""
        self._resume = dict(state)


def eval_sampler(dataset: Dataset, trainer: pl.Trainer | None) -> Sampler | None:
    """Under DDP, this rank's share of ``dataset`` with no sample repeated; None (Lightning's default) otherwise."""
    if trainer is None or trainer.world_size == 1:
        return None
    return UnrepeatedDistributedSampler(dataset, num_replicas=trainer.world_size, rank=trainer.global_rank, shuffle=False)
