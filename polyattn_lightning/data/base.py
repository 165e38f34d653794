"""The contract of this project's DataModules, and the one place where they make their DataLoaders.

Every DataModule (images, COCO, Long Range Arena) subclasses :class:`DataModule` and only says how to build its
datasets and what the data determines (``num_classes``, ``classes``; the LRA ones ``vocab_size``...): the tasks
read those after ``setup()`` (``tasks/base.py``). Loader settings (workers, pinned memory, persistent workers,
dropping the last ragged training batch for Mixup) live here, so a change to how loaders are made (samplers,
resumable loaders) is made once.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import lightning.pytorch as pl
import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset, Subset

from ..errors import ConfigError, DataError, MissingPathError
from .evaluation import eval_loader
from .resumable import ResumableDataLoader


class CorruptImageError(DataError):
    """An image file that PIL cannot decode; the message names the file."""


def read_rgb(path: str | Path) -> Image.Image:
    """Decode an image as RGB, or raise :class:`CorruptImageError` naming the file.

    ``convert`` forces the full decode here, so a truncated file fails on this
    line rather than deep inside a transform.
    """
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except OSError as err:  # PIL's UnidentifiedImageError and truncated-file errors are OSErrors
        raise CorruptImageError(f"cannot read image {path}: {err}") from err


class ImageList(Dataset):
    """``(path, label)`` pairs read with :func:`read_rgb` and a transform."""

    def __init__(self, samples: Sequence[tuple[str, int]], transform=None):
        self.samples = list(samples)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int):
        path, label = self.samples[index]
        image = read_rgb(path)
        return (self.transform(image) if self.transform else image), label


def available_cpus(cap: int | None = 8) -> int:
    """The CPUs this process may run on (its affinity mask: a SLURM or container share, not the whole machine),
    at most ``cap``: the default loader worker count."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(count, cap) if cap else count)


def require_dir(path: Path, layout: str) -> Path:
    """``path`` if it is a non-empty directory, else an error naming it and the expected layout."""
    if not path.is_dir():
        raise MissingPathError(f"data directory {path} does not exist; expected layout:\n{layout}")
    if not any(path.iterdir()):
        raise MissingPathError(f"data directory {path} is empty; expected layout:\n{layout}")
    return path


@dataclass(frozen=True)
class ChanceRate:
    """The top-1 accuracy of always answering a split's most frequent class: the rate a model that learnt nothing
    from the inputs reaches.

    Attributes:
        rate: the majority class's share of the split.
        label: the majority class's index (the first of equally frequent ones).
        samples: the split's size, which sets how far a measured accuracy strays from the rate by chance.
        source: what the rate is, in words: ``majority class of 60 validation images``.
    """

    rate: float
    label: int
    samples: int
    source: str

    def standard_error(self) -> float:
        """The binomial standard error of an accuracy measured on ``samples`` samples at this rate."""
        return math.sqrt(self.rate * (1 - self.rate) / self.samples)


