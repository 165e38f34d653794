"""Exact resume: a run killed and resumed from its last checkpoint matches an uninterrupted run bit for bit.

Covered: weights, optimizer moments, lr schedule, the EMA of the weights, the
order of the data, and the logged loss curve; with Mixup/CutMix and drop path
on, so the RNG states in the checkpoint matter. Both a checkpoint taken at the
end of an epoch and one taken in the middle (which needs the resumable loader).
"""
from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from cluster_harness import MemoryLogger, cpu_trainer, digits, tiny_classifier
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint

from polyattn_lightning.callbacks import ExactResume

STEPS_PER_EPOCH, EPOCHS = 4, 3


class Killed(Exception):
    """Stands for the job being preempted."""


class KillAt(Callback):
    def __init__(self, step: int | None):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise Killed


class RecordBatches(Callback):
    """What each optimizer step trained on: (global step, batch index, the batch's bytes)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int, bytes]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        images, targets = batch
        self.seen.append((trainer.global_step, batch_idx, images.numpy().tobytes() + targets.numpy().tobytes()))


def train(ckpt_dir, every_n_train_steps=None, kill_at=None, ckpt_path=None) -> dict:
    """Fit 3 epochs of 4 steps (or until killed); returns what must match across runs."""
    pl.seed_everything(0, workers=True)
    model, logger, record = tiny_classifier(mixup=True, drop_path=0.1), MemoryLogger(), RecordBatches()
    ema = EMAWeightAveraging(decay=0.9)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, save_last=True, every_n_train_steps=every_n_train_steps
    )
    trainer = cpu_trainer(
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=2,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=True,
        callbacks=[ema, ExactResume(), record, KillAt(kill_at), checkpoint],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader is not resumable.*")
        try:
            trainer.fit(model, digits(batch_size=32), ckpt_path=ckpt_path)
        except Killed:
            return {}
    return {
        "weights": model.state_dict(),  # the EMA weights: EMAWeightAveraging copies them in at the end
        "ema": ema._average_model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "lr_schedule": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "batches": record.seen,
        "loss": logger.history["train/loss"],
    }


def assert_identical(a, b, path="run") -> None:
    """Recursive bitwise equality of nested state (tensors, containers, plain values)."""
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{path}: keys differ"
        for key in a:
            assert_identical(a[key], b[key], f"{path}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


@pytest.mark.parametrize(
    "every_n_train_steps, kill_at, resumed_from",
    [
        (None, STEPS_PER_EPOCH + 2, STEPS_PER_EPOCH),  # end-of-epoch checkpoint, killed 2 steps into epoch 1
        (3, 2 * STEPS_PER_EPOCH - 1, 2 * STEPS_PER_EPOCH - 2),  # mid-epoch checkpoint at step 6 (epoch 1, batch 2)
    ],
    ids=["end_of_epoch", "mid_epoch"],
)
def test_resumed_run_matches_uninterrupted_run(tmp_path, every_n_train_steps, kill_at, resumed_from):
    reference = train(tmp_path / "reference", every_n_train_steps)
    assert train(tmp_path / "killed", every_n_train_steps, kill_at=kill_at) == {}
    last = tmp_path / "killed" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == resumed_from
    resumed = train(tmp_path / "killed", every_n_train_steps, ckpt_path=last)

    # the resumed run picks up at the checkpoint's step, and from there on everything is the same
    assert resumed["batches"][0][0] == resumed_from
    assert resumed["batches"] == reference["batches"][resumed_from:]
    assert resumed["loss"] == {s: v for s, v in reference["loss"].items() if s >= resumed_from}
    for key in ("weights", "ema", "optimizer", "lr_schedule"):
        assert_identical(resumed[key], reference[key], key)
