"""The detection configs through the CLI: every experiment parses, the quickstart fits and predicts."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import polyattn_lightning.detection  # noqa: F401  (mmcv ops, then mmdet's registries)
from detection_harness import CONFIGS, QUICKSTART, TINY_SET, write_tiny_coco
from mmdet.registry import MODELS

from polyattn_lightning import cli
from polyattn_lightning.data import coco
from polyattn_lightning.attention import get_activation
from polyattn_lightning.data.synthetic_coco import SyntheticCOCO
from polyattn_lightning.tasks.detection import load_detector_config

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

EXPERIMENTS = [QUICKSTART, *sorted((CONFIGS / "coco").glob("*.yaml")), *sorted((CONFIGS / "finetune").glob("*.yaml"))]
#: The quickstart shrunk to the tiny test images: a few steps, 64 px, no workers.
TINY_RUN = [
    "--data.init_args.num_workers", "0", "--data.init_args.batch_size", "2",
    "--data.init_args.train_sizes", "[64]", "--data.init_args.crop_sizes", "[56, 64]",
    "--data.init_args.crop_size", "[48, 64]", "--data.init_args.test_size", "64",
    "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3", "--trainer.limit_val_batches", "2",
    "--trainer.val_check_interval", "1.0", "--trainer.num_sanity_val_steps", "0",
    "--trainer.enable_progress_bar", "false",
]


def resolved_config(capsys, path: Path, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(path), *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_experiment_config_parses(capsys, path: Path):
    config = resolved_config(capsys, path)
    model = config["model"]["init_args"]
    detector = model["detector"]
    if isinstance(detector, str):  # a YAML piece, relative to the experiment file, over its _base_
        detector = load_detector_config(path.parent / detector)
    assert MODELS.get(detector["type"]) is not None and MODELS.get(detector["backbone"]["type"]) is not None
    get_activation(model["attention"])
    assert config["data"]["class_path"].endswith(".COCODataModule")


def test_every_detection_config_piece_is_used_by_an_experiment():
    """Pieces are parsed only through the files that name them; an unnamed piece would go unchecked."""
    named = set()
    for path in CONFIGS.rglob("*.yaml"):
        named |= {(path.parent / name).resolve() for name in cli.yaml_references(yaml.safe_load(path.read_text()))}
    pieces = set(CONFIGS.rglob("*.yaml")) - set(EXPERIMENTS)
    assert {piece.resolve() for piece in pieces} <= named
    assert all(ref.is_file() for ref in named)


def test_3x_recipe_is_the_xcit_authors(capsys):
    config = resolved_config(capsys, CONFIGS / "coco" / "mask_rcnn_xcit_small_12_poly3_3x.yaml")
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
