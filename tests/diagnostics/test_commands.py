"""`polyattn maps` from a checkpoint made here and `polyattn sweep` on the digits quickstart, through the CLI."""
from __future__ import annotations

import csv
import re
from pathlib import Path

import numpy as np
import pytest
import torch
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


def test_sweep_on_digits_writes_csv_and_png(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "sweep.png"
    cli.main(["sweep", "--config", str(QUICKSTART), "--scales", "0.1", "1", "--lengths", "16", "4", "--steps", "2",
              "--out", str(out)])
    with open(out.with_suffix(".csv"), newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(int(r["tokens"]), int(r["patch_size"]), float(r["scale"])) for r in rows] == [
        (16, 4, 0.1), (16, 4, 1.0), (4, 8, 0.1), (4, 8, 1.0)
    ]
    assert all(0 <= float(r["val_top1"]) <= 1 and r["activation"].startswith("poly3") for r in rows)
    with Image.open(out) as image:
        assert image.size == (750, 500)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sweep.csv", "sweep.png"]  # the runs kept nothing


def test_sweep_names_lengths_that_do_not_fit_the_image(tmp_path, capsys):
    err = user_error(capsys, ["sweep", "--config", str(QUICKSTART), "--scales", "1", "--lengths", "8",
                              "--out", str(tmp_path / "s.png")])
    assert re.search(r"--lengths 8: a 16-px image cuts into .*: 256, 64, 16, 4, 1", err)


def test_norms_command_names_runs_without_norms(tmp_path, capsys):
    run = tmp_path / "runs" / "version_0"
    run.mkdir(parents=True)
    (run / "metrics.csv").write_text("epoch,step,train/loss\n0,0,2.3\n")
    err = user_error(capsys, ["norms", str(tmp_path / "runs"), "--out", str(tmp_path / "n.png")])
    assert re.search(r"no attention norms logged under .*runs: the standard norms callback logs them", err)
    err = user_error(capsys, ["norms", str(tmp_path / "missing"), "--out", str(tmp_path / "n.png")])
    assert re.search(r"run directory .*missing does not exist", err)
