"""Run by torchrun, 2 processes: a short DDP fit with both attention callbacks and a CSV logger (argv[1]: out dir)."""
from __future__ import annotations

import sys

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger

from polyattn_lightning.callbacks import AttentionMaps, AttentionNorms
from polyattn_lightning.data import DigitsDataModule
from polyattn_lightning.distributed import distributed_teardown
from polyattn_lightning.tasks import ClassificationModule


@distributed_teardown()  # as cli.main: without it a gloo thread can abort the finished process at exit
def main(out: str) -> None:
    pl.seed_everything(0)
    module = ClassificationModule("vit_tiny_patch16_224", num_classes=10, attention="poly3", img_size=8,
                                  model_kwargs=dict(patch_size=2, embed_dim=32, depth=2, num_heads=2))
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="ddp", max_steps=4, val_check_interval=2, limit_val_batches=2,
        logger=CSVLogger(out, name="run"), callbacks=[AttentionNorms(every_n_steps=1), AttentionMaps(probe_size=4)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )
    trainer.fit(module, datamodule=DigitsDataModule(img_size=8, batch_size=16))


if __name__ == "__main__":
    main(sys.argv[1])