class DataModule(pl.LightningDataModule):
    """Base of every DataModule: images here, token sequences in ``data/lra``, COCO in ``data/coco``.

    Subclasses set ``self.train_set``, ``self.val_set`` (and optionally ``self.test_set``; the validation split
    is used otherwise) in ``setup``, and there, or as class attributes, what the data determines:
    ``num_classes`` and ``classes``, which a task takes for its values left None or checks its given ones against.
    """

    #: the class count; None until ``setup()`` has read it from the data (or when the data has no classes)
    num_classes: int | None = None
    #: the class names by label index (predictions name them); None when the data has no names
    classes: list[str] | None = None
    #: makes a batch from samples; None is PyTorch's default (the LRA DataModules pad sequences here,
    #: the COCO DataModule returns mmengine's ``pseudo_collate``)
    collate_fn: Callable[[list], Any] | None = None
    #: drop the ragged last training batch (Mixup needs even, full batches); detection keeps it
    drop_last_train: bool = True
    #: what one sample is, in the words of :meth:`chance_rate`'s source (``60 validation images``)
    sample_noun: str = "samples"

    @classmethod
    def check_paths(cls, **init_args: Any) -> None:
        """Called by the CLI with the init arguments before any model is built: raise a
        :class:`~polyattn_lightning.errors.MissingPathError` naming a data path that cannot be right (the default
        checks nothing: data generated on first use has no path)."""

    def __init__(self, batch_size: int = 64, num_workers: int = 4, pin_memory: bool = True):
        """
        Args:
            batch_size: per-device batch size (the task scales the learning rate by the global batch).
            num_workers: loader worker processes per device; workers persist across epochs.
            pin_memory: page-locked host memory for faster host-to-GPU copies (ignored without a CUDA device).
        """
        super().__init__()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.train_set: Dataset | None = None
        self.val_set: Dataset | None = None
        self.test_set: Dataset | None = None
        self.predict_set: Dataset | None = None  # None: predict the test (else validation) split

    def image_files(self) -> list[str]:
        """Every image file this data set reads, once each: what ``polyattn check-data`` (and ``check_images``)
        decodes. Here: the ``(path, label)`` ``samples`` of the splits after ``setup("fit")``; data held in
        memory has none; COCO and Pathfinder name theirs without loading them."""
        if getattr(self, "train_set", None) is None:  # also for another LightningDataModule (check-data)
            self.setup("fit")
        paths: dict[str, None] = {}
        for split in ("train_set", "val_set", "test_set"):
            for sample in getattr(getattr(self, split, None), "samples", ()):
                paths[str(sample[0])] = None
        return list(paths)

    def split_labels(self, dataset: Dataset | None) -> np.ndarray | None:
        """The class label of every sample of ``dataset`` (one of this module's splits), read without loading a
        sample; None where the data has no class labels or they cannot be read that way. Here: a split with
        ``samples`` of ``(path, label)`` (image folders) or a ``labels`` array (LRA's token sets), and a ``Subset``
        of one (a seeded split); a DataModule whose splits are other data sets overrides it."""
        if isinstance(dataset, Subset):
            labels = self.split_labels(dataset.dataset)
            return None if labels is None else labels[np.asarray(dataset.indices, dtype=np.int64)]
        if getattr(dataset, "labels", None) is not None:
            return np.asarray(dataset.labels, dtype=np.int64)
        if getattr(dataset, "samples", None) is not None:
            return np.asarray([label for _, label in dataset.samples], dtype=np.int64)
        return None

    def chance_rate(self, split: str = "val") -> ChanceRate | None:
        """The majority-class rate of the validation (``val``) or test (``test``: the validation split where there
        is none) split, which ``val/top1`` or ``test/top1`` is read against; None where the labels are unknown
        (:meth:`split_labels`). Call it after ``setup()``."""
        dataset = self.val_set if split == "val" else self._test_or_val()
        labels = self.split_labels(dataset)
        if labels is None or len(labels) == 0 or labels.min() < 0:  # -1: unlabelled (predict_root)
            return None
        counts = np.bincount(labels)
        name = "validation" if dataset is self.val_set else "test"
        source = f"majority class of {len(labels)} {name} {self.sample_noun}"
        return ChanceRate(float(counts.max() / len(labels)), int(counts.argmax()), len(labels), source)

    def _loader(self, dataset: Dataset | None, train: bool) -> DataLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}: call setup() before asking for a dataloader")
        settings = dict(
            batch_size=self.batch_size,
            collate_fn=self.collate_fn,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory and torch.cuda.is_available(),  # on CPU only a warning would come of it
            persistent_workers=self.num_workers > 0,
        )
        # training resumes mid-epoch with per-sample seeded augmentation; evaluation counts every sample once on any
        # number of ranks, and under a sharded strategy gives every rank the same number of batches
        if train:
            return ResumableDataLoader(dataset, shuffle=True, drop_last=self.drop_last_train, **settings)
        return eval_loader(dataset, self.trainer, **settings)

    def train_dataloader(self) -> DataLoader:
        self.check_training_batches()
        return self._loader(self.train_set, train=True)

    def check_training_batches(self) -> None:
        """A training split too small for one batch is an error naming the sizes and the fix, rather than
        Lightning's ``No training batches`` and a run that ends at once, with exit status 0 and nothing trained.
        Under DDP each rank gets ``ceil(samples / ranks)`` samples (Lightning's DistributedSampler)."""
        if self.train_set is None:
            return
        samples, ranks = len(self.train_set), getattr(self.trainer, "world_size", 1) if self.trainer else 1
        per_rank = -(-samples // ranks)
        batches = per_rank // self.batch_size if self.drop_last_train else -(-per_rank // self.batch_size)
        if samples == 0:
            raise ConfigError(f"{type(self).__name__}: the training split is empty: no training batch")
        if batches == 0:
            share = f" ({per_rank} per rank on {ranks} ranks)" if ranks > 1 else ""
            raise ConfigError(
                f"{type(self).__name__}: the training split has {samples} samples{share}, fewer than "
                f"data.batch_size {self.batch_size}, and the last incomplete batch is dropped: no training batch; "
                f"give --data.batch_size {per_rank} or less"
            )

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._test_or_val(), train=False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.predict_set if self.predict_set is not None else self._test_or_val(), train=False)

    def _test_or_val(self) -> Dataset | None:
        return self.test_set if self.test_set is not None else self.val_set
