"""The detection configs through the CLI: every experiment builds, the quickstart fits and predicts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import polyattn_lightning.detection  # noqa: F401  (mmcv ops, then mmdet's registries)
from detection_harness import CONFIGS, QUICKSTART, TINY_SET, shrunk_detector_config, write_tiny_coco
from training_helpers import built, config_piece, experiment_configs, named_pieces, resolved_config, runs_activation

from polyattn_lightning import cli
from polyattn_lightning.data import coco
from polyattn_lightning.data.synthetic_coco import SyntheticCOCO

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

EXPERIMENTS = experiment_configs(CONFIGS)
#: The quickstart shrunk to the tiny test images: a few steps, 64 px, no workers.
TINY_RUN = [
    "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "2",
    "--data.init_args.train_sizes", "[64]", "--data.init_args.crop_sizes", "[56, 64]",
    "--data.init_args.crop_size", "[48, 64]", "--data.init_args.test_size", "64",
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
    "--trainer.val_check_interval", "1.0", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false",
]


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return write_tiny_coco(tmp_path_factory.mktemp("coco") / "shapes")


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_experiment_config_builds(tmp_path, monkeypatch, coco_root, path: Path):
    """Model and data built through the CLI as ``fit`` would, the backbone shrunk to 4 thin blocks (heads, FPN
    outputs, losses as the config states them), on a tiny COCO folder, without the pretrained file (the user's to
    place)."""
    monkeypatch.chdir(tmp_path)
    run = built(path, "--model.init_args.detector", json.dumps(shrunk_detector_config(path)),
                "--model.init_args.pretrained", "null", "--data.init_args.root", str(coco_root),
                "--data.init_args.num_workers", "0")
    head = run.model.detector.roi_head
    assert head.bbox_head.num_classes == head.mask_head.num_classes == len(TINY_SET.classes)  # the data's
    assert runs_activation(run.model.detector.backbone, config_piece(path, "model")["init_args"]["attention"])


def test_every_detection_config_piece_is_used_by_an_experiment():
    """Pieces are parsed only through the files that name them; an unnamed piece would go unchecked."""
    pieces = set(CONFIGS.rglob("*.yaml")) - set(EXPERIMENTS)
    assert {piece.resolve() for piece in pieces} <= named_pieces(CONFIGS)


def test_3x_recipe_is_the_xcit_authors(capsys):
    """The base config of the COCO grid, with the attention of its x^3 cell."""
    config = resolved_config(capsys, CONFIGS / "coco" / "mask_rcnn_xcit_small_12_3x.yaml",
                             "--model.init_args.attention", "{name: poly3, scale: 0.07142857142857142}")
    optim = config["model"]["init_args"]["optim"]
    assert (optim["lr"], optim["reference_batch"], optim["weight_decay"]) == (1e-4, 16, 0.05)
    assert (optim["warmup_steps"], optim["schedule"], optim["decay_epochs"]) == (500, "step", [27, 33])
    assert config["trainer"]["max_epochs"] == 36 and config["data"]["init_args"]["batch_size"] == 2
    assert config["model"]["init_args"]["attention"] == {"name": "poly3", "scale": pytest.approx(1 / 14)}


def test_quickstart_generates_its_data_fits_and_predicts_coco_json(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    generated = tmp_path / "cache" / "synthetic_coco"
    monkeypatch.setattr(coco, "default_root", lambda: generated)  # not the user's cache
    tiny = ["--data.init_args.synthetic.train_images", "6", "--data.init_args.synthetic.val_images", "3",
            "--data.init_args.synthetic.image_size", "64"]
    fit = cli.make_cli(["fit", "--config", str(QUICKSTART), *tiny, *TINY_RUN])
    assert (generated / "annotations" / "instances_val2017.json").is_file()
    metrics = fit.trainer.callback_metrics
    assert {"train/loss", "train/loss_mask", "val/bbox_mAP", "val/bbox_mAP_50", "val/segm_mAP_75",
            "val/segm_mAP_l"} <= set(metrics)
    run = tmp_path / "runs" / "detection" / "quickstart" / "version_0"
    last = run / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3

    cli.make_cli(["predict", "--config", str(QUICKSTART), *tiny, *TINY_RUN, "--ckpt_path", str(last)])
    written = [p for p in (tmp_path / "runs").rglob("results.segm.json") if p.parent.name == "predictions"]
    assert len(written) == 1
    detections = json.loads(written[0].read_text())
    assert all({"image_id", "category_id", "bbox", "score", "segmentation"} <= set(d) for d in detections)


def test_quickstart_on_a_given_root_that_does_not_exist_fails_without_generating(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(coco, "default_root", lambda: tmp_path / "cache" / "synthetic_coco")
    with pytest.raises(FileNotFoundError, match=r"missing does not exist; expected layout"):
        cli.make_cli(["fit", "--config", str(QUICKSTART), "--data.init_args.root", str(tmp_path / "missing"),
                      *TINY_RUN])
    assert not (tmp_path / "cache").exists()


def test_quickstart_trains_on_a_given_two_category_coco_folder(tmp_path, monkeypatch):
    """The unchanged quickstart config on a COCO folder of 2 categories: the heads take the data's count."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(coco, "default_root", lambda: tmp_path / "cache" / "synthetic_coco")
    two = SyntheticCOCO(**{**TINY_SET.__dict__, "classes": ("ellipse", "triangle")})
    root = write_tiny_coco(tmp_path / "shapes", two)
    fit = cli.make_cli(["fit", "--config", str(QUICKSTART), "--data.init_args.root", str(root), *TINY_RUN])
    assert fit.datamodule.classes == ["ellipse", "triangle"]
    head = fit.model.detector.roi_head
    assert fit.model.hparams.num_classes == head.bbox_head.num_classes == head.mask_head.num_classes == 2
    assert head.bbox_head.fc_cls.out_features == 3  # 2 classes + background
    assert torch.load(tmp_path / "runs" / "detection" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt",
                      weights_only=True)["hyper_parameters"]["num_classes"] == 2  # the count used, saved
    assert not (tmp_path / "cache").exists()
