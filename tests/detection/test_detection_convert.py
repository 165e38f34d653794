"""DetectionModule's convert and lora options: the XCiT backbone converted (attention over channels), LoRA adapters on
its attention beside a neck and heads that train in full, through the task and the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from detection_harness import (QUICKSTART, TINY_BACKBONE, tiny_data, tiny_detector, tiny_detector_config,
                               write_tiny_coco)
from training_helpers import cpu_trainer

from polyattn_lightning import cli
from polyattn_lightning.conversion import ConvertRecipe, convert
from polyattn_lightning.conversion.lora import LoraRecipe
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.models.xcit_detection import XCiTBackbone
from polyattn_lightning.tasks.steps.convert import CONVERSION_KEY

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

POLY3 = {"name": "poly3", "scale": 0.0714}


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return write_tiny_coco(tmp_path_factory.mktemp("coco") / "shapes")


def tiny_backbone() -> XCiTBackbone:
    torch.manual_seed(0)
    return XCiTBackbone("xcit_nano_12_p16_224", **TINY_BACKBONE)


@pytest.mark.parametrize("side", [64, 96])
def test_transfer_lowers_every_xca_layers_error_whatever_the_token_count(side):
    """XCA attends a head's 16 channels, whatever the 16 (64 px) or 36 (96 px) tokens: its qkv rows and proj columns
    are cut by channels, its gain folds into its own per-head temperature (q is L2-normalised: query rows would be
    normalised back); the state-dict keys stay as they were."""
    backbone = tiny_backbone()
    keys = list(backbone.state_dict())
    temperature = backbone.xcit.blocks[0].attn.temperature.detach().clone()
    images = [torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    report = convert(backbone, POLY3, images, method="transfer", steps=60)
    assert report.layers == [f"xcit.blocks.{i}.attn" for i in range(4)]
    assert all(after < 0.5 * before for before, after in zip(report.error_before, report.error_after))
    assert list(backbone.state_dict()) == keys
    gains = torch.tensor(report.gains[0])  # poly3: gain = t^3 of the temperature folded in (t > 0 here)
    folded = backbone.xcit.blocks[0].attn.temperature.detach().flatten()
    assert torch.allclose(folded, temperature.flatten() * gains ** (1 / 3), rtol=1e-5)


def test_calibration_folds_each_heads_temperature_into_the_xca_temperature():
    backbone = tiny_backbone()
    qkv = backbone.xcit.blocks[1].attn.qkv.weight.detach().clone()
    report = convert(backbone, POLY3, [torch.randn(2, 3, 96, 96)], method="calibrate")
    expected = torch.tensor(report.temperatures[1], dtype=torch.float32)
    assert not torch.equal(expected, torch.ones(2))  # the grid moved some head
    assert torch.allclose(backbone.xcit.blocks[1].attn.temperature.detach().flatten(), expected)
    assert torch.equal(backbone.xcit.blocks[1].attn.qkv.weight, qkv)  # not the query rows


def trainable(model) -> tuple[set[str], set[str]]:
    named = dict(model.detector.named_parameters())
    return {n for n, p in named.items() if p.requires_grad}, {n for n, p in named.items() if not p.requires_grad}


def test_lora_trains_the_backbones_adapters_and_the_new_parts_only(coco_root):
    """peft freezes what it is given, the backbone; its adapters (qkv and proj of every XCA), the backbone's new
    resampling branches and everything outside it (FPN, RPN, RoI heads) train; the pretrained XCiT does not move."""
    pl.seed_everything(0)
    model = tiny_detector(num_classes=3, lora=LoraRecipe(r=2, alpha=4))
    train, frozen = trainable(model)
    assert {n for n in train if "lora_" in n} == {
        f"backbone.xcit.blocks.{i}.attn.{layer}.lora_{ab}.default.weight"
        for i in range(4) for layer in ("qkv", "proj") for ab in "AB"
    }
    assert {n for n in train if n.startswith("backbone.") and "lora_" not in n} == {
        n for n in train if n.startswith("backbone.fpn")
    } != set()
    assert {n.split(".")[0] for n in train} == {"backbone", "neck", "rpn_head", "roi_head"}
    assert all(not n.startswith(("neck.", "rpn_head.", "roi_head.")) for n in frozen)
    assert frozen == {n for n in dict(model.detector.named_parameters()) if n.startswith("backbone.xcit.")} - train
    before = {n: p.detach().clone() for n, p in model.detector.named_parameters()}
    cpu_trainer(max_steps=3, limit_val_batches=0).fit(model, tiny_data(coco_root))
    after = dict(model.detector.named_parameters())
    assert all(torch.equal(after[n], before[n]) for n in frozen)
    assert all(after[n].abs().sum() > 0 for n in train if "lora_B" in n)  # B starts at zero
    for name in ("neck.fpn_convs.0.conv.weight", "roi_head.bbox_head.fc_cls.weight", "backbone.fpn2.weight"):
        assert not torch.equal(after[name], before[name]), name


def test_transfer_runs_once_before_fit_and_is_kept_in_the_checkpoint(coco_root, tmp_path):
    pl.seed_everything(0)
    model = tiny_detector(convert=ConvertRecipe(method="transfer", samples=4, steps=40))
    trainer = cpu_trainer(max_steps=1, limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(model, tiny_data(coco_root))
    report = model.conversion
    assert report["samples"] == 4 and len(report["layers"]) == 4
    assert all(after < 0.5 * before for before, after in zip(report["error_before"], report["error_after"]))
    trainer.save_checkpoint(tmp_path / "converted.ckpt")
    assert torch.load(tmp_path / "converted.ckpt", weights_only=True)[CONVERSION_KEY] == report
    cpu_trainer(limit_val_batches=1, default_root_dir=tmp_path).validate(model, tiny_data(coco_root))
    assert model.conversion is report  # not converted again


def test_the_cli_options_convert_and_adapt_the_quickstart_and_a_bad_target_is_refused(coco_root, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tiny = ["--data.init_args.root", str(coco_root), "--data.init_args.num_workers", "0",
            "--data.init_args.train_sizes", "[64]", "--data.init_args.crop_sizes", "null",
            "--model.init_args.detector", json.dumps(tiny_detector_config()),
            "--trainer.max_steps", "2", "--trainer.limit_val_batches", "1", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false"]
    with pytest.raises(ConfigError, match=r"model.init_args.lora.target: \['qkv'\] is not a list of q, k, v, o"):
        cli.make_cli(["fit", "--config", str(QUICKSTART), *tiny, "--model.init_args.lora", "{target: [qkv]}"])
    run = cli.make_cli(["fit", "--config", str(QUICKSTART), *tiny,
                        "--model.init_args.convert", "{method: transfer, samples: 4, steps: 30}",
                        "--model.init_args.lora", "{r: 2, alpha: 4, target: [q, k]}"])
    folder = Path(run.trainer.log_dir)
    saved = json.loads((folder / "conversion.json").read_text())
    assert saved["method"] == "transfer" and saved == run.model.conversion
    assert torch.load(folder / "checkpoints" / "last.ckpt", weights_only=True)[CONVERSION_KEY] == saved
    adapters = {n for n, p in run.model.detector.named_parameters() if p.requires_grad and "lora_" in n}
    assert len(adapters) == 4 * 2 and all(".attn.qkv." in n for n in adapters)  # one adapter on the fused q, k
