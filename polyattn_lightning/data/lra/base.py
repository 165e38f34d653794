"""Shared pieces of the Long Range Arena DataModules: packed token sequences, padding with masks, splits.

A format module only reads its files into :class:`Sequences` and labels; everything
else (batches, masks, truncation, seeded splits, loaders) is here.

Batch format (what :class:`~polyattn_lightning.tasks.lra.LRAModule` consumes): a dict with

* ``input_ids``: LongTensor ``(B, L)``, or ``(B, 2, L)`` for two-tower Retrieval; padding is id 0;
* ``mask``: BoolTensor of the same shape, True at real tokens;
* ``label``: LongTensor ``(B,)``.

The mask comes from each sequence's true length, never from its token ids: in
Image and Pathfinder id 0 is a black pixel, which is attended (the common
PyTorch LRA loaders mask ``input_ids == 0`` and so drop black pixels). ``L`` is
the batch's longest sequence rounded up to a multiple of 64 (at most
``max_length``): most batches are far shorter than ``max_length``, and
attention costs O(L^2). ``fixed_length=True`` pads every batch to ``max_length``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset, Subset

from ...errors import ConfigError, DataError, MissingPathError
from ..base import DataModule

#: the token id of padding in every LRA vocabulary (padded positions are masked out of attention)
PAD_ID = 0
#: batches are padded to a multiple of this many tokens
PAD_MULTIPLE = 64


class Sequences:
    """Variable-length byte-sized token sequences packed into one flat ``uint8`` array plus offsets.

    One buffer rather than a Python object per sample: loader workers forked from
    the main process share it, where reference counts on many small objects
    would copy every page. Every LRA vocabulary fits a byte once text ids are
    stored as the bytes themselves (:class:`TokenDataset` adds the shift).
    """

    def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
        self.tokens = tokens
        self.offsets = offsets

    @classmethod
    def from_array(cls, rows: np.ndarray) -> "Sequences":
        """Equal-length sequences from the rows of a 2-D ``uint8`` array (images as pixel sequences)."""
        n, length = rows.shape
        return cls(np.ascontiguousarray(rows, dtype=np.uint8).reshape(-1), np.arange(n + 1, dtype=np.int64) * length)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, index: int) -> np.ndarray:
        return self.tokens[self.offsets[index] : self.offsets[index + 1]]

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


class SequenceBuilder:
    """Appends sequences truncated to ``max_length``; :meth:`build` warns once with the count it truncated."""

    def __init__(self, max_length: int, source: str):
        self.max_length = max_length
        self.source = source
        self.buffer = bytearray()
        self.offsets = [0]
        self.truncated = 0

    def append(self, seq: bytes | np.ndarray) -> None:
        if len(seq) > self.max_length:
            self.truncated += 1
            seq = seq[: self.max_length]
        self.buffer += seq if isinstance(seq, (bytes, bytearray)) else np.asarray(seq, dtype=np.uint8).tobytes()
        self.offsets.append(len(self.buffer))

    def build(self) -> Sequences:
        if self.truncated:
            rank_zero_warn(
                f"{self.source}: {self.truncated} of {len(self.offsets) - 1} sequences are longer than "
                f"{self.max_length} tokens; truncated"
            )
        return Sequences(np.frombuffer(self.buffer, dtype=np.uint8), np.asarray(self.offsets, dtype=np.int64))


class TokenDataset(Dataset):
    """Labelled samples of one token sequence, or two (one per tower); items are ``(sequences, label)``.

    Token ids are the stored values plus ``shift``: byte-level text stores raw
    bytes and takes ``shift=1`` (LRA's ``ByteTextEncoder``: byte b is id b + 1, 0 is padding).
    """

    def __init__(self, towers: Sequence[Sequences], labels: Sequence[int] | np.ndarray, shift: int = 0):
        self.towers = tuple(towers)
        self.labels = np.asarray(labels, dtype=np.int64)
        self.shift = shift
        if any(len(tower) != len(self.labels) for tower in self.towers):
            raise DataError(f"{[len(t) for t in self.towers]} sequences for {len(self.labels)} labels")

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[tuple[np.ndarray, ...], int]:
        seqs = tuple(tower[index] for tower in self.towers)
        if self.shift:
            seqs = tuple(seq.astype(np.int64) + self.shift for seq in seqs)
        return seqs, int(self.labels[index])


class PadCollate:
    """Pads a list of :class:`TokenDataset` items into the batch dict described in the module docstring."""

    def __init__(self, max_length: int, fixed_length: bool = False, multiple: int = PAD_MULTIPLE):
        self.max_length = max_length
        self.fixed_length = fixed_length
        self.multiple = multiple

    def padded_length(self, longest: int) -> int:
        if self.fixed_length:
            return self.max_length
        return min(self.max_length, max(1, -(-longest // self.multiple)) * self.multiple)

    def __call__(self, samples: list[tuple[tuple[np.ndarray, ...], int]]) -> dict[str, torch.Tensor]:
        towers = len(samples[0][0])
        length = self.padded_length(max(len(seq) for seqs, _ in samples for seq in seqs))
        ids = np.full((len(samples), towers, length), PAD_ID, dtype=np.int64)
        lengths = np.zeros((len(samples), towers), dtype=np.int64)
        for b, (seqs, _) in enumerate(samples):
            for t, seq in enumerate(seqs):
                n = min(len(seq), length)
                ids[b, t, :n] = seq[:n]
                lengths[b, t] = n
        input_ids = torch.from_numpy(ids)
        mask = torch.arange(length) < torch.from_numpy(lengths).unsqueeze(-1)
        if towers == 1:
            input_ids, mask = input_ids.squeeze(1), mask.squeeze(1)
        label = torch.tensor([label for _, label in samples], dtype=torch.long)
        return {"input_ids": input_ids, "mask": mask, "label": label}


def seeded_split(dataset: Dataset, sizes: Sequence[int], seed: int, names: Sequence[str] | None = None) -> list[Subset]:
    """Disjoint subsets of the given sizes from one seeded permutation: the same split on every run and rank.

    Sizes that do not fit the data (a negative or empty split, more samples than there are) are a one-line
    :class:`~polyattn_lightning.errors.ConfigError` naming the sizes (and the splits, by ``names``)."""
    names = list(names or [f"split {index}" for index in range(len(sizes))])
    bad = [f"{name} {size}" for name, size in zip(names, sizes) if size <= 0]
    if bad or sum(sizes) > len(dataset):
        asked = ", ".join(f"{name} {size}" for name, size in zip(names, sizes))
        why = f"an empty split ({', '.join(bad)})" if bad else f"{sum(sizes)} samples asked for"
        raise ConfigError(f"cannot split {len(dataset)} samples into {asked}: {why}")
    order = np.random.default_rng(seed).permutation(len(dataset))
    starts = np.cumsum([0, *sizes])
    return [Subset(dataset, order[start:stop].tolist()) for start, stop in zip(starts[:-1], starts[1:])]


def fraction_sizes(n: int, fractions: Sequence[float]) -> list[int]:
    """Split sizes for ``n`` samples: each fraction rounded down, the remainder to the first split."""
    sizes = [int(n * f) for f in fractions]
    sizes[0] += n - sum(sizes)
    return sizes


def parse_label(text: str, num_classes: int, where: str) -> int:
    """An integer class label in ``[0, num_classes)`` (``"1"`` or ``"1.0"``), or an error naming ``where``."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value.is_integer() or not 0 <= value < num_classes:
        raise DataError(f"{where}: label {text!r} is not a class in 0..{num_classes - 1}")
    return int(value)


class LRADataModule(DataModule):
    """Base of the LRA DataModules: ``--data.root``, sequence length, seeded splits, padded batches.

    Subclasses set ``vocab_size``, ``num_classes``, ``two_tower`` and ``layout``
    (the expected files under ``root``, quoted in errors) and implement
    :meth:`load`. All three splits are read once, on the first ``setup``.
    """

    vocab_size: int
    two_tower: bool = False
    layout: str
    sample_noun = "sequences"

    def __init__(
        self,
        root: str | None,
        max_length: int,
        fixed_length: bool = False,
        split_seed: int = 0,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.root = None if root is None else Path(root).expanduser()
        self.max_length = max_length
        self.split_seed = split_seed
        self.collate_fn = PadCollate(max_length, fixed_length)

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is None:
            self.train_set, self.val_set, self.test_set = self.load(self.data_root())

    def load(self, root: Path) -> tuple[Dataset, Dataset, Dataset]:
        """The train, validation and test sets read from ``root``."""
        raise NotImplementedError

    @classmethod
    def check_paths(cls, root: str | None = None, **_) -> None:
        """Called by the CLI before any model is built: a given ``root`` must be a directory."""
        if root is not None and not Path(root).expanduser().is_dir():
            raise MissingPathError(f"data root {root} does not exist; expected layout:\n{cls.layout}")

    def data_root(self) -> Path:
        if self.root is None:
            raise ConfigError(f"{type(self).__name__} needs --data.root, a folder holding:\n{self.layout}")
        self.check_paths(str(self.root))
        return self.root

    def require_file(self, path: Path) -> Path:
        if not path.is_file():
            raise MissingPathError(f"missing {path}; expected layout:\n{self.layout}")
        return path
