"""Image classification with a timm model whose attention comes from the registry."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..attention import ActivationSpec
from ..attention.timm_patch import set_attention
from ..attention.timm_probe import image_probe
from ..checkpoint import checkpoint_safe
from ..errors import ConfigError
from .models import create_timm_model
from .evaluation import log_evaluation
from .optim import OptimRecipe, configure_recipe, step_scheduler


@checkpoint_safe
@dataclass
class MixupRecipe:
    """Mixup/CutMix and label smoothing: the arguments of timm's ``Mixup``; all off by default.

    With both alphas 0, Mixup is skipped and ``label_smoothing`` goes to plain cross entropy.
    """

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    prob: float = 1.0
    switch_prob: float = 0.5
    mode: str = "batch"
    label_smoothing: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0


@checkpoint_safe
@dataclass
class Recipe:
    """The training recipe: optimizer and schedule, batch mixing, stochastic depth."""

    optim: OptimRecipe = field(default_factory=OptimRecipe)
    mixup: MixupRecipe = field(default_factory=MixupRecipe)
    drop_path_rate: float = 0.0


class ClassificationModule(pl.LightningModule):
    """A timm classifier (ViT, DeiT, Swin, XCiT...) trained with a registry attention activation."""

    #: the checkpoint whose saved hyperparameters built this module; the CLI sets it for ``--ckpt_path``
    hparams_checkpoint: str | None = None

    def __init__(
        self,
        model_name: str,
        num_classes: int,
        attention: ActivationSpec = "softmax",
        img_size: int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pretrained: str | None = None,
        recipe: Recipe = Recipe(),
        attention_strict: bool = True,
    ):
        """
        Args:
            model_name: a timm model name, e.g. ``vit_small_patch16_224``.
            num_classes: classifier outputs; must match the data.
            attention: registry activation for every attention layer, e.g. ``poly3`` or
                ``{name: poly3, scale: 0.0714}``; ``softmax`` keeps timm's behaviour.
            img_size: input side, for models that take one (ViT, Swin, XCiT).
            model_kwargs: further ``timm.create_model`` arguments (``patch_size``, ``depth``, ``embed_dim``...).
            pretrained: weights to start from, never downloaded: a local weight file, a Hugging Face cache
                directory, or the ``.ckpt`` of another run of this module (e.g. softmax, to fine-tune into poly3).
            recipe: optimizer, schedule, Mixup/CutMix, label smoothing and drop path.
            attention_strict: refuse a model in which some attention would keep softmax (the default); false
                switches what can be switched and logs one line naming what stays softmax (README, support table).
        """
        super().__init__()
        self.save_hyperparameters()
        self.num_classes = num_classes
        self.recipe = recipe
        self.model = create_timm_model(
            model_name, num_classes, img_size, recipe.drop_path_rate, pretrained, **(model_kwargs or {})
        )
        # softmax too, so every model takes the registry path; the probe forward runs at the configured size
        set_attention(self.model, attention, strict=attention_strict, probe=image_probe(self.model, img_size))

        mix = recipe.mixup
        self.mixup = Mixup(**asdict(mix), num_classes=num_classes) if mix.enabled else None
        self.train_loss = (
            SoftTargetCrossEntropy() if mix.enabled else nn.CrossEntropyLoss(label_smoothing=mix.label_smoothing)
        )
        metrics = MetricCollection(
            {
                "top1": MulticlassAccuracy(num_classes, top_k=1, average="micro"),
                "top5": MulticlassAccuracy(num_classes, top_k=min(5, num_classes), average="micro"),
            }
        )
        self.val_metrics = metrics.clone(prefix="val/")
        self.test_metrics = metrics.clone(prefix="test/")

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def setup(self, stage: str) -> None:
        """Fail before any step if the model's class count or input size disagrees with the data's."""
        datamodule = self.trainer.datamodule
        data_name = type(datamodule).__name__
        data_classes = getattr(datamodule, "num_classes", None)
        if data_classes is not None and data_classes != self.num_classes:
            ckpt_path = self.hparams_checkpoint
            if ckpt_path:
                raise ConfigError(
                    f"checkpoint {ckpt_path} has num_classes={self.num_classes} (its saved hyperparameters replace "
                    f"the config's model.init_args.num_classes) but {data_name} has {data_classes} classes; "
                    "use it on data with the classes it was trained on, or fine-tune from it with "
                    "--model.pretrained instead of --ckpt_path (the classifier is then re-initialised)"
                )
            raise ConfigError(
                f"model.init_args.num_classes is {self.num_classes} but {data_name} has {data_classes} classes; "
                f"set model.init_args.num_classes: {data_classes}"
            )
        model_size = self.hparams.get("img_size")
        data_size = getattr(datamodule, "img_size", None)
        if model_size is not None and data_size is not None and model_size != data_size:
            raise ConfigError(
                f"model.init_args.img_size is {model_size} but data.init_args.img_size is {data_size}; "
                "the model takes images of one size: set both to the same value"
            )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Say what ``--ckpt_path`` loads (weights and, for ``fit``, the training state)."""
        path = self._trainer.ckpt_path if self._trainer is not None else None
        rank_zero_info(
            f"checkpoint {path or ''}: {len(checkpoint.get('state_dict', {}))} tensors loaded, saved at epoch "
            f"{checkpoint.get('epoch')}, step {checkpoint.get('global_step')}"
            + ("" if self.hparams.get("pretrained") else " (no pretrained file was read)")
        )

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        images, targets = batch
        if self.mixup is not None:
            images, targets = self.mixup(images, targets)
        loss = self.train_loss(self(images), targets)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.val_metrics, "val")

    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        self._evaluate(batch, self.test_metrics, "test")

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        """Class probabilities."""
        return self(batch[0]).softmax(dim=-1)

    def _evaluate(self, batch: tuple[Tensor, Tensor], metrics: MetricCollection, stage: str) -> None:
        images, targets = batch
        log_evaluation(self, self(images), targets, metrics, stage)

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_recipe(self, self.model, self.recipe.optim)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        step_scheduler(self, scheduler)
