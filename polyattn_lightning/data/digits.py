"""scikit-learn's bundled 8x8 digits: a real data set that needs no download."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import Dataset, TensorDataset

from .base import DataModule


class DigitsDataModule(DataModule):
    """1,797 handwritten digits (10 classes), upsampled to ``img_size`` RGB images.

    The split is stratified and fixed by ``split_seed``, so every run (and every
    DDP rank) sees the same train and validation images; validation doubles as
    the test split. The images sit in memory, hence no workers by default.
    """

    num_classes = 10
    classes = [str(digit) for digit in range(10)]
    sample_noun = "images"

    def __init__(
        self,
        img_size: int = 16,
        val_fraction: float = 0.2,
        split_seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        super().__init__(batch_size=batch_size, num_workers=num_workers, pin_memory=pin_memory)
        self.img_size = img_size
        self.val_fraction = val_fraction
        self.split_seed = split_seed

    def setup(self, stage: str | None = None) -> None:
        digits = load_digits()
        images = torch.as_tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8) in [0, 1]
        images = F.interpolate(images, size=self.img_size, mode="bilinear", align_corners=False)
        images = ((images - 0.5) / 0.5).expand(-1, 3, -1, -1).contiguous()
        labels = torch.as_tensor(digits.target, dtype=torch.long)
        train_idx, val_idx = train_test_split(
            torch.arange(len(labels)), test_size=self.val_fraction, random_state=self.split_seed, stratify=labels
        )
        self.train_set = TensorDataset(images[train_idx], labels[train_idx])
        self.val_set = TensorDataset(images[val_idx], labels[val_idx])

    def split_labels(self, dataset: Dataset | None) -> np.ndarray | None:
        """A split's labels: the second tensor of its ``TensorDataset``."""
        return dataset.tensors[1].numpy() if isinstance(dataset, TensorDataset) else super().split_labels(dataset)
