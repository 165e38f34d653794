"""The standard callbacks under their short keys: each key changes its callback in a run, ``--print_config`` shows
them, ``callbacks_off`` leaves some out (a user's own callbacks: test_user_callbacks.py)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback, LearningRateMonitor, ModelCheckpoint

from polyattn_lightning import cli
from polyattn_lightning.callbacks import (AttentionNorms, ExactResume, LastCheckpoint, NonFiniteLossError,
                                         NonFiniteLossGuard, PredictionWriter)
from polyattn_lightning.callbacks.standard import STANDARD_KEYS

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "classification" / "quickstart.yaml"
DETECTION_QUICKSTART = ROOT / "configs" / "detection" / "quickstart.yaml"
OLD_RUN = ROOT / "tests" / "fixtures" / "old_run" / "config.yaml"
#: a tiny ViT, a few steps, no validation until the end: a run of a few seconds
SHORT = ["--model.init_args.model_kwargs", "{patch_size: 8, embed_dim: 8, depth: 1, num_heads: 1, mlp_ratio: 1}",
         "--trainer.max_epochs", "1", "--trainer.max_steps", "4", "--trainer.limit_val_batches", "1",
         "--trainer.num_sanity_val_steps", "0", "--trainer.enable_progress_bar", "false",
         "--trainer.enable_model_summary", "false"]
NORM = "attention/phi_norm/layer01/mean"

pytestmark = pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")


class NaNBatchAt(Callback):
    """Fills the images of the batch at global step ``step`` with NaN: that step's loss is NaN."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            batch[0].fill_(float("nan"))


def fit(tmp_path: Path, *args: str):
    """``fit`` of a tiny quickstart with a CSV logger under ``tmp_path`` and a NaN batch at step 1."""
    run = cli.make_cli(["--config", str(QUICKSTART), *SHORT, "--trainer.logger", "CSVLogger",
                        "--trainer.logger.init_args.save_dir", str(tmp_path), *args], run=False)
    run.trainer.callbacks.append(NaNBatchAt(1))
    run.trainer.fit(run.model, datamodule=run.datamodule)
    return run


def test_short_keys_change_their_callbacks_in_a_run(tmp_path):
    run = fit(tmp_path, "--nan_guard.on_nonfinite", "skip", "--norms.every_n_steps", "3",
              "--checkpoint.every_n_train_steps", "2", "--checkpoint.monitor", "train/loss", "--checkpoint.save_top_k",
              "-1", "--checkpoint.filename", "step{step}")
    assert run.trainer.global_step == 4  # the NaN step was skipped, not fatal
    assert all(torch.isfinite(p).all() for p in run.model.parameters())
    log_dir = Path(run.trainer.log_dir)
    assert sorted(p.name for p in (log_dir / "checkpoints").glob("*.ckpt")) == ["last.ckpt", "step2.ckpt", "step4.ckpt"]
    with open(log_dir / "metrics.csv") as file:
        steps = sorted(int(row["step"]) for row in csv.DictReader(file) if row.get(NORM))
    assert steps == [0, 3]
    [best] = [c for c in run.trainer.callbacks if isinstance(c, ModelCheckpoint) and c.filename == "step{step}"]
    assert (best.monitor, best.mode) == ("train/loss", "min")  # a monitor of its own: ModelCheckpoint's mode


def test_the_default_nan_guard_stops_the_run(tmp_path):
    with pytest.raises(NonFiniteLossError, match="global step 1"):
        fit(tmp_path, "--callbacks_off", "[norms]")


def print_config(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", *args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(capsys.readouterr().out)


def test_print_config_shows_every_short_key_with_the_tasks_monitor(capsys):
    config = print_config(capsys, "--config", str(QUICKSTART), "--nan_guard.on_nonfinite", "skip",
                          "--checkpoint.every_n_train_steps", "500", "--norms.every_n_steps", "10")
    assert set(STANDARD_KEYS) - {"resume", "summary"} <= set(config)  # ExactResume and RunSummary have no option
    assert config["nan_guard"] == {"on_nonfinite": "skip"}
    assert config["checkpoint"]["every_n_train_steps"] == 500 and config["norms"]["every_n_steps"] == 10
    assert (config["checkpoint"]["monitor"], config["checkpoint"]["mode"]) == ("val/top1", "max")
    assert config["callbacks_off"] == [] and not config["trainer"]["callbacks"]
    assert config["trainer"]["plugins"] == [{"class_path": "polyattn_lightning.checkpoint.SafeCheckpointIO"}]
    detection = print_config(capsys, "--config", str(DETECTION_QUICKSTART))
    assert (detection["checkpoint"]["monitor"], detection["checkpoint"]["mode"]) == ("val/bbox_mAP", "max")
    given = print_config(capsys, "--config", str(QUICKSTART), "--checkpoint.monitor", "val/loss")
    assert (given["checkpoint"]["monitor"], given["checkpoint"]["mode"]) == ("val/loss", "min")


def callback_types(*args: str) -> list[type]:
    return [type(c) for c in cli.make_cli(["--config", str(QUICKSTART), *args], run=False).trainer.callbacks]


def test_callbacks_off_leaves_out_the_named_ones_and_rejects_unknown_names(capsys):
    kinds = callback_types("--callbacks_off", "[norms, predictions]")
    assert AttentionNorms not in kinds and PredictionWriter not in kinds
    assert {ExactResume, NonFiniteLossGuard, LearningRateMonitor} <= set(kinds)
    assert kinds.count(ModelCheckpoint) == kinds.count(LastCheckpoint) == 1
    assert LastCheckpoint not in callback_types("--callbacks_off", "[last_checkpoint]")
    assert not {ModelCheckpoint, LastCheckpoint} & set(callback_types("--trainer.enable_checkpointing", "false"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["fit", "--config", str(QUICKSTART), "--callbacks_off", "[norm]"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "callbacks_off" in error and "norms" in error  # the given value and the valid names
