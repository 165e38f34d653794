"""LRA Image: CIFAR-10 as 8-bit grayscale pixel sequences, read from the python-version pickle batches.

As google-research/long-range-arena ``lra_benchmarks/image/input_pipeline.py``:
``tf.image.rgb_to_grayscale`` (weights 0.2989, 0.5870, 0.1140 on [0, 1] values, then
scaled by 255.5 and truncated to uint8, as ``convert_image_dtype`` does), each
pixel value (0-255) one token, row by row: vocabulary 256, length 1024, no padding.
The batches are unpickled directly (numpy arrays and plain containers only):
torchvision's ``CIFAR10`` insists on the release's MD5 sums.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

from ...errors import DataError
from .base import LRADataModule, Sequences, TokenDataset, seeded_split

TRAIN_BATCHES = tuple(f"data_batch_{i}" for i in range(1, 6))
TEST_BATCH = "test_batch"
GRAY_WEIGHTS = np.array([0.2989, 0.5870, 0.1140], dtype=np.float32)  # tf.image.rgb_to_grayscale


class _BatchUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: a pickle from a data folder runs no other code."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes in protocol-2 pickles written by Python 3
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def to_grayscale(rgb: np.ndarray) -> np.ndarray:
    """``(N, 3, H*W)`` uint8 RGB planes -> ``(N, H*W)`` uint8 gray, as TensorFlow computes it (float32)."""
    planes = rgb.astype(np.float32) * np.float32(1 / 255)
    gray = planes[:, 0] * GRAY_WEIGHTS[0] + planes[:, 1] * GRAY_WEIGHTS[1] + planes[:, 2] * GRAY_WEIGHTS[2]
    return (gray * np.float32(255.5)).astype(np.uint8)


class CIFAR10GrayDataModule(LRADataModule):
    """LRA Image (CIFAR-10, 10 classes); ``--data.root`` is the folder holding ``cifar-10-batches-py/``.

    The 50,000 training images are split (seeded) into ``50000 - val_size`` for
    training and ``val_size`` (5,000) for validation; ``test_batch`` is the test set.
    """

    vocab_size = 256
    num_classes = 10
    layout = (
        "cifar-10-batches-py/data_batch_1 ... data_batch_5 and cifar-10-batches-py/test_batch "
        "(CIFAR-10 python version: pickled dicts with b'data' (N x 3072 uint8) and b'labels')"
    )

    def __init__(
        self,
        root: str | None = None,
        val_size: int = 5000,
        split_seed: int = 0,
        batch_size: int = 256,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__(root, 1024, False, split_seed, batch_size, num_workers, pin_memory)
        self.val_size = val_size

    def read_batches(self, root: Path, names: tuple[str, ...]) -> TokenDataset:
        images, labels = [], []
        for name in names:
            path = self.require_file(root / "cifar-10-batches-py" / name)
            try:
                with open(path, "rb") as f:
                    batch = _BatchUnpickler(f, encoding="bytes").load()
                data = np.asarray(batch[b"data"], dtype=np.uint8)
                batch_labels = np.asarray(batch[b"labels"], dtype=np.int64)
            except (pickle.UnpicklingError, EOFError, KeyError, TypeError, ValueError) as err:
                raise DataError(f"{path}: not a CIFAR-10 python batch ({type(err).__name__}: {err})") from err
            if data.ndim != 2 or data.shape[1] != 3 * 1024 or len(batch_labels) != len(data):
                raise DataError(
                    f"{path}: b'data' has shape {data.shape} for {len(batch_labels)} labels, expected N x 3072"
                )
            if len(batch_labels) and not (0 <= batch_labels.min() and batch_labels.max() < 10):
                raise DataError(f"{path}: labels outside 0..9")
            images.append(to_grayscale(data.reshape(-1, 3, 1024)))
            labels.append(batch_labels)
        return TokenDataset([Sequences.from_array(np.concatenate(images))], np.concatenate(labels))

    def load(self, root: Path) -> tuple[Dataset, Dataset, Dataset]:
        train = self.read_batches(root, TRAIN_BATCHES)
        train, val = seeded_split(
            train,
            [len(train) - self.val_size, self.val_size],
            self.split_seed,
            names=["training", "validation (val_size)"],
        )
        return train, val, self.read_batches(root, (TEST_BATCH,))
