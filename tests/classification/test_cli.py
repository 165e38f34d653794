"""The CLI: every config builds, and `fit` runs on the quickstart and on JPEG layouts on disk."""
from __future__ import annotations

import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch import Trainer

from training_helpers import (CONFIGS, QUICKSTART, built, config_piece, experiment_configs, fit, named_pieces,
                              resolved_config, runs_activation)

from polyattn_lightning import cli
from polyattn_lightning.cli import defaults
from polyattn_lightning.models.timm_builder import create_timm_model

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")

EXPERIMENTS = experiment_configs(CONFIGS / "classification")
TINY_IMAGENET = CONFIGS / "classification" / "tiny_imagenet" / "vit_tiny.yaml"
DEIT_SMALL = CONFIGS / "classification" / "imagenet" / "deit_small.yaml"
#: the x^3 settings of the paper's tables (1/sqrt(N) on Tiny-ImageNet, the fixed 1/14 on ImageNet), as their grids give
SCALED_POLY3 = ("--model.init_args.attention", "{name: poly3, scale: inv_sqrt_n}")
POLY3_14 = ("--model.init_args.attention", "{name: poly3, scale: 0.07142857142857142}")
#: ``model_kwargs`` that shrink each timm family (the model name's first word) to one or two thin blocks; the
#: image size stays the config's. A family not listed is built at the config's own size.
TINY_MODELS = {
    **dict.fromkeys(("vit", "deit", "beit", "eva02"), {"depth": 1, "embed_dim": 32, "num_heads": 2}),
    "xcit": {"depth": 1, "embed_dim": 32, "num_heads": 2, "cls_attn_layers": 1},
    **dict.fromkeys(("swin", "swinv2"), {"depths": (1, 1), "embed_dim": 16, "num_heads": (1, 2)}),
    "maxvit": {"depths": (1, 1), "embed_dim": (32, 64), "stem_width": 16},
}
#: the tiny layout each DataModule reads (a fixture of conftest.py); the digits are bundled
DATA_LAYOUT = {"ImageFolderDataModule": "image_folder", "TinyImageNetDataModule": "tiny_imagenet"}


