"""Every 2-rank check of the sharding tests, in one launch: one process per task of a 2-task SLURM job (the test sets
``SLURM_*``; gloo on CPU), so the same processes also run the preemption case.

    PYTHONPATH=tests python sharded_worker.py INIT_DIR OUT_DIR

Rank 0 writes to OUT_DIR (``torch.save`` of plain values):

* ``{decoder,vit}_{poly3,softmax}_{ddp,fsdp}.pt``: the whole weights after ``STEPS`` steps from the same initial
  state dict and what each rank held (parameters, gradients, optimizer states) (ViT runs: at step 2 rank 1's images are NaN and the NaN guard skips the step on both ranks; the
  sharded ViT poly3 run logs attention norms every 2 steps, which must leave its weights as DDP's).
* ``export_{ddp,fsdp}/``: the decoder poly3 runs' ``save_pretrained`` exports (its embeddings are tied to its head).
* ``decoder_ckpt/at2.ckpt/``: the sharded decoder poly3 run's checkpoint folder at step 2 (mid-epoch), and
  ``decoder_resumed.pt``: that run resumed from it on 2 ranks (bit for bit the uninterrupted one).
* ``memory.pt``: the lines :class:`MemoryReport` said in the sharded decoder poly3 run.
* ``meta_init.pt``: the decoder built on the meta device under the sharded strategy and initialised after sharding.
* ``uneven_{vit_ddp,vit_fsdp,decoder_fsdp}.pt``: a fit with validation (sanity check, every epoch, and the ViT's
  test at the end of fit), then ``validate``, ``test`` and ``predict`` (with the prediction writer, its files in
  ``uneven_<kind>_<layout>/predictions``), all on splits whose two shares make different numbers of batches: the
  whole weights, the metrics, and each rank's number of validation batches.
* ``preempted_{reference,resumed}.pt``: the ViT with Mixup and drop path (random draws every step), sharded, without
  interruption and after a SIGUSR1 on rank 1 mid-step 5, requeue and restart (``preempted_stopped.pt``: None).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from cluster_harness import MemoryLogger, RecordBatches, augmented_digits, tiny_classifier
from ddp_worker import PoisonRank1Samples
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import SIGTERMException
from preemption_worker import SendSignal, capture_all_rng
from sharding_harness import STEPS, fit, meta_build, strategy, uneven, weights
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict
from training_helpers import cpu_trainer

from polyattn_lightning.callbacks import (
    AttentionNorms,
    ExactResume,
    MemoryReport,
    NonFiniteLossGuard,
    PredictionWriter,
    StopOnSignal,
)
from polyattn_lightning.distributed import distributed_teardown, gather_objects
from polyattn_lightning.sharding.memory import held_bytes


def equivalence(init: Path, out: Path, rank: int) -> None:
    for kind in ("decoder", "vit"):
        for attention in ("poly3", "softmax"):
            for layout in ("ddp", "fsdp"):
                callbacks, options = [], {}
                if kind == "vit":
                    callbacks += [NonFiniteLossGuard(on_nonfinite="skip"), PoisonRank1Samples()]
                if (kind, attention, layout) == ("vit", "poly3", "fsdp"):
                    callbacks.append(AttentionNorms(every_n_steps=2, probe_size=4))
                    options["logger"] = logger = MemoryLogger()
                if (kind, attention, layout) == ("decoder", "poly3", "fsdp"):
                    every2 = dict(every_n_train_steps=2, save_top_k=-1, auto_insert_metric_name=False)
                    callbacks += [ModelCheckpoint(out / "decoder_ckpt", "at{step}", **every2), ExactResume()]
                    callbacks.append(memory := MemoryReport(after_steps=2))
                    options["enable_checkpointing"] = True
                trainer, model = fit(kind, attention, layout, 2, init / f"{kind}_init.pt", STEPS, callbacks, **options)
                if (kind, attention) == ("decoder", "poly3"):
                    model.export(out / f"export_{layout}")  # every rank joins the gather, rank 0 writes
                held = gather_objects(held_bytes(model, trainer.optimizers))
                result = {"weights": weights(model), "held": held}
                if "logger" in options:
                    result["norm_steps"] = sorted({s for k, v in logger.history.items() if "norm" in k for s in v})
                if rank == 0:
                    torch.save(result, out / f"{kind}_{attention}_{layout}.pt")
                    if (kind, attention, layout) == ("decoder", "poly3", "fsdp"):
                        torch.save(memory.lines, out / "memory.pt")


def resume_from_folder(init: Path, out: Path, rank: int) -> None:
    folder = out / "decoder_ckpt" / "at2.ckpt"
    _, model = fit("decoder", "poly3", "fsdp", 2, init / "decoder_init.pt", STEPS, (ExactResume(),), str(folder))
    result = weights(model)
    if rank == 0:
        torch.save(result, out / "decoder_resumed.pt")


def meta_built(out: Path, rank: int) -> None:
    model = meta_build(2)
    assert model.trainer.strategy.built_on_meta
    result = weights(model)
    if rank == 0:
        torch.save(result, out / "meta_init.pt")


def uneven_evaluation(init: Path, out: Path, rank: int) -> None:
    for kind, layout in (("vit", "ddp"), ("vit", "fsdp"), ("decoder", "fsdp")):
        pl.seed_everything(0, workers=True)
        model, data = uneven(kind)
        model.load_state_dict(torch.load(init / f"{kind}_init.pt", weights_only=True))
        trainer = cpu_trainer(
            devices=2,
            strategy=strategy(layout),
            max_epochs=2,
            limit_train_batches=2,
            num_sanity_val_steps=2,
            default_root_dir=out / f"uneven_{kind}_{layout}",
            callbacks=[PredictionWriter()],
        )
        trainer.fit(model, data)
        fit_val = {name: float(value) for name, value in trainer.callback_metrics.items() if name.startswith("val/")}
        val_batches = gather_objects(trainer.num_val_batches[0])
        validated, tested = trainer.validate(model, data)[0], trainer.test(model, data)[0]
        trainer.predict(model, data, return_predictions=False)
        result = {"weights": weights(model), "fit_val": fit_val, "val": validated, "test": tested}
        if rank == 0:
            torch.save({**result, "val_batches": val_batches}, out / f"uneven_{kind}_{layout}.pt")


def preempted(out: Path, rank: int, where: str) -> dict | None:
    root = out / "preempted"
    pl.seed_everything(0, workers=True)
    model, record = tiny_classifier(mixup=True, drop_path=0.1), RecordBatches()
    logger = MemoryLogger()
    sender = [SendSignal("mid_step", signal.SIGUSR1)] if where == "mid_step" and rank == 1 else []
    trainer = cpu_trainer(
        devices=2,
        strategy=strategy("fsdp"),
        default_root_dir=root if where != "reference" else out / "preempted_reference",
        max_epochs=2,
        limit_train_batches=4,
        limit_val_batches=0,
        log_every_n_steps=1,
        logger=logger,
        callbacks=[ExactResume(), StopOnSignal(), record, *sender],
    )
    try:
        trainer.fit(model, augmented_digits(batch_size=16))
    except SIGTERMException:
        return None
    optimizer = get_optimizer_state_dict(
        model, trainer.optimizers[0], options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    return {
        "weights": weights(model),
        "optimizer": optimizer,
        "lr_schedule": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
        "rng": capture_all_rng(),
        "batches": record.seen,
        "loss": logger.history.get("train/loss", {}),
        "start_step": record.seen[0][0] if record.seen else None,
    }


@distributed_teardown()
def main(init: str, out: str) -> None:
    init_dir, out_dir = Path(init), Path(out)
    rank = int(os.environ["SLURM_PROCID"])
    equivalence(init_dir, out_dir, rank)
    resume_from_folder(init_dir, out_dir, rank)
    meta_built(out_dir, rank)
    uneven_evaluation(init_dir, out_dir, rank)
    for where in ("reference", "mid_step", "resumed"):
        result = preempted(out_dir, rank, where)
        if rank == 0:
            torch.save(result, out_dir / f"preempted_{where}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:])
