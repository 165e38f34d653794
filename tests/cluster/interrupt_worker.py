"""Ctrl-C in a fit of the tiny classifier: a real SIGINT at a chosen point, on chosen ranks, then the run resumed from
the checkpoint it wrote, against the uninterrupted run.

In the test process (one process, no cluster environment), or as one rank of a 2-rank job started by torchrun
(whose agent forwards a terminal's Ctrl-C to every rank), DDP then the sharded strategy (FSDP2), on gloo:

    PYTHONPATH=tests:tests/cluster python -m torch.distributed.run --nproc_per_node 2 interrupt_worker.py OUT

runs the reference and every case of :data:`CASES` under each strategy in one launch; rank 0 saves
``OUT/<strategy>/<case>.pt`` (the uninterrupted run's, or the resumed run's results) and ``<case>_stopped.pt`` (what
the interrupted run returned, None when it stopped, and the step its checkpoint holds).

Under DDP the validation split (353 images) gives rank 0 one validation batch more than rank 1 (12 and 11 of 16), as
the project's evaluation loaders split a set across ranks without repeats: the ranks agree on signals after the
batches both have. Under FSDP2 every forward is a collective (each block's parameters are gathered), so its ranks need
as many validation batches (360 images: 12 each).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from cluster_harness import MemoryLogger, RecordBatches, augmented_digits, tiny_classifier
from lightning.pytorch.strategies import DDPStrategy
from preemption_worker import EPOCHS, SIGNAL_STEP, STEPS_PER_EPOCH, RecordValidation, SendSignal, outcome
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import ExactResume, Interrupted, LastCheckpoint, StopOnSignal
from polyattn_lightning.distributed import distributed_teardown, gather_objects
from polyattn_lightning.sharding import ShardedStrategy, is_sharded_checkpoint
from polyattn_lightning.sharding.checkpoints import read_meta

#: case -> (where the SIGINT comes, the ranks it reaches, the step the resumed run starts from: the step it came in,
#: completed; at a step after which validation is due, or during validation, the step before that validation,
#: which runs again)
CASES = {
    "first_step": ("first_step", (0, 1), 1),  # a terminal's Ctrl-C reaches every rank
    "mid_step_rank_0": ("mid_step", (0,), SIGNAL_STEP + 1),  # a signal to rank 0 alone: the ranks agree
    "validation_rank_1": ("validation", (1,), STEPS_PER_EPOCH),
    "last_step_of_epoch": ("last_step_of_epoch", (0, 1), STEPS_PER_EPOCH),
}
#: Validation splits of 353 and 360 of the 1797 digits (sklearn rounds the fraction up).
UNEVEN_VAL_FRACTION, EVEN_VAL_FRACTION = 0.1963, 0.2


def strategy(layout: str, world: int):
    if layout == "fsdp":
        return ShardedStrategy(process_group_backend="gloo")
    return DDPStrategy(process_group_backend="gloo") if world > 1 else "auto"


def train(
    root: Path,
    layout: str = "single",
    where: str = "none",
    ranks: tuple[int, ...] = (0,),
    times: int = 1,
    ckpt_path: str | None = None,
) -> dict[str, Any] | None:
    """Fit 3 epochs of 4 steps, validating on the whole split, with the standard last checkpoint in
    ``root/checkpoints``; None when a Ctrl-C stopped it (:class:`Interrupted`). The global batch is 32 on any number
    of ranks (torchrun's ``WORLD_SIZE``)."""
    world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
    pl.seed_everything(0, workers=True)
    model, logger = tiny_classifier(mixup=True, drop_path=0.1), MemoryLogger()
    record, validation = RecordBatches(), RecordValidation()
    sender = [SendSignal(where, signal.SIGINT, times)] if rank in ranks and where != "none" else []
    last = LastCheckpoint(dirpath=root / "checkpoints", filename="last", save_top_k=1, enable_version_counter=False)
    trainer = cpu_trainer(
        devices=world,
        strategy=strategy(layout, world),
        default_root_dir=root,
        max_epochs=EPOCHS,
        limit_train_batches=STEPS_PER_EPOCH,
        log_every_n_steps=1,
        logger=logger,
        enable_checkpointing=True,
        callbacks=[ExactResume(), StopOnSignal(), record, validation, *sender, last],
    )
    val_fraction = EVEN_VAL_FRACTION if layout == "fsdp" else UNEVEN_VAL_FRACTION
    data = augmented_digits(batch_size=32 // world, val_fraction=val_fraction)
    try:
        trainer.fit(model, data, ckpt_path=ckpt_path)
    except Interrupted:
        return None
    return {**outcome(trainer, logger, record, validation), "val_batches": gather_objects(trainer.num_val_batches)}


def saved_step(path: Path) -> int:
    """The ``global_step`` of a checkpoint file or sharded folder."""
    return (read_meta(path) if is_sharded_checkpoint(path) else torch.load(path, weights_only=True))["global_step"]


@distributed_teardown()
def main(out: str, *layouts: str) -> None:
    rank = int(os.environ["RANK"])
    for layout in layouts or ("ddp", "fsdp"):
        folder = Path(out) / layout
        results = {"reference": train(folder / "reference", layout)}
        for case, (where, ranks, _) in CASES.items():
            root = folder / case
            stopped = train(root, layout, where, ranks)
            last = root / "checkpoints" / "last.ckpt"
            results[f"{case}_stopped"] = {"result": stopped, "step": saved_step(last) if last.exists() else None}
            results[case] = train(root, layout, ckpt_path=str(last))
        if rank == 0:
            for name, result in results.items():
                torch.save(result, folder / f"{name}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
