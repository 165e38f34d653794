"""Training data loading that resumes mid-epoch, with per-sample random draws (evaluation loaders: ``evaluation.py``).

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

Random draws per sample: :class:`SeededDataset` (every ResumableDataLoader
wraps its dataset in one) seeds python ``random``, ``numpy.random`` and torch's
CPU generator before each sample with a seed that is a function of ``(seed,
epoch, sample index)`` only, so a sample's augmentation is the same whichever
worker, rank or run loads it: a run resumed mid-epoch with loader workers
continues bitwise, and one process with batch ``2B`` augments like two ranks.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
    get_worker_info,
)


class EpochShuffleSampler(RandomSampler):
    """A shuffle that depends only on ``(seed, epoch)``: DistributedSampler's permutation on one process.

    Being a RandomSampler, Lightning swaps it for ``DistributedSampler(shuffle=True)``
    with the same seed (``PL_GLOBAL_SEED``, set by ``seed_everything``) under DDP.
    Lightning calls ``set_epoch`` before every epoch.
    """

    def __init__(self, data_source: Dataset):
        super().__init__(data_source)
        self.seed = global_seed()
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(len(self.data_source), generator=generator).tolist())


def global_seed() -> int:
    """The run's seed: ``PL_GLOBAL_SEED``, which ``seed_everything`` sets (0 without it)."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of one sample's random draws: a function of ``(seed, epoch, index)`` and of nothing else."""
    return int(np.random.SeedSequence((seed % 2**32, epoch, index)).generate_state(1)[0])


@contextlib.contextmanager
def _kept_rng_state() -> Iterator[None]:
    """Restore python, numpy and torch CPU RNG states afterwards: the main process's draws go on undisturbed."""
    states = random.getstate(), np.random.get_state(), torch.get_rng_state()
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])


class SeededDataset(Dataset):
    """Any map-style dataset whose every sample draws its random numbers from a seed of its own.

    Indexed with ``(index, seed)`` pairs (what :class:`ResumableBatchSampler` yields), it seeds
    python ``random``, ``numpy.random`` and torch's CPU generator with ``seed``, then returns
    ``dataset[index]``. Transforms that draw from those global RNGs (torchvision, timm's RandAugment
    and random erasing, mmdet/mmcv pipelines) then augment a sample identically whichever loader
    worker, DDP rank or resumed run loads it: the draws depend on ``(seed, epoch, index)`` through
    :func:`sample_seed`, not on what the worker loaded before. In a loader worker the global RNGs are
    the worker's own; in the main process (``num_workers=0``) they are restored after each sample,
    so dropout, drop path and Mixup/CutMix draws do not depend on data loading. A transform with a
    ``torch.Generator`` of its own, or CUDA draws, are not covered.
    """

    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: list[tuple[int, int]]) -> list[Any]:
        """A batch (DataLoader's fetcher calls this when it exists): in the main process the RNG states
        are saved and restored once per batch rather than per sample."""
        samples = []
        with contextlib.nullcontext() if get_worker_info() is not None else _kept_rng_state():
            for index, seed in keys:
                random.seed(seed)
                np.random.seed(seed)
                torch.default_generator.manual_seed(seed)
                samples.append(self.dataset[index])
        return samples

    def __getattr__(self, name: str) -> Any:
        """The wrapped dataset's attributes (``classes``, ``metainfo``...)."""
        # "dataset" is not set yet while unpickling: no recursion. Dunders are not forwarded: DataLoader
        # calls ``__getitems__`` when the dataset has one, and a wrapped Subset's would get (index, seed) keys.
        if name == "dataset" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.dataset, name)


class ResumableBatchSampler(BatchSampler):
    """A BatchSampler whose next pass starts ``skip`` batches in; the skipped batches are never loaded.

    It yields ``(index, sample seed)`` pairs for a :class:`SeededDataset`, the seed taken from the
    sampler's ``seed`` and ``epoch`` (EpochShuffleSampler's or DistributedSampler's). A BatchSampler
    subclass, so Lightning can rebuild it around a DistributedSampler.
    """

    skip = 0

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        # A generator, so the skip is taken by the pass that is iterated: with workers, DataLoader asks
        # for an iterator twice (building its worker iterator, then resetting it) and drops the first.
        skip, self.skip = self.skip, 0
        seed = getattr(self.sampler, "seed", None)
        seed = global_seed() if seed is None else seed
        epoch = getattr(self.sampler, "epoch", 0)
        for batch in itertools.islice(super().__iter__(), skip, None):
            yield [(index, sample_seed(seed, epoch, index)) for index in batch]


class ResumableDataLoader(DataLoader):
    """A training DataLoader that Lightning resumes mid-epoch; it takes DataLoader's arguments.

    With ``shuffle=True`` the order is an :class:`EpochShuffleSampler`'s. The
    dataset is wrapped in a :class:`SeededDataset`, so each sample's random
    augmentation depends on ``(seed, epoch, index)`` only; worker seeds are drawn
    from the loader's own generator, so iterating never consumes the global RNG
    (which a resumed run restores, see :class:`~polyattn_lightning.callbacks.ExactResume`).
    A run resumed mid-epoch is thus bitwise identical to an uninterrupted one
    with any number of workers, and so is a run with another ``num_workers``.
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
        if not isinstance(dataset, SeededDataset):  # Lightning rebuilds the loader from the wrapped one under DDP
            dataset = SeededDataset(dataset)
        super().__init__(dataset, batch_sampler=batch_sampler, generator=generator or torch.Generator(), **kwargs)
        # DataLoader reports batch_size=None when given a batch sampler; code that sizes the global batch reads it.
        object.__setattr__(self, "batch_size", batch_sampler.batch_size)
        self._seed = global_seed()
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
