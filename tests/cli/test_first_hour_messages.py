"""What a new user meets in the first hour: every verb in --help, one-line errors for a model that cannot be built
or switched and for --data.root on the bundled digits, loader workers sized to this process's CPUs, predicting a
folder of unlabelled images, and a progress bar that names no epoch -2."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from training_helpers import write_jpeg
from lightning.pytorch.loops.utilities import _parse_loop_limits
from training_helpers import cpu_trainer

from polyattn_lightning import cli
from polyattn_lightning.cli.dispatch import COMMANDS
from polyattn_lightning.callbacks import PredictionWriter
from polyattn_lightning.callbacks.progress import StepsRichProgressBar
from polyattn_lightning.data import ImageFolderDataModule
from polyattn_lightning.data.base import available_cpus
from polyattn_lightning.tasks import ClassificationModule

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"
LRA_QUICKSTART = ROOT / "configs" / "lra" / "quickstart.yaml"

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


def test_help_lists_every_verb(capsys, monkeypatch):
    monkeypatch.setattr("sys.argv", ["polyattn"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code in (0, None)
    out = capsys.readouterr().out
    assert "{fit,validate,test,predict}" in out
    assert all(f"\n  {verb} " in out for verb in COMMANDS)


def one_line_error(capsys, *args: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(QUICKSTART), *args])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_a_model_that_cannot_be_built_is_a_one_line_error(capsys):
    err = one_line_error(capsys, "--model.init_args.model_kwargs", "{patch_size: 4, no_such_option: 1}")
    assert "timm cannot build vit_tiny_patch16_224" in err and "no_such_option" in err
    assert len(err.splitlines()) <= 2


def test_a_model_that_cannot_run_at_the_configured_size_is_a_one_line_error(capsys):
    """CrossViT's 16-px patches do not fit the digits' 16-px images: its probe forward fails before any switch."""
    err = one_line_error(capsys, "--model.init_args.model_name", "crossvit_tiny_240", "--model.init_args.model_kwargs", "{}")
    assert err.startswith("error: CrossVit cannot run one forward on the probe input, switched or not (RuntimeError: ")
    assert len(err.splitlines()) <= 2


def test_an_image_size_given_twice_is_a_one_line_error(capsys):
    err = one_line_error(capsys, "--model.init_args.model_kwargs", "{patch_size: 4, img_size: 224}")
    assert "model.init_args.model_kwargs.img_size" in err and "as model.init_args.img_size" in err
    assert len(err.splitlines()) <= 2


def test_data_root_on_the_bundled_digits_points_to_the_image_folder_line(capsys):
    err = one_line_error(capsys, "--data.root", "somewhere")
    assert err.startswith("error: data.init_args.root is not an option of DigitsDataModule\n")
    assert "--data ImageFolderDataModule --data.root DIR" in err
    assert "--data ImageFolderDataModule --data.root DIR" in (ROOT / "README.md").read_text()


def test_loader_workers_default_to_the_cpus_this_process_may_use():
    assert ImageFolderDataModule("unused").num_workers == available_cpus() <= 8
    allowed = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert available_cpus() == 1
    finally:
        os.sched_setaffinity(0, allowed)
    assert available_cpus(cap=None) == len(allowed) and available_cpus(cap=1) == 1


def test_predict_root_predicts_every_image_below_it_without_labels(image_folder, tmp_path):
    unlabelled = [write_jpeg(tmp_path / "new" / name, seed=i) for i, name in enumerate(["a.jpg", "b/c.png", "b/d/e.JPEG"])]
    (tmp_path / "new" / "notes.txt").write_text("not an image")
    data = ImageFolderDataModule(str(image_folder), img_size=16, batch_size=2, num_workers=0,
                                 predict_root=str(tmp_path / "new"))
    model = ClassificationModule("vit_tiny_patch16_224", num_classes=3, img_size=16,
                                 model_kwargs=dict(patch_size=8, embed_dim=8, depth=1, num_heads=1))
    trainer = cpu_trainer(callbacks=[PredictionWriter()], default_root_dir=tmp_path / "run")
    trainer.predict(model, datamodule=data, return_predictions=False)
    saved = torch.load(tmp_path / "run" / "predictions" / "rank0.pt", weights_only=True)
    assert sorted(saved["paths"]) == sorted(map(str, unlabelled))
    assert saved["predictions"].shape == (3, 3) and saved["classes"] == data.classes
    with pytest.raises(FileNotFoundError, match="--data.predict_root .*missing: no such folder"):
        ImageFolderDataModule(str(image_folder), predict_root=str(tmp_path / "missing")).setup("predict")


def test_a_run_counted_in_steps_shows_no_last_epoch():
    trainer = cli.make_cli(["--config", str(LRA_QUICKSTART)], run=False).trainer
    bar = trainer.progress_bar_callback
    # what fit sets for a run given max_steps only (Lightning's RichProgressBar then shows "Epoch 6/-2")
    _, trainer.fit_loop.max_epochs = _parse_loop_limits(None, trainer.max_steps, None, trainer.max_epochs, trainer)
    assert isinstance(bar, StepsRichProgressBar) and trainer.max_epochs == -1
    bar._trainer = trainer  # set by its setup() when a fit starts
    assert bar._get_train_description(6).strip() == "Epoch 6"
    assert trainer.logger.log_dir.startswith(os.path.join("runs", "lra", "quickstart"))  # not the others' folder
