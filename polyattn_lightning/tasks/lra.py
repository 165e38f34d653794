"""Long Range Arena classification: the Xiong et al. encoder (``models/lra_encoder.py``) on registry attention.

Batches are dicts: ``input_ids`` LongTensor ``(B, N)`` (two-tower: ``(B, 2, N)``),
``mask`` BoolTensor of the same shape (True = real token) and ``label`` ``(B,)``.
The vocabulary, class count, maximum length and tower count default to the
DataModule's ``vocab_size``, ``num_classes``, ``max_length`` and ``two_tower``:
the model is built in ``configure_model``, once the data is set up, and those
values are saved with the hyperparameters so that a checkpoint rebuilds it.

``lightning fit`` ends with a test of the best checkpoint by ``val/top1`` (the base's ``test_after_fit``), as
Xiong et al. do, logged as ``test/top1``; ``test_after_fit: false`` turns it off. The module then holds the best
checkpoint's weights, not the last step's.
"""

from __future__ import annotations


from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..attention import ActivationSpec
from ..models import LRAClassifier
from .base import TaskModule
from .evaluation import logits_evaluation
from .optim import OptimRecipe

#: Xiong et al.'s optimizer and schedule: AdamW (0.9, 0.999), eps 1e-6, no weight decay, lr 1e-4, linear
#: warmup from lr/25 then linear decay to lr/25e4 (PyTorch OneCycleLR's defaults). Set warmup_steps per task.
LRA_OPTIM = OptimRecipe(
    lr=1e-4,
    reference_batch=None,
    weight_decay=0.0,
    eps=1e-6,
    warmup_epochs=0.0,
    warmup_lr=4e-6,
    min_lr=4e-10,
    schedule="linear",
)


class LRAModule(TaskModule):
    """An LRA task (ListOps, Text, Retrieval, Image, Pathfinder) with a registry attention activation.

    Example:
        In a config, ``model: {class_path: LRAModule, init_args: {attention: poly3}}`` (``configs/lra/``); in Python,
        with the values a DataModule would give:

        >>> import torch
        >>> from polyattn_lightning.tasks import LRAModule
        >>> module = LRAModule(attention="poly1", vocab_size=16, num_classes=10, max_length=64, two_tower=False)
        >>> ids, mask = torch.randint(1, 16, (2, 64)), torch.ones(2, 64, dtype=torch.bool)
        >>> module(ids, mask).shape
        torch.Size([2, 10])
    """

    #: the DataModule supplies these when they are not given
    data_args = ("vocab_size", "num_classes", "max_length", "two_tower")

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
        self.model: LRAClassifier | None = None

    def build(self) -> None:
        hp = self.hparams
        self.model = LRAClassifier(
            hp.vocab_size,
            hp.max_length,
            hp.num_classes,
            bool(hp.two_tower),
            dim=hp.dim,
            mlp_dim=hp.mlp_dim,
            depth=hp.depth,
            num_heads=hp.num_heads,
            head_dim=hp.head_dim,
            dropout=hp.dropout,
            attn_dropout=hp.attn_dropout,
        )
        self.set_metrics(MetricCollection({"top1": MulticlassAccuracy(hp.num_classes, average="micro")}))

    def on_fit_start(self) -> None:
        """Log the majority-class rate of the validation and test splits: the chance level that ``val/top1`` and
        ``test/top1`` (and the README's LRA quickstart line) are measured against."""
        chance_rate = getattr(self.trainer.datamodule, "chance_rate", None)  # a DataModule of this project's
        rates = {split: chance_rate(split) if chance_rate else None for split in ("val", "test")}
        shown = [f"{split} {rate.rate:.1%} (class {rate.label})" for split, rate in rates.items() if rate]
        if shown:
            rank_zero_info(
                f"majority-class rate (top-1 of always answering the most frequent class): {', '.join(shown)}"
            )

    def forward(self, input_ids: Tensor, mask: Tensor) -> Tensor:
        return self.model(input_ids, mask)

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = nn.functional.cross_entropy(self(batch["input_ids"], batch["mask"]), batch["label"])
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def evaluate(self, batch: dict[str, Tensor], stage: str | None) -> None:
        logits_evaluation(self, self(batch["input_ids"], batch["mask"]), batch["label"], stage)

    def predict(self, batch: dict[str, Tensor]) -> Tensor:
        """Class probabilities."""
        return self(batch["input_ids"], batch["mask"]).softmax(dim=-1)


__all__ = ["LRA_OPTIM", "LRAModule"]
