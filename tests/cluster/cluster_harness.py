"""A tiny classification setup shared by the cluster tests and the DDP worker script.

A 2-block ViT on 8x8 scikit-learn digits: a real model, real data and the real
trainer plumbing (checkpoint IO, callbacks, loaders), a few milliseconds a step.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import Dataset

from polyattn_lightning.data import DigitsDataModule
from polyattn_lightning.tasks import ClassificationModule, MixupRecipe, OptimRecipe


def tiny_classifier(mixup: bool = False, drop_path: float = 0.0, attention: Any = "poly3") -> ClassificationModule:
    """ViT, 16 tokens of dim 32, 2 blocks; ``mixup`` and ``drop_path`` make training draw random numbers."""
    mix = MixupRecipe(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1) if mixup else MixupRecipe()
    optim = OptimRecipe(lr=1e-3, reference_batch=None, warmup_epochs=0.5, min_lr=1e-5)
    return ClassificationModule(
        model_name="vit_tiny_patch16_224",
        num_classes=10,
        attention=attention,
        img_size=8,
        model_kwargs={"patch_size": 2, "embed_dim": 32, "depth": 2, "num_heads": 2},
        optim=optim,
        mixup=mix,
        drop_path_rate=drop_path,
    )


def digits(batch_size: int, val_fraction: float = 0.2) -> DigitsDataModule:
    return DigitsDataModule(img_size=8, batch_size=batch_size, val_fraction=val_fraction, num_workers=0)


def jitter(image: torch.Tensor) -> torch.Tensor:
    """A random augmentation that draws from python's, numpy's and torch's global RNGs, as real transforms do."""
    if random.random() < 0.5:
        image = image.flip(-1)
    return image + 0.1 * torch.randn_like(image) + float(np.random.uniform(-0.2, 0.2))


class Augmented(Dataset):
    def __init__(self, dataset: Dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image, label = self.dataset[index]
        return jitter(image), label


class AugmentedDigits(DigitsDataModule):
    """Digits with :func:`jitter` on the training images, loaded by ``num_workers`` workers."""

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        self.train_set = Augmented(self.train_set)


def augmented_digits(batch_size: int, num_workers: int = 0, val_fraction: float = 0.2) -> AugmentedDigits:
    return AugmentedDigits(img_size=8, batch_size=batch_size, num_workers=num_workers, val_fraction=val_fraction)


class MemoryLogger(Logger):
    """Keeps every logged value as ``{name: {step: value}}``: the loss curve a resumed run must reproduce."""

    def __init__(self) -> None:
        super().__init__()
        self.history: dict[str, dict[int, float]] = {}

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    @rank_zero_only
    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    @rank_zero_only
    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        for key, value in metrics.items():
            self.history.setdefault(key, {})[step] = value


class RecordBatches(Callback):
    """What each optimizer step trained on: (global step, batch index, the batch's bytes)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bytes]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, targets = batch
        self.seen.append((trainer.global_step, batch_idx, images.numpy().tobytes() + targets.numpy().tobytes()))
