"""LRAModule: sized from its DataModule, rebuilt from its checkpoint, tested with the best checkpoint at the end of
fit, the linear one-cycle schedule, and exact resume on LRA batches."""
from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from training_helpers import Killed, KillAt

from polyattn_lightning.callbacks import ExactResume
from polyattn_lightning.data.lra import ListOpsDataModule, ListOpsSpec
from polyattn_lightning.data.lra.listops import write_dataset
from polyattn_lightning.errors import ConfigError
from polyattn_lightning.tasks import LRAModule, OptimRecipe
from polyattn_lightning.tasks.lra import LRA_OPTIM
from polyattn_lightning.tasks.optim import build_optimizer, build_scheduler

TINY = ListOpsSpec(num_train=64, num_val=16, num_test=21, min_length=10, max_length=60, max_depth=3, max_args=4, seed=0)
FAST = OptimRecipe(lr=2e-3, reference_batch=None, weight_decay=0.0, eps=1e-6, warmup_steps=2, warmup_lr=1e-4,
                   min_lr=1e-6, schedule="linear")


@pytest.fixture
def listops(tmp_path) -> ListOpsDataModule:
    """A tiny ListOps set made by the generator, written in the release's TSV format."""
    return ListOpsDataModule(root=str(write_dataset(TINY, tmp_path / "listops")), max_length=64, batch_size=8)


def trainer(root, max_steps: int, *callbacks: Callback, **kwargs) -> pl.Trainer:
    kwargs = {"val_check_interval": 4, "check_val_every_n_epoch": None, "logger": False, **kwargs}
    return pl.Trainer(
        accelerator="cpu", max_steps=max_steps, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, callbacks=list(callbacks), **kwargs,
    )


def accuracy(module: LRAModule, dataloader) -> float:
    module.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in dataloader:
            correct += (module(batch["input_ids"], batch["mask"]).argmax(-1) == batch["label"]).sum().item()
            total += len(batch["label"])
    return correct / total


class FinalWeights(Callback):
    """The weights at the end of training, before the test loads the best checkpoint into the module."""

    def on_train_end(self, trainer, pl_module) -> None:
        self.state = {name: value.clone() for name, value in pl_module.state_dict().items()}


def test_fit_ends_with_a_test_of_the_best_checkpoint(tmp_path, listops):
    pl.seed_everything(0)
    # "best" = the earliest (step 4 of 16), so that the tested weights are surely not the last ones
    best = ModelCheckpoint(dirpath=tmp_path / "ckpt", monitor="step", mode="min")
    final = FinalWeights()
    module = LRAModule(attention={"name": "poly3", "scale": 0.0714}, optim=FAST)
    fit = trainer(tmp_path, 16, best, final)
    fit.fit(module, datamodule=listops)

    assert fit.ckpt_path == best.best_model_path and "step=4" in best.best_model_path
    assert module.hparams.vocab_size == 16 and module.hparams.num_classes == 10 and module.hparams.max_length == 64
    assert module.hparams.two_tower is False
    restored = LRAModule.load_from_checkpoint(best.best_model_path)  # rebuilt from the saved hyperparameters
    assert not torch.equal(restored.model.head[-1].weight, final.state["model.head.2.weight"])

    # an independent count over the whole test set (21 samples: the last batch is ragged) with the best weights
    assert fit.callback_metrics["test/top1"].item() == pytest.approx(accuracy(restored, listops.test_dataloader()))
    assert len(listops.test_set) == 21


def test_fit_without_test_after_fit_or_checkpoint(tmp_path, listops):
    module = LRAModule(optim=FAST, test_after_fit=False)
    fit = trainer(tmp_path, 4, enable_checkpointing=False)
    fit.fit(module, datamodule=listops)
    assert "val/top1" in fit.callback_metrics and "test/top1" not in fit.callback_metrics

    module = LRAModule(optim=FAST)  # no checkpoint to choose from: the last weights are tested, with a warning
    logger = CSVLogger(tmp_path / "runs", name="lra")
    fit = trainer(tmp_path, 4, enable_checkpointing=False, logger=logger)
    with pytest.warns(UserWarning, match="no best checkpoint"):
        fit.fit(module, datamodule=listops)
    assert fit.callback_metrics["test/top1"].item() == pytest.approx(accuracy(module, listops.test_dataloader()))
    assert fit.ckpt_path == str(tmp_path / "runs" / "lra" / "version_0" / "checkpoints" / "end_of_fit.ckpt")
    assert Path(fit.ckpt_path).is_file() and not list(tmp_path.glob("*.ckpt"))  # in the run's folder only


