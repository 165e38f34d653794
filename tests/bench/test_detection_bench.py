"""``python -m polyattn_lightning.bench detection`` on a narrow XCiT Mask R-CNN: it runs, compares, writes JSON."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from polyattn_lightning.attention import attention_modules
from polyattn_lightning.bench import detection as bench
from polyattn_lightning.bench.__main__ import main


@pytest.fixture
def narrow_config(tmp_path: Path) -> Path:
    """The benchmark's default config with a narrow 12-block XCiT, narrow heads and fewer RoIs (the same step, cheaper)."""
    cfg = yaml.safe_load(bench.DEFAULT_CONFIG.read_text())
    cfg["backbone"].update(model_name="xcit_nano_12_p16_224", embed_dim=32, num_heads=2)
    cfg["neck"].update(in_channels=[32] * 4, out_channels=32)
    cfg["rpn_head"].update(in_channels=32, feat_channels=32)
    roi = cfg["roi_head"]
    roi["bbox_roi_extractor"]["out_channels"] = roi["mask_roi_extractor"]["out_channels"] = 32
    roi["bbox_head"].update(in_channels=32, fc_out_channels=64)
    roi["mask_head"].update(in_channels=32, conv_out_channels=32)
    cfg["train_cfg"]["rpn_proposal"]["max_per_img"] = 100
    cfg["train_cfg"]["rcnn"]["sampler"]["num"] = 64
    path = tmp_path / "narrow.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_detectors_differ_only_in_the_backbone_attention(narrow_config):
    poly3 = bench.build_detector(narrow_config, {"name": "poly3", "scale": 0.0714})
    softmax = bench.build_detector(narrow_config, "softmax")
    assert {m.activation.name for _, m in attention_modules(poly3.backbone)} == {"poly3"}
    assert {m.activation.name for _, m in attention_modules(softmax.backbone)} == {"softmax"}
    assert poly3.state_dict().keys() == softmax.state_dict().keys()


def test_bench_runs_a_training_step_of_each_and_writes_json(narrow_config, tmp_path, capsys):
    out = tmp_path / "detection.json"
    argv = ["detection", "--config", str(narrow_config), "--size", "64x96", "--repeats", "1", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["median_s"]) == {"softmax/train_step", "poly3/train_step",
                                       "softmax/backbone_fwd_bwd", "poly3/backbone_fwd_bwd"}
    assert all(len(samples) == 1 and samples[0] > 0 for samples in report["samples_s"].values())
    assert report["ratio"]["train_step"] == report["median_s"]["poly3/train_step"] / report["median_s"]["softmax/train_step"]
    assert report["attention"] == {"name": "poly3", "scale": 0.0714}
    assert report["input"] == {"batch": 1, "height": 64, "width": 96, "config": str(narrow_config)}
    printed = capsys.readouterr().out
    assert "| train_step |" in printed and "train step / softmax <= 1.05" in printed


@pytest.mark.parametrize("argv, message", [
    (["--size", "16x300"], "size '16x300': each side must be at least 32"),
    (["--size", "big"], "size 'big': expected HxW"),
    (["--config", "/nonexistent/model.yaml"], "--config /nonexistent/model.yaml: no such file"),
    (["--attention", "softmax"], "--attention: give the activation to compare with softmax"),
    (["--attention", "poly33x"], "--attention poly33x: "),
])
def test_bad_arguments_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["detection", *argv])
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
