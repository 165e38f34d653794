"""Tiny detection set-ups shared by the detection tests and the DDP worker script.

A synthetic COCO-format set of 64 px images written to disk, and the quickstart's
Mask R-CNN with a 4-block, 32-channel XCiT: the real data path, model and
trainer plumbing at a few hundred milliseconds a step.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from polyattn_lightning.data.coco import COCODataModule
from polyattn_lightning.data.synthetic_coco import SyntheticCOCO, write_synthetic_coco
from polyattn_lightning.detection.config import load_detector_config
from polyattn_lightning.tasks.detection import DetectionModule
from polyattn_lightning.tasks.optim import OptimRecipe

CONFIGS = Path(__file__).resolve().parents[2] / "configs" / "detection"
QUICKSTART = CONFIGS / "quickstart.yaml"
TINY_BACKBONE = {"embed_dim": 32, "depth": 4, "num_heads": 2, "out_indices": [0, 1, 2, 3]}
TINY_SET = SyntheticCOCO(train_images=8, val_images=5, image_size=64, max_objects=2, min_size=0.3, max_size=0.45)


def write_tiny_coco(root: Path, config: SyntheticCOCO = TINY_SET) -> Path:
    return write_synthetic_coco(root, config)


def shrunk_detector_config(experiment: Path) -> dict[str, Any]:
    """The detector of an experiment config (its file, merged over its ``_base_``) with a 4-block, 32-channel XCiT
    whose four blocks feed the FPN; the rest as the file states it."""
    detector = load_detector_config(experiment.parent / yaml.safe_load(experiment.read_text())["model"]["init_args"]["detector"])
    detector["backbone"].update(TINY_BACKBONE)
    detector["neck"]["in_channels"] = [TINY_BACKBONE["embed_dim"]] * 4
    return detector


def tiny_detector_config() -> dict[str, Any]:
    """The quickstart's detector with the smaller backbone."""
    return shrunk_detector_config(QUICKSTART)


def tiny_detector(**kwargs: Any) -> DetectionModule:
    optim = OptimRecipe(lr=1e-3, reference_batch=None, warmup_steps=2, warmup_lr=1e-4, schedule="step",
                        decay_epochs=[1], no_decay_keys=["norm"])
    settings: dict[str, Any] = dict(detector=tiny_detector_config(), attention={"name": "poly3", "scale": 0.0714},
                                    optim=optim)
    settings.update(kwargs)
    return DetectionModule(**settings)


def tiny_data(root: Path, **kwargs: Any) -> COCODataModule:
    """Training at short side 56-72 (with the crop branch), evaluation at 64: no padding differences."""
    settings: dict[str, Any] = dict(root=str(root), batch_size=2, num_workers=0, train_sizes=[56, 64, 72],
                                    crop_sizes=[48, 64], crop_size=(40, 64), max_side=120, test_size=64)
    settings.update(kwargs)
    return COCODataModule(**settings)
