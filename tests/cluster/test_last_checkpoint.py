"""last.ckpt holds the latest validation's state, not the best one's: what a resume or a requeue needs."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from polyattn_lightning import cli

QUICKSTART = Path(__file__).resolve().parents[2] / "configs" / "classification" / "quickstart.yaml"


@pytest.mark.filterwarnings("ignore:LightningCLI's args parameter is intended")
def test_last_checkpoint_follows_training_when_the_best_stays_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # lr 0: validation top-1 is the same every epoch, so the best checkpoint stays at epoch 0
    run = cli.make_cli(["fit", "--config", str(QUICKSTART), "--trainer.max_epochs", "3",
                        "--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "2",
                        "--trainer.enable_progress_bar", "false",
                        "--model.init_args.optim.lr", "0.0", "--model.init_args.optim.min_lr", "0.0"])
    folder = Path(run.trainer.log_dir) / "checkpoints"
    best = [p for p in folder.iterdir() if p.name.startswith("best-")]
    assert [p.name for p in best] == ["best-epoch000.ckpt"]
    last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["epoch"] == 2 and last["global_step"] == 6
