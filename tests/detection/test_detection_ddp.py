"""Real 2-process DDP on CPU (gloo): COCO metrics and predict files equal one process's, every image once."""
from __future__ import annotations

import json
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from detection_harness import TINY_SET, tiny_data, tiny_detector, tiny_detector_config, write_tiny_coco

import detection_ddp_worker as ddp_worker
from polyattn_lightning.checkpoint import SafeCheckpointIO

pytestmark = pytest.mark.slow


def test_two_ranks_score_and_predict_like_one_process(tmp_path):
    root = write_tiny_coco(tmp_path / "shapes")  # 5 validation images: the ranks get 3 and 2
    assert TINY_SET.val_images % 2 == 1
    pl.seed_everything(0)
    detector = tiny_detector_config()
    detector["test_cfg"]["rcnn"]["score_thr"] = 0.0  # detections on every image, so a lost or doubled image shows
    model = tiny_detector(detector=detector)
    trainer = pl.Trainer(accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False,
                         limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                         plugins=[SafeCheckpointIO()])
    trainer.fit(model, tiny_data(root))
    ckpt = tmp_path / "model.ckpt"
    trainer.save_checkpoint(ckpt)

    ddp_out = tmp_path / "ddp"
    ddp_out.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               ddp_worker.__file__, str(ddp_out), str(ckpt), str(root)]
    proc = subprocess.run(command, cwd=ddp_out, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    single = ddp_worker.evaluate(ckpt, root, tmp_path / "single", devices=1)

    ddp = torch.load(ddp_out / "metrics.pt", weights_only=True)
    assert ddp == single
    assert single["val/bbox_mAP_50"] > 0 and "val/segm_mAP" in single  # a score that a lost image would change
    for kind in ("bbox", "segm"):
        ddp_json = json.loads((ddp_out / "predictions" / f"results.{kind}.json").read_text())
        single_json = json.loads((tmp_path / "single" / "predictions" / f"results.{kind}.json").read_text())
        assert {d["image_id"] for d in single_json} == set(range(TINY_SET.train_images + 1,
                                                                 TINY_SET.train_images + TINY_SET.val_images + 1))
        assert len(ddp_json) == len(single_json)
        for a, b in zip(ddp_json, single_json):
            assert a["image_id"] == b["image_id"] and a["category_id"] == b["category_id"]
            assert a["score"] == pytest.approx(b["score"], abs=1e-5)
            assert a["bbox"] == pytest.approx(b["bbox"], abs=1e-3)
