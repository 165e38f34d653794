"""Exact resume: a run killed and resumed from its last checkpoint matches an uninterrupted run bit for bit.

Covered: weights, optimizer moments, lr schedule, the EMA of the weights, the
order and augmented pixels of the data, and the logged loss curve; with
Mixup/CutMix, drop path, random augmentation and validation on, so the RNG
states in the checkpoint matter. Both a checkpoint taken at the end of an epoch
and one taken in the middle (which needs the resumable loader), also with two
persistent loader workers. And a resumed run keeps its checkpoint's lr schedule.
"""
from __future__ import annotations

import warnings

import lightning.pytorch as pl
import pytest
import torch
from cluster_harness import MemoryLogger, RecordBatches, augmented_digits, tiny_classifier
from lightning.pytorch.callbacks import Callback, EMAWeightAveraging, ModelCheckpoint
from training_helpers import Killed, KillAt, cpu_trainer

from polyattn_lightning.callbacks import EMA, ExactResume

STEPS_PER_EPOCH, EPOCHS = 4, 3


class RecordLR(Callback):
    def __init__(self) -> None:
        self.lr: dict[int, float] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.lr[trainer.global_step] = trainer.optimizers[0].param_groups[0]["lr"]


def train(ckpt_dir, every_n_train_steps=None, kill_at=None, ckpt_path=None, num_workers=0, max_epochs=EPOCHS) -> dict:
    """Fit 3 epochs of 4 steps (or until killed); returns what must match across runs."""
    pl.seed_everything(0, workers=True)
    model, logger, record, lr = tiny_classifier(mixup=True, drop_path=0.1), MemoryLogger(), RecordBatches(), RecordLR()
    ema = EMA(decay=0.9)  # the project's, Lightning's EMAWeightAveraging without its sharding warning
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, save_last=True, every_n_train_steps=every_n_train_steps
    )
    trainer = cpu_trainer(
        max_epochs=max_epochs,
        limit_train_batches=STEPS_PER_EPOCH,
        limit_val_batches=2,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=True,
        callbacks=[ema, ExactResume(), record, lr, KillAt(kill_at), checkpoint],
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*dataloader is not resumable.*")
        try:
            trainer.fit(model, augmented_digits(batch_size=32, num_workers=num_workers), ckpt_path=ckpt_path)
        except Killed:
            return {}
    return {
        "weights": model.state_dict(),  # the EMA weights: the EMA copies them in at the end
        "ema": ema._average_model.state_dict(),
        "optimizer": trainer.optimizers[0].state_dict(),
        "lr_schedule": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "batches": record.seen,
        "loss": logger.history["train/loss"],
        "lr": lr.lr,
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
    "every_n_train_steps, kill_at, resumed_from, num_workers",
    [
        (None, STEPS_PER_EPOCH + 2, STEPS_PER_EPOCH, 0),  # end-of-epoch checkpoint, killed 2 steps into epoch 1
        (3, 2 * STEPS_PER_EPOCH - 1, 2 * STEPS_PER_EPOCH - 2, 0),  # mid-epoch checkpoint at step 6 (epoch 1, batch 2)
        # the same with 2 persistent workers: DataLoader asks the batch sampler for its first iterator twice,
        # the workers' RNGs stand elsewhere after a restart, and validation has run in one run but not the other
        pytest.param(3, 2 * STEPS_PER_EPOCH - 1, 2 * STEPS_PER_EPOCH - 2, 2, marks=pytest.mark.slow),
    ],
    ids=["end_of_epoch", "mid_epoch", "mid_epoch_2_workers"],
)
def test_resumed_run_matches_uninterrupted_run(tmp_path, every_n_train_steps, kill_at, resumed_from, num_workers):
    reference = train(tmp_path / "reference", every_n_train_steps, num_workers=num_workers)
    assert train(tmp_path / "killed", every_n_train_steps, kill_at=kill_at, num_workers=num_workers) == {}
    last = tmp_path / "killed" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == resumed_from
    resumed = train(tmp_path / "killed", every_n_train_steps, ckpt_path=last, num_workers=num_workers)

    # the resumed run picks up at the checkpoint's step, and from there on everything is the same
    assert resumed["batches"][0][0] == resumed_from
    assert resumed["batches"] == reference["batches"][resumed_from:]
    assert resumed["loss"] == {s: v for s, v in reference["loss"].items() if s >= resumed_from}
    for key in ("weights", "ema", "optimizer", "lr_schedule"):
        assert_identical(resumed[key], reference[key], key)


def test_resuming_with_more_epochs_keeps_the_checkpoints_schedule_and_warns_once(tmp_path):
    reference = train(tmp_path / "reference", 3)
    train(tmp_path / "killed", 3, kill_at=2 * STEPS_PER_EPOCH - 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        longer = train(tmp_path / "killed", 3, ckpt_path=tmp_path / "killed" / "last.ckpt", max_epochs=EPOCHS + 2)
    about_schedule = [str(w.message) for w in caught if "keeps the checkpoint's lr schedule" in str(w.message)]
    assert len(about_schedule) == 1, about_schedule
    assert f"max_epochs={EPOCHS + 2}" in about_schedule[0] and f"max_epochs={EPOCHS}" in about_schedule[0]

    # the steps both runs take have the same lr: the cosine is not stretched over the longer run...
    start, end = 2 * STEPS_PER_EPOCH - 2, EPOCHS * STEPS_PER_EPOCH
    assert sorted(longer["lr"]) == list(range(start, (EPOCHS + 2) * STEPS_PER_EPOCH))
    assert {s: lr for s, lr in longer["lr"].items() if s < end} == {s: lr for s, lr in reference["lr"].items() if s >= start}
    # ...and the extra epochs train at its final lr
    assert all(lr == pytest.approx(1e-5) for s, lr in longer["lr"].items() if s > end)


def test_the_projects_ema_keeps_its_state_under_lightnings_key():
    """A checkpoint written with Lightning's EMAWeightAveraging (older runs' configs) resumes into the project's EMA,
    and the other way round."""
    assert EMA(decay=0.9).state_key == EMAWeightAveraging(decay=0.9).state_key
