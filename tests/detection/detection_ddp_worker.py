"""Validate and predict a saved tiny detector on ``devices`` CPU processes; under torchrun, 2 ranks (gloo).

Usage (what test_detection_ddp does): ``torchrun --standalone --nproc_per_node 2 detection_ddp_worker.py OUT CKPT DATA_ROOT``;
rank 0 saves the validation metrics to ``OUT/metrics.pt``, the PredictionWriter writes ``OUT/predictions/``.
"""
from __future__ import annotations

import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from detection_harness import tiny_data

from polyattn_lightning.callbacks import PredictionWriter
from polyattn_lightning.checkpoint import SafeCheckpointIO
from polyattn_lightning.distributed import distributed_teardown
from polyattn_lightning.tasks.detection import DetectionModule


def evaluate(ckpt: Path, root: Path, out: Path, devices: int) -> dict[str, float]:
    """Validation metrics of the checkpoint's model; predictions written under ``out/predictions``."""
    torch.set_num_threads(1)
    model = DetectionModule.load_from_checkpoint(ckpt)
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto", logger=False,
        default_root_dir=out, callbacks=[PredictionWriter()], plugins=[SafeCheckpointIO()],
        enable_progress_bar=False, enable_model_summary=False,
    )
    metrics = trainer.validate(model, tiny_data(root, batch_size=1), verbose=False)[0]
    trainer.predict(model, tiny_data(root, batch_size=1), return_predictions=False)
    return {name: float(value) for name, value in metrics.items()}


@distributed_teardown()  # as cli.main: without it a gloo thread can abort the finished process at exit
def main(out: Path, ckpt: Path, root: Path) -> None:
    metrics = evaluate(ckpt, root, out, devices=2)
    if torch.distributed.get_rank() == 0:
        torch.save(metrics, out / "metrics.pt")


if __name__ == "__main__":
    main(*(Path(arg) for arg in sys.argv[1:4]))
