"""`polyattn maps` from a checkpoint made here and `polyattn sweep` (a grid) on the digits quickstart, through the CLI."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from sklearn.datasets import load_digits

from polyattn_lightning import cli

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "classification" / "quickstart.yaml"


@pytest.fixture
def checkpoint(tmp_path: Path, monkeypatch) -> Path:
    """``last.ckpt`` of a 3-layer relu digits ViT trained two steps through the CLI (which saves its
    hyperparameters as the CLI parsed them, with its own ``_class_path`` and ``_instantiator`` entries)."""
    monkeypatch.chdir(tmp_path)
    cli.main(["fit", "--config", str(QUICKSTART), "--model.init_args.attention", "relu",
              "--model.init_args.model_kwargs", "{patch_size: 4, embed_dim: 32, depth: 3, num_heads: 2}",
              "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1",
              "--trainer.enable_progress_bar", "false"])
    (path,) = tmp_path.rglob("last.ckpt")
    return path


def digit_png(path: Path, index: int) -> Path:
    """One of scikit-learn's digits as an 8x8 grey PNG file."""
    pixels = (load_digits().images[index] * 255 / 16).astype(np.uint8)
    Image.fromarray(pixels, mode="L").save(path)
    return path


def test_maps_command_writes_pngs_of_the_expected_size(tmp_path, checkpoint, capsys, caplog):
    images = [digit_png(tmp_path / f"digit{i}.png", i) for i in range(2)]
    out = tmp_path / "maps"
    with caplog.at_level("INFO"):
        cli.main(["maps", "--ckpt", str(checkpoint), "--image", str(images[0]), "--image", str(images[1]),
                  "--layer", "1", "--layer", "model.blocks.2.attn", "--head", "1", "--out", str(out),
                  "--mean", "0.5", "0.5", "0.5", "--std", "0.5", "0.5", "0.5"])
    # which file it read, once: no line without the file's name
    tensors = len(torch.load(checkpoint, weights_only=True)["state_dict"])
    assert f"checkpoint {checkpoint}: ClassificationModule, {tensors} tensors loaded, saved at" in capsys.readouterr().out
    assert not [record for record in caplog.records if record.getMessage().startswith("checkpoint :")]
    # heat maps: 2 layers x 1 head -> 7.0 x (2 * 2.8 + 0.6) in; overlay: 2 layers x 2 images -> 7.0 x (2 * 3.0 + 0.6) in
    with Image.open(out / "heatmaps.png") as heat, Image.open(out / "overlay.png") as overlay:
        assert heat.size == (700, 620)
        assert overlay.size == (700, 660)
        assert np.asarray(heat.convert("L")).std() > 10  # not a blank canvas


def user_error(capsys, argv: list[str]) -> str:
    """What the CLI prints for a mistake in its input: exit status 2, a short `error:` line, no traceback."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ")
    assert "Traceback" not in err and len(err.splitlines()) <= 4
    return err


def test_maps_command_names_a_bad_head(tmp_path, checkpoint, capsys):
    image = digit_png(tmp_path / "digit.png", 0)
    err = user_error(capsys, ["maps", "--ckpt", str(checkpoint), "--image", str(image), "--head", "5", "--out",
                              str(tmp_path)])
    assert re.search(r"has heads 0\.\.1; got \[5\]", err)


def test_sweep_writes_its_grid_of_lengths_and_scales_and_lists_the_runs(tmp_path, capsys):
    out = tmp_path / "sweep"
    cli.main(["sweep", "--config", str(QUICKSTART), "--scales", "0.1", "1", "--lengths", "16", "4", "--steps", "2",
              "--out", str(out), "--dry-run", "--", "--data.init_args.batch_size", "16"])
    grid = yaml.safe_load((out / "grid.yaml").read_text())
    assert (out / grid["base"]).resolve() == QUICKSTART.resolve()  # relative to the grid file
    assert grid["args"]["trainer.max_steps"] == grid["args"]["trainer.val_check_interval"] == 2
    assert grid["args"]["data.init_args.batch_size"] == "16"  # the arguments after --, for every run
    kwargs = {"embed_dim": 64, "depth": 4, "num_heads": 2}  # the quickstart's, with the patch for each length
    assert grid["axes"]["length"] == {"key": "model.init_args.model_kwargs",
                                      "values": {"N16": {**kwargs, "patch_size": 4}, "N4": {**kwargs, "patch_size": 8}}}
    assert grid["axes"]["scale"]["values"] == {"scale0.1": {"name": "poly3", "scale": 0.1},
                                               "scale1": {"name": "poly3", "scale": 1.0}}
    assert grid["report"] == {"metric": "val/top1", "use": "last", "figure": "scale-sweep", "x": "scale",
                              "lines": "length"}
    listed = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("    ")]
    assert listed[-4:] == [f"{name}: not started -> start" for name in
                           ("N16/scale0.1", "N16/scale1", "N4/scale0.1", "N4/scale1")]
    assert sorted(path.name for path in out.iterdir()) == ["grid.yaml"]  # a dry run trains nothing


def test_sweep_refuses_a_figure_as_out_and_another_sweep_in_its_folder(tmp_path, capsys):
    err = user_error(capsys, ["sweep", "--config", str(QUICKSTART), "--scales", "1", "--lengths", "4",
                              "--out", str(tmp_path / "s.png")])
    assert f"--out {tmp_path / 's.png'}: the sweep's folder (its grid file, runs and report/), not a figure" in err
    args = ["sweep", "--config", str(QUICKSTART), "--lengths", "4", "--out", str(tmp_path / "s"), "--dry-run"]
    cli.main([*args, "--scales", "1"])
    before = (tmp_path / "s" / "grid.yaml").read_text()
    err = user_error(capsys, [*args, "--scales", "0.5"])
    assert "grid.yaml holds another sweep (other scales, lengths, steps or config): nothing was changed" in err
    assert (tmp_path / "s" / "grid.yaml").read_text() == before


def test_sweep_on_digits_trains_every_run_as_a_grid_cell(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sweep"
    cli.main(["sweep", "--config", str(QUICKSTART), "--scales", "0.1", "1", "--lengths", "4", "--steps", "2",
              "--out", str(out), "--parallel", "2"])
    for name in ("N4/scale0.1", "N4/scale1"):
        metrics = json.loads((out / "cells" / name / "metrics.json").read_text())
        assert metrics["status"] == "finished" and metrics["steps"] == 2
        assert 0 <= metrics["metrics"]["val/top1"] <= 1


def test_sweep_names_lengths_that_do_not_fit_the_image(tmp_path, capsys):
    err = user_error(capsys, ["sweep", "--config", str(QUICKSTART), "--scales", "1", "--lengths", "8",
                              "--out", str(tmp_path / "s")])
    assert not (tmp_path / "s").exists()
    assert re.search(r"--lengths 8: a 16-px image cuts into .*: 256, 64, 16, 4, 1", err)


def test_norms_command_names_runs_without_norms(tmp_path, capsys):
    run = tmp_path / "runs" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,0,2.3\n")
    err = user_error(capsys, ["norms", str(tmp_path / "runs"), "--out", str(tmp_path / "n.png")])
    assert re.search(r"no attention norms logged under .*runs: the standard norms callback logs them", err)
    err = user_error(capsys, ["norms", str(tmp_path / "missing"), "--out", str(tmp_path / "n.png")])
    assert re.search(r"run directory .*missing does not exist", err)
