"""How a task is scored: metrics per evaluation stage, exact mean losses, and the validation, test and predict steps
around the task's own :meth:`~Evaluation.evaluate` and :meth:`~Evaluation.predict`.

A padding batch (``data/evaluation.py``: under a sharded strategy a rank with fewer evaluation samples ends with one,
so every rank joins every all-gather) runs the same forward and is scored and predicted as nothing.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn
from torchmetrics import MeanMetric, MetricCollection

from ..data.evaluation import PaddingBatch


class Evaluation:
    """The evaluation half of :class:`~.base.TaskModule` (mixed into it, before ``LightningModule``)."""

    def set_metrics(self, metrics: MetricCollection) -> None:
        """One copy of ``metrics`` per evaluation stage: ``val_metrics`` (``val/...``) and ``test_metrics``; and the
        stages' mean losses (:meth:`log_loss`)."""
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")
        # a NaN loss stays NaN in the mean (torchmetrics would leave it out, with a warning)
        self.val_loss, self.test_loss = MeanMetric(nan_strategy="disable"), MeanMetric(nan_strategy="disable")

    def log_loss(self, stage: str, loss: Tensor, weight: int) -> None:
        """Log ``<stage>/loss``: the mean of ``loss`` (one batch's mean over ``weight`` samples or tokens) over the
        whole split and every rank, exactly. torchmetrics' ``MeanMetric`` sums the weighted losses and the weights
        across ranks; Lightning's ``sync_dist`` mean divides the summed weights by the world size in integers,
        rounding down, which weighs the loss wrongly whenever the ranks' counts add up to no multiple of it."""
        metric = self.val_loss if stage == "val" else self.test_loss
        metric.update(loss, weight)
        self.log(f"{stage}/loss", metric, on_step=False, on_epoch=True)

    def stage_metrics(self, stage: str) -> MetricCollection:
        """The metrics of ``stage`` (``val`` or ``test``) that :meth:`set_metrics` made."""
        return self.val_metrics if stage == "val" else self.test_metrics

    def evaluate(self, batch: Any, stage: str | None) -> None:
        """Score one validation (``stage="val"``) or test (``"test"``) batch and log it under ``<stage>/``; with
        ``stage`` None (a padding batch, :class:`~polyattn_lightning.data.evaluation.PaddingBatch`) run the same
        forward and score and log nothing."""
        raise NotImplementedError

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(*_scored(batch, "val"))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluate(*_scored(batch, "test"))

    def predict(self, batch: Any) -> Any:
        """What ``lightning predict`` keeps of one batch (the default: ``forward``'s output)."""
        return self(batch)

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> Any:
        """:meth:`predict`; for a padding batch its forward and None, which the prediction writer leaves out."""
        if isinstance(batch, PaddingBatch):
            self.predict(batch.batch)
            return None
        return self.predict(batch)


def _scored(batch: Any, stage: str) -> tuple[Any, str | None]:
    """:meth:`Evaluation.evaluate`'s arguments for ``batch``: a padding batch's contents and no stage (the same forward
    on every rank, under a sharded strategy, scoring nothing: ``data/evaluation.py``), else ``batch`` and ``stage``."""
    return (batch.batch, None) if isinstance(batch, PaddingBatch) else (batch, stage)


def logits_evaluation(module: Evaluation, logits: Tensor, labels: Tensor, stage: str | None) -> None:
    """Log ``<stage>/loss`` (cross entropy) and update and log the stage's accuracy metrics for one batch (nothing
    with ``stage`` None: a padding batch)."""
    if stage is None:
        return
    module.log_loss(stage, nn.functional.cross_entropy(logits, labels), len(labels))
    metrics = module.stage_metrics(stage)
    metrics.update(logits, labels)
    # logging the metric objects lets torchmetrics reduce their counts across DDP ranks at epoch end
    module.log_dict(metrics, on_step=False, on_epoch=True, prog_bar=True)
