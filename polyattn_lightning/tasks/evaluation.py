"""Logging one evaluation batch of a classifier: the image and LRA tasks share it."""
from __future__ import annotations

import lightning.pytorch as pl
from torch import Tensor, nn
from torchmetrics import MetricCollection


def log_evaluation(module: pl.LightningModule, logits: Tensor, labels: Tensor, metrics: MetricCollection,
                   stage: str) -> None:
    """Log ``<stage>/loss`` and update and log ``metrics`` (accuracies) for one batch."""
    module.log(f"{stage}/loss", nn.functional.cross_entropy(logits, labels), sync_dist=True, batch_size=len(labels))
    metrics.update(logits, labels)
    # logging the metric objects lets torchmetrics reduce their counts across DDP ranks at epoch end
    module.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)