@pytest.mark.parametrize("path", EXPERIMENTS, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_experiment_config_builds(request, tmp_path, monkeypatch, path: Path):
    """Model and data built through the CLI as ``fit`` would, the model shrunk through ``model_kwargs``, on a
    tiny layout of the config's data, without its pretrained file (they are the user's to place)."""
    monkeypatch.chdir(tmp_path)
    model = config_piece(path, "model")["init_args"]
    data_class = config_piece(path, "data")["class_path"].rsplit(".", 1)[-1]
    tiny = {**(model.get("model_kwargs") or {}), **TINY_MODELS.get(model["model_name"].split("_")[0], {})}
    args = ["--model.init_args.model_kwargs", json.dumps(tiny), "--model.init_args.pretrained", "null"]
    if data_class in DATA_LAYOUT:
        args += ["--data.root", str(request.getfixturevalue(DATA_LAYOUT[data_class])), "--data.num_workers", "0"]
    run = built(path, *args)
    assert run.model.hparams.num_classes == run.datamodule.num_classes
    assert run.model.model.pretrained_cfg["architecture"] == model["model_name"]
    assert runs_activation(run.model.model, model["attention"])


def test_every_shared_config_piece_is_used_by_an_experiment():
    """Pieces are parsed only through the files that name them; an unnamed piece would go unchecked."""
    # detection, LRA and HF keep their experiments and pieces under configs/detection, configs/lra and configs/hf
    # (their own tests), the grids theirs under configs/grids (tests/grids/test_grid_files.py); strategy/ddp.yaml is
    # named by scripts/slurm/train.sbatch (tests/cluster), trainer/fsdp.yaml is added on the command line (--trainer,
    # tests/sharding/test_sharded_cli.py)
    others = ("detection", "lra", "hf", "grids")
    pieces = {p for p in CONFIGS.rglob("*.yaml") if p.relative_to(CONFIGS).parts[0] not in others}
    pieces -= {CONFIGS / "strategy" / "ddp.yaml", CONFIGS / "classification" / "trainer" / "fsdp.yaml"}
    pieces -= set(EXPERIMENTS)
    assert {piece.resolve() for piece in pieces} <= named_pieces(CONFIGS)


def test_precision_is_bf16_mixed_on_gpu_and_fp32_on_cpu(capsys, monkeypatch):
    assert resolved_config(capsys, QUICKSTART)["trainer"]["precision"] == defaults.default_precision()
    monkeypatch.setattr(defaults, "default_precision", lambda: "bf16-mixed")
    assert resolved_config(capsys, QUICKSTART)["trainer"]["precision"] == "bf16-mixed"


def test_a_batch_limit_given_as_an_int_counts_batches_whatever_union_the_typing_cache_gave(capsys, monkeypatch):
    """``1`` is one batch and ``1.0`` the whole epoch, also where Python's typing cache handed Lightning's Trainer
    its ``Optional[Union[int, float]]`` float first (as in the lowest environment: ``lightning.fabric`` made that
    union first, and jsonargparse tries a union's types in order)."""
    init = inspect.unwrap(Trainer.__init__)
    for name in defaults.BATCH_LIMITS:
        monkeypatch.setitem(init.__annotations__, name, float | int | None)
    given = dict(limit_train_batches="1", limit_val_batches="1.0", limit_test_batches="0.5", limit_predict_batches="3")
    config = resolved_config(capsys, QUICKSTART, *(f"--trainer.{name}={value}" for name, value in given.items()))
    assert {name: repr(config["trainer"][name]) for name in given} == given


def test_python_m_help_names_the_command():
    result = subprocess.run([sys.executable, "-m", "polyattn_lightning", "fit", "--help"], capture_output=True,
                            text=True, check=True)
    assert result.stdout.startswith("usage: python -m polyattn_lightning [options] fit")


def test_quickstart_fit_fast_dev_run_through_main(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli.main(["fit", "--config", str(QUICKSTART), "--trainer.fast_dev_run", "2"])


def test_quickstart_learns(tmp_path, monkeypatch):
    """Four epochs (176 steps, seed 0) take the 4-layer poly3 ViT far above the 10% of chance."""
    monkeypatch.chdir(tmp_path)
    trained = fit("--config", str(QUICKSTART), "--trainer.max_epochs", "4")
    assert trained.trainer.global_step == 176
    assert trained.trainer.callback_metrics["val/top1"] > 0.5
    assert (tmp_path / "runs" / "classification" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_a_run_in_an_earlier_runs_log_dir_keeps_its_config(tmp_path, monkeypatch):
    """A requeued SLURM job logs into the same ``slurm-<job id>`` version: it must run, and not overwrite the config."""
    monkeypatch.chdir(tmp_path)
    args = ("--config", str(QUICKSTART), "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "1",
            "--trainer.limit_val_batches", "1", "--trainer.logger.init_args.version", "slurm-7")
    log_dir = tmp_path / "runs" / "classification" / "quickstart" / "slurm-7"
    fit(*args)
    first = (log_dir / "config.yaml").read_text()
    (log_dir / "config.yaml").write_text(first + "# the user's note\n")
    second = fit(*args, "--ckpt_path", str(log_dir / "checkpoints" / "last.ckpt"), "--trainer.max_epochs", "2")
    assert second.trainer.global_step == 2
    assert (log_dir / "config.yaml").read_text() == first + "# the user's note\n"
    assert yaml.safe_load((log_dir / "config.1.yaml").read_text())["trainer"]["max_epochs"] == 2


def test_resuming_a_fine_tuned_run_does_not_need_the_pretrained_file(tmp_path, monkeypatch):
    """The checkpoint holds the weights: the pretrained file it started from may be gone."""
    monkeypatch.chdir(tmp_path)
    weights = tmp_path / "pretrained.pth"
    model_args = yaml.safe_load(QUICKSTART.read_text())["model"]["init_args"]
    model = create_timm_model(model_args["model_name"], 10, 16, **model_args["model_kwargs"])  # digits' classes, size
    torch.save(model.state_dict(), weights)
    args = ("--config", str(QUICKSTART), "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1")
    fit(*args, "--trainer.max_epochs", "1", "--model.init_args.pretrained", str(weights))
    weights.unlink()
    ckpt = tmp_path / "runs" / "classification" / "quickstart" / "version_0" / "checkpoints" / "last.ckpt"
    resumed = fit(*args, "--trainer.max_epochs", "2", "--ckpt_path", str(ckpt))
    assert resumed.trainer.global_step == 4


def test_predict_saves_probabilities_for_every_sample_in_data_set_order(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ("--config", str(QUICKSTART), "--trainer.enable_progress_bar", "false")
    trained = fit(
        *args, "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"
    )
    run = tmp_path / "runs" / "classification" / "quickstart" / "version_0"
    cli.make_cli(["predict", *args, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")])
    saved = torch.load(run / "predict_last" / "predictions" / "rank0.pt", weights_only=True)
    val_set = trained.datamodule.val_set
    assert saved["predictions"].shape == (len(val_set), 10)
    torch.testing.assert_close(saved["predictions"].sum(dim=1), torch.ones(len(val_set)))
    assert saved["indices"].tolist() == list(range(len(val_set)))
    assert saved["classes"] == [str(digit) for digit in range(10)]
    assert not (tmp_path / "runs" / "classification" / "quickstart" / "version_1").exists()


def test_lr_is_scaled_by_the_global_batch(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["--trainer.accumulate_grad_batches", "2", "--model.optim.reference_batch", "512"]
    trained = fit("--config", str(QUICKSTART), "--trainer.fast_dev_run", "1", *args)
    lr, batch = trained.model.optim.lr, trained.datamodule.batch_size
    assert trained.trainer.optimizers[0].param_groups[0]["initial_lr"] == pytest.approx(lr * batch * 2 / 512)


def test_tiny_imagenet_experiment_fits_on_its_layout(tmp_path, monkeypatch, tiny_imagenet):
    """The real experiment config (12-layer ViT-Tiny, Mixup/CutMix, RandAugment) with x^3 on a 3-class layout."""
    monkeypatch.chdir(tmp_path)
    trained = fit(
        "--config", str(TINY_IMAGENET), *SCALED_POLY3, "--trainer.fast_dev_run", "1",
        "--data.root", str(tiny_imagenet), "--data.batch_size", "2", "--data.num_workers", "0",
        "--data.pin_memory", "false",
    )  # fmt: skip
    assert trained.trainer.callback_metrics["train/loss"].isfinite()
    assert trained.model.hparams.num_classes == 3  # the layout's, the config states none


@pytest.mark.filterwarnings("error:You're using the WeightAveraging callback")
def test_imagenet_experiment_fits_on_an_image_folder(tmp_path, monkeypatch, image_folder):
    """DeiT-S with the DeiT recipe, EMA and x^3, shrunk to 32 px, on ImageNet-style class folders; the EMA
    prints no warning about sharded layers (none are)."""
    monkeypatch.chdir(tmp_path)
    trained = fit(
        "--config", str(DEIT_SMALL), *POLY3_14, "--trainer.fast_dev_run", "1", "--data.img_size", "32",
        "--data.root", str(image_folder),
        "--data.batch_size", "2", "--data.num_workers", "0", "--data.pin_memory", "false",
    )  # fmt: skip
    assert {"train/loss", "val/top1", "val/top5"} <= set(trained.trainer.callback_metrics)
    assert (trained.model.hparams.num_classes, trained.model.hparams.img_size) == (3, 32)  # both the data's


def test_num_classes_that_disagree_with_the_data_stop_before_training(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"num_classes is 7 but DigitsDataModule has num_classes=10"):
        fit("--config", str(QUICKSTART), "--trainer.fast_dev_run", "1", "--model.num_classes", "7")


def test_missing_data_root_is_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist"):
        fit("--config", str(TINY_IMAGENET), "--trainer.fast_dev_run", "1", "--data.root", str(tmp_path / "nowhere"))
