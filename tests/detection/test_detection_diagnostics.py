"""The attention diagnostics callbacks on a detection run: norms of every XCA layer, channel heat maps."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.loggers import CSVLogger

from detection_harness import tiny_data, tiny_detector, write_tiny_coco
from polyattn_lightning.attention import attention_modules
from polyattn_lightning.callbacks import AttentionMaps, AttentionNorms


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return write_tiny_coco(tmp_path_factory.mktemp("coco"))


def test_norms_and_maps_record_the_backbone_attention_of_a_detector(coco_root, tmp_path):
    model = tiny_detector()
    trainer = Trainer(default_root_dir=tmp_path, accelerator="cpu", max_steps=2, limit_val_batches=1,
                      logger=CSVLogger(tmp_path), enable_progress_bar=False, enable_model_summary=False,
                      callbacks=[AttentionNorms(every_n_steps=1, probe_size=2), AttentionMaps(layers=[1], heads=[0], probe_size=2, samples=1)],
                      val_check_interval=2, num_sanity_val_steps=0)
    trainer.fit(model, tiny_data(coco_root, train_sizes=[64], crop_sizes=None))
    trainer.logger.save()
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as file:
        rows = list(csv.DictReader(file))
    logged = {key: float(row[key]) for row in rows for key in row if key.startswith("attention/") and row[key]}
    layers = len(attention_modules(model.detector.backbone))
    assert layers == len(model.detector.backbone.xcit.blocks)
    for layer in range(1, layers + 1):
        for name in ("phi_norm", "jacobian_norm", "output_norm"):
            key = f"attention/{name}/layer{layer:02d}/mean"
            assert key in logged and logged[key] > 0
    pictures = sorted(p.name for p in Path(trainer.log_dir).rglob("*.png"))
    assert pictures, "no attention map was drawn"
