"""One side of the DDP-equivalence test: 4 steps of the tiny classifier, then a validation pass.

Two ranks:  PYTHONPATH=tests python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_worker.py OUT_DIR
One process: ``run(1, OUT_DIR)`` from the test. Rank 0 saves what the test compares
to OUT_DIR/result.pt, and the trainer its last checkpoint to OUT_DIR/last.ckpt.

The two runs see the same global batches: the train loader's order is
DistributedSampler's permutation on one process too. At step 2 the loss is
made NaN on DDP rank 1 only (in the one-process run: on the same samples), so
the NaN guard must skip that step on both ranks.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from cluster_harness import digits, tiny_classifier
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import ExactResume, NonFiniteLossGuard
from polyattn_lightning.distributed import distributed_teardown

GLOBAL_BATCH, STEPS, POISONED_STEP = 32, 4, 2
VAL_FRACTION = 0.1002  # 181 validation images: odd, so 2 ranks cannot split it evenly


class PoisonRank1Samples(Callback):
    """NaN images at POISONED_STEP on the samples rank 1 holds: every other one of the global batch."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == POISONED_STEP:
            images = batch[0]
            if trainer.world_size == 1:
                images[1::2] = float("nan")
            elif trainer.global_rank == 1:
                images[:] = float("nan")


class CountValidationSamples(Callback):
    def __init__(self) -> None:
        self.count = 0

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.count += len(batch[1])


def run(devices: int, out_dir: Path) -> dict:
    pl.seed_everything(0, workers=True)
    model = tiny_classifier()
    data = digits(batch_size=GLOBAL_BATCH // devices, val_fraction=VAL_FRACTION)
    counter = CountValidationSamples()
    trainer = cpu_trainer(
        devices=devices,
        strategy=DDPStrategy(process_group_backend="gloo") if devices > 1 else "auto",
        max_epochs=1,
        max_steps=STEPS,
        enable_checkpointing=True,
        callbacks=[
            NonFiniteLossGuard(on_nonfinite="skip"),
            PoisonRank1Samples(),
            counter,
            ExactResume(),
            ModelCheckpoint(dirpath=out_dir, save_last=True, every_n_train_steps=STEPS),
        ],
    )
    trainer.fit(model, data)
    [metrics] = trainer.validate(model, data, verbose=False)
    samples_per_rank = trainer.strategy.all_gather(torch.tensor(counter.count)).reshape(-1).tolist()
    return {"weights": model.state_dict(), "val": metrics, "val_samples_per_rank": samples_per_rank,
            "world_size": trainer.world_size, "val_set_size": len(data.val_set)}


@distributed_teardown()  # as cli.main: without it a gloo thread can abort the finished process at exit
def main(out: Path) -> None:
    result = run(2, out)
    if result["world_size"] != 2:
        sys.exit(f"expected 2 DDP ranks, got {result['world_size']}")
    if torch.distributed.get_rank() == 0:
        torch.save(result, out / "result.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
