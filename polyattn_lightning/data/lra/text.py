"""LRA Text: IMDb movie reviews as UTF-8 bytes, read from the aclImdb folder.

As google-research/long-range-arena ``lra_benchmarks/text_classification/input_pipeline.py``
with its default ``tokenizer='char'``: ``tfds.deprecated.text.ByteTextEncoder``, so
byte b is id b + 1 and 0 is padding (vocabulary 257), applied to each review
file's bytes with surrounding whitespace stripped (tfds ``imdb_reviews`` reads
``f.read().strip()``); labels neg = 0, pos = 1. Reviews are truncated to
``max_length`` bytes: 4000 in the paper and the Nystromformer setup, 1000 in
the LRA release's config.
"""

from __future__ import annotations

from pathlib import Path

from torch.utils.data import Dataset

from ...errors import DataError, MissingPathError
from .base import LRADataModule, SequenceBuilder, TokenDataset, fraction_sizes, seeded_split

CLASSES = ("neg", "pos")


class IMDbDataModule(LRADataModule):
    """LRA Text (IMDb, 2 classes); ``--data.root`` is the aclImdb folder.

    IMDb has no validation split. ``val_fraction=0`` (the default) does as LRA
    and Nystromformer: the test set doubles as validation, so the checkpoint
    chosen on validation is chosen on test. ``val_fraction > 0`` holds out that
    fraction of the training reviews instead (seeded).
    """

    vocab_size = 257
    num_classes = 2
    layout = "train/pos/*.txt, train/neg/*.txt, test/pos/*.txt, test/neg/*.txt (the unpacked aclImdb folder)"

    def __init__(
        self,
        root: str | None = None,
        max_length: int = 4000,
        val_fraction: float = 0.0,
        split_seed: int = 0,
        fixed_length: bool = False,
        batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__(root, max_length, fixed_length, split_seed, batch_size, num_workers, pin_memory)
        self.val_fraction = val_fraction

    def read_split(self, folder: Path) -> TokenDataset:
        sequences, labels = SequenceBuilder(self.max_length, str(folder)), []
        for label, name in enumerate(CLASSES):
            class_dir = folder / name
            files = sorted(class_dir.glob("*.txt")) if class_dir.is_dir() else []
            if not files:
                raise MissingPathError(f"no reviews in {class_dir}; expected layout:\n{self.layout}")
            for path in files:
                review = path.read_bytes().strip()
                if not review:
                    raise DataError(f"{path}: empty review")
                sequences.append(review)
                labels.append(label)
        return TokenDataset([sequences.build()], labels, shift=1)

    def load(self, root: Path) -> tuple[Dataset, Dataset, Dataset]:
        train, test = self.read_split(root / "train"), self.read_split(root / "test")
        if not self.val_fraction:
            return train, test, test
        train, val = seeded_split(
            train,
            fraction_sizes(len(train), [1 - self.val_fraction, self.val_fraction]),
            self.split_seed,
            names=["training", "validation (val_fraction)"],
        )
        return train, val, test