def test_sizes_given_and_disagreeing_with_the_data_are_named(tmp_path, listops):
    with pytest.raises(ConfigError, match="model.init_args.num_classes is 5 but ListOpsDataModule has num_classes=10"):
        trainer(tmp_path, 1).fit(LRAModule(num_classes=5), datamodule=listops)
    with pytest.raises(ConfigError, match="LRAModule needs vocab_size"):
        LRAModule().configure_model()
    built = LRAModule(vocab_size=16, num_classes=10, max_length=64, two_tower=False)  # no data needed
    assert isinstance(built.model.head[-1], nn.Linear) and built.model.head[-1].out_features == 10


def test_linear_schedule_warms_up_then_decays_linearly_to_the_floor():
    """Xiong et al.'s OneCycleLR(anneal_strategy="linear") shape: lr/25 -> lr over the warmup, -> lr/25e4 at the end."""
    optimizer = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=LRA_OPTIM.lr)
    recipe = OptimRecipe(**{**LRA_OPTIM.__dict__, "warmup_steps": 100})
    scheduler = build_scheduler(optimizer, recipe, total_steps=1100, steps_per_epoch=7)
    lrs = {}
    for step in (0, 50, 100, 600, 1100):
        scheduler.step_update(num_updates=step)
        lrs[step] = optimizer.param_groups[0]["lr"]
    peak, start, floor = 1e-4, 4e-6, 4e-10
    expected = {0: start, 50: (start + peak) / 2, 100: peak, 600: (peak + floor) / 2, 1100: floor}
    assert lrs == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ConfigError, match="unknown schedule 'one_cycle'"):
        build_scheduler(optimizer, OptimRecipe(schedule="one_cycle"), 10, 1)
    with pytest.raises(ConfigError, match="the step schedule needs decay_epochs"):
        build_scheduler(optimizer, OptimRecipe(schedule="step"), 10, 1)
    with pytest.raises(ConfigError, match="the cosine schedule needs a finite run"):
        build_scheduler(optimizer, OptimRecipe(schedule="cosine"), float("inf"), 1)
    with pytest.raises(ConfigError, match="both no_decay_keys and layer_decay"):
        build_optimizer(nn.Linear(2, 2), OptimRecipe(no_decay_keys=["bias"], layer_decay=0.65), 1e-3)


def train(root, listops, kill_at=None, ckpt_path=None) -> dict | None:
    """12 steps of 8 samples (an epoch is 8 steps), with dropout on, so the restored RNG states matter."""
    pl.seed_everything(0)
    module = LRAModule(attention="relu", optim=FAST, test_after_fit=False)
    checkpoint = ModelCheckpoint(dirpath=root, save_last=True, every_n_train_steps=3)
    fit = trainer(root, 12, ExactResume(), KillAt(kill_at), checkpoint, val_check_interval=6)
    try:
        fit.fit(module, datamodule=listops, ckpt_path=ckpt_path)
    except Killed:
        return None
    return {"weights": module.state_dict(), "optimizer": fit.optimizers[0].state_dict()["state"]}


def test_a_run_killed_mid_epoch_resumes_exactly(tmp_path, listops):
    reference = train(tmp_path / "reference", listops)
    assert train(tmp_path / "killed", listops, kill_at=4) is None  # the last checkpoint is at step 3, mid-epoch
    resumed = train(tmp_path / "killed", listops, ckpt_path=tmp_path / "killed" / "last.ckpt")
    for name, weight in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    for index, state in reference["optimizer"].items():
        assert torch.equal(resumed["optimizer"][index]["exp_avg"], state["exp_avg"])


class SaveHpcCheckpointAtStart(Callback):
    """A requeue checkpoint of the untrained weights in default_root_dir, as an earlier preemption leaves one."""

    def on_train_start(self, trainer, pl_module) -> None:
        trainer.save_checkpoint(f"{trainer.default_root_dir}/hpc_ckpt_1.ckpt")


def test_test_after_fit_under_slurm_tests_the_end_weights_not_an_hpc_checkpoint(tmp_path, listops, monkeypatch):
    """Under SLURM, Lightning resolves ``ckpt_path=None`` to the newest hpc checkpoint: the test must name its file."""
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "lra")
    pl.seed_everything(0)
    final, module = FinalWeights(), LRAModule(optim=FAST)
    fit = trainer(tmp_path, 4, SaveHpcCheckpointAtStart(), final, enable_checkpointing=False)
    with pytest.warns(UserWarning, match="no best checkpoint"):
        fit.fit(module, datamodule=listops)
    assert (tmp_path / "hpc_ckpt_1.ckpt").exists() and fit.ckpt_path != str(tmp_path / "hpc_ckpt_1.ckpt")
    for name, value in module.state_dict().items():  # the tested weights are the end-of-fit ones
        assert torch.equal(value, final.state[name]), name
    assert fit.callback_metrics["test/top1"].item() == pytest.approx(accuracy(module, listops.test_dataloader()))
