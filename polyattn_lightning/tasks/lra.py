"""Long Range Arena classification: the Xiong et al. encoder (``models/lra_encoder.py``) on registry attention.

Batches are dicts: ``input_ids`` LongTensor ``(B, N)`` (two-tower: ``(B, 2, N)``),
``mask`` BoolTensor of the same shape (True = real token) and ``label`` ``(B,)``.
The vocabulary, class count, maximum length and tower count default to the
DataModule's ``vocab_size``, ``num_classes``, ``max_length`` and ``two_tower``:
the model is built in ``configure_model``, once the data is set up, and those
values are saved with the hyperparameters so that a checkpoint rebuilds it.

``lightning fit`` ends with ``trainer.test(ckpt_path="best")`` (``on_fit_end``):
the test split is scored with the best checkpoint by ``val/top1``, as Xiong et al.
do, and logged as ``test/top1``; ``test_after_fit: false`` turns it off. The module then
holds the best checkpoint's weights, not the last step's.
"""
from __future__ import annotations

import os

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..attention import ActivationSpec
from ..errors import ConfigError
from ..models import LRAClassifier
from .evaluation import log_evaluation
from .optim import OptimRecipe, configure_recipe, step_scheduler

#: Xiong et al.'s optimizer and schedule: AdamW (0.9, 0.999), eps 1e-6, no weight decay, lr 1e-4, linear
#: warmup from lr/25 then linear decay to lr/25e4 (PyTorch OneCycleLR's defaults). Set warmup_steps per task.
LRA_OPTIM = OptimRecipe(
    lr=1e-4, reference_batch=None, weight_decay=0.0, eps=1e-6, warmup_epochs=0.0, warmup_lr=4e-6, min_lr=4e-10,
    schedule="linear",
)

#: Model arguments the DataModule supplies when they are not given.
DATA_ARGS = ("vocab_size", "num_classes", "max_length", "two_tower")


class LRAModule(pl.LightningModule):
    """An LRA task (ListOps, Text, Retrieval, Image, Pathfinder) with a registry attention activation."""

    def __init__(
        self,
        attention: ActivationSpec = "softmax",
        vocab_size: int | None = None,
        num_classes: int | None = None,
        max_length: int | None = None,
        two_tower: bool | None = None,
        dim: int = 64,
        depth: int = 2,
        num_heads: int = 2,
        head_dim: int = 32,
        mlp_dim: int = 128,
        dropout: float = 0.1,
        attn_dropout: float = 0.1,
        optim: OptimRecipe = LRA_OPTIM,
        test_after_fit: bool = True,
    ):
        """
        Args:
            attention: registry activation of every attention layer, e.g. ``poly3`` or ``{name: poly3, scale: 0.0714}``.
            vocab_size, num_classes, max_length, two_tower: None takes the DataModule's value; a given value
                must agree with it.
            dim, depth, num_heads, head_dim, mlp_dim: the encoder (Xiong et al.: 64, 2, 2, 32, 128); ``mlp_dim``
                is also the head's hidden width.
            dropout: on embeddings, attention output and MLP.
            attn_dropout: on the attention map (``attention()``'s ``dropout_p``, training only). With 0, ``poly1``
                runs in linear time.
            optim: optimizer and schedule; the default is Xiong et al.'s with no warmup.
            test_after_fit: at the end of ``fit``, test with the best checkpoint.
        """
        super().__init__()
        self.save_hyperparameters()
        self.model: LRAClassifier | None = None
        self.optim = optim
        if None not in (vocab_size, num_classes, max_length, two_tower):
            self.configure_model()

    def configure_model(self) -> None:
        """Build the model from the hyperparameters, filling the ones left None from the DataModule."""
        if self.model is not None:
            return
        hp = self.hparams
        missing = [name for name in DATA_ARGS if hp[name] is None]
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        for name in DATA_ARGS:
            data_value = getattr(datamodule, name, None)
            if hp[name] is None:
                if data_value is None:
                    raise ConfigError(
                        f"LRAModule needs {name}: give model.init_args.{name} or use a DataModule that has it "
                        f"(missing: {', '.join(missing)})"
                    )
                hp[name] = data_value  # saved with the checkpoint's hyperparameters
            elif data_value is not None and data_value != hp[name]:
                raise ConfigError(
                    f"model {name}={hp[name]} but {type(datamodule).__name__} has {name}={data_value}; "
                    f"set model.init_args.{name}: {data_value} or leave it out"
                )
        self.model = LRAClassifier(
            hp.vocab_size, hp.max_length, hp.num_classes, bool(hp.two_tower), dim=hp.dim, mlp_dim=hp.mlp_dim,
            depth=hp.depth, num_heads=hp.num_heads, head_dim=hp.head_dim, dropout=hp.dropout,
            attn_dropout=hp.attn_dropout, attention=hp.attention,
        )
        metrics = MetricCollection({"top1": MulticlassAccuracy(hp.num_classes, average="micro")})
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, input_ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids, mask)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self(batch["input_ids"], batch["mask"]), batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics, "test")

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Class probabilities."""
        return self(batch["input_ids"], batch["mask"]).softmax(dim=-1)

    def _evaluate(self, batch: dict[str, Tensor], metrics: MetricCollection, stage: str) -> None:
        log_evaluation(self, self(batch["input_ids"], batch["mask"]), batch["label"], metrics, stage)

    def on_fit_end(self) -> None:
        """Score the test split with the best checkpoint by validation accuracy (the last weights without one)."""
        trainer = self.trainer
        if not self.hparams.test_after_fit or trainer.datamodule is None:
            return
        callback = trainer.checkpoint_callback
        ckpt_path = callback.best_model_path if callback is not None else ""
        if not ckpt_path:
            # an explicit file, never None: under SLURM Lightning would resolve None to the newest hpc checkpoint
            rank_zero_warn("no best checkpoint was saved: testing the weights at the end of training")
            ckpt_path = os.path.join(trainer.default_root_dir, "end_of_fit.ckpt")
            trainer.save_checkpoint(ckpt_path)
        trainer.test(self, datamodule=trainer.datamodule, ckpt_path=ckpt_path)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_recipe(self, self.model, self.optim)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        step_scheduler(self, scheduler)


__all__ = ["LRA_OPTIM", "LRAModule"]
