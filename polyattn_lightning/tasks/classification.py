"""Image classification with a timm model whose attention comes from the registry."""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from typing import Any, Mapping

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from timm.data import Mixup
from timm.loss import SoftTargetCrossEntropy
from torch import Tensor, nn
from torchmetrics import MetricCollection
from torchmetrics.classification import MulticlassAccuracy

from ..attention import ActivationSpec
from ..attention.switch.timm.probe import image_probe
from ..checkpoint import checkpoint_safe
from ..conversion import ConvertRecipe
from ..conversion.lora import LoraRecipe
from ..errors import ConfigError, UserInputError
from .base import TaskModule
from .evaluation import logits_evaluation
from .hparams import as_dataclass
from ..models.timm_builder import check_model_name, create_timm_model, resolve_pretrained_file
from .optim import OptimRecipe


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
    """Deprecated: the ``recipe`` block of runs made before ClassificationModule took ``optim``, ``mixup`` and
    ``drop_path_rate`` itself; kept so that their checkpoints (which pickle it) and saved configs still load."""

    optim: OptimRecipe = field(default_factory=OptimRecipe)
    mixup: MixupRecipe = field(default_factory=MixupRecipe)
    drop_path_rate: float = 0.0


def plain(value: Any, like: Any) -> Any:
    """``value`` as plain values (lists, not tuples: they compare), a mapping when ``like`` is a dataclass."""
    return json.loads(json.dumps(asdict(as_dataclass(value, type(like))))) if is_dataclass(like) else value


#: the arguments ClassificationModule passes to ``timm.create_model`` itself (in ``model_kwargs``: given twice)
OWN_TIMM_ARGS = ("num_classes", "img_size", "drop_path_rate", "pretrained")


def check_model_kwargs(model_kwargs: Mapping[str, Any] | None) -> None:
    """One place per setting: ``model_kwargs`` restates none of :data:`OWN_TIMM_ARGS`."""
    for key in OWN_TIMM_ARGS:
        if key in (model_kwargs or {}):
            raise ConfigError(
                f"model.init_args.model_kwargs.{key}: {key} is an argument of ClassificationModule itself; "
                f"give it once, as model.init_args.{key}"
            )


def from_recipe(hparams: dict[str, Any]) -> None:
    """Map an old ``recipe`` hyperparameter onto ``optim``, ``mixup`` and ``drop_path_rate`` (in place, as plain
    values), with one deprecation line; a value also given under its new key must agree with the recipe's."""
    recipe = hparams.pop("recipe", None)
    if recipe is None:
        return
    rank_zero_warn(
        "model.init_args.recipe is deprecated: its optim, mixup and drop_path_rate are now "
        "model.init_args.optim, .mixup and .drop_path_rate (mapped onto them)",
        category=FutureWarning,
    )
    recipe = asdict(recipe) if isinstance(recipe, Recipe) else dict(recipe)
    for item in fields(Recipe):
        default = item.default_factory() if item.default is MISSING else item.default
        value, given = plain(recipe.get(item.name, default), default), plain(hparams.get(item.name, default), default)
        if given != plain(default, default) and given != value:
            raise ConfigError(
                f"model.init_args.{item.name} is given twice, as {given} and as recipe.{item.name} "
                f"{value}; give it once, as model.init_args.{item.name}"
            )
        hparams[item.name] = value


class ClassificationModule(TaskModule):
    """A timm classifier (ViT, DeiT, Swin, XCiT...) trained with a registry attention activation.

    ``num_classes`` and ``img_size`` left None are the DataModule's (``num_classes``, ``img_size``).

    Example:
        In a config, ``model: {class_path: ClassificationModule, init_args: {model_name: vit_small_patch16_224,
        attention: poly3}}`` (``configs/classification/``); in Python, a tiny ViT on 16 px images:

        >>> import torch
        >>> from polyattn_lightning.tasks import ClassificationModule
        >>> module = ClassificationModule("vit_tiny_patch16_224", num_classes=10, attention="poly3", img_size=16,
        ...                               model_kwargs={"patch_size": 4, "embed_dim": 32, "depth": 2, "num_heads": 2})
        >>> module(torch.randn(4, 3, 16, 16)).shape
        torch.Size([4, 10])
    """

    data_args = ("num_classes",)
    optional_data_args = ("img_size",)
    #: deprecated init argument paths and the ones that replace them: the CLI reads ``--model.recipe.optim.lr 0``
    #: as ``--model.optim.lr 0``, with a deprecation line
    renamed_args = {f"recipe.{name}": name for name in ("optim", "mixup", "drop_path_rate")}

    def __init__(
        self,
        model_name: str,
        num_classes: int | None = None,
        attention: ActivationSpec = "softmax",
        img_size: int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        pretrained: str | None = None,
        optim: OptimRecipe = OptimRecipe(),
        mixup: MixupRecipe = MixupRecipe(),
        drop_path_rate: float = 0.0,
        test_after_fit: bool = False,
        recipe: Recipe | None = None,
        attention_strict: bool = True,
        convert: ConvertRecipe = ConvertRecipe(),
        lora: LoraRecipe | None = None,
    ):
        """
        Args:
            model_name: a timm model name, e.g. ``vit_small_patch16_224``.
            num_classes: classifier outputs; None (the default) takes the DataModule's class count.
            attention: registry activation for every attention layer, e.g. ``poly3`` or
                ``{name: poly3, scale: 0.0714}``; ``softmax`` keeps timm's behaviour.
            img_size: input side, for models that take one (ViT, Swin, XCiT); None takes the DataModule's
                ``img_size`` when the class count is left to the data too, else the model's default.
            model_kwargs: further ``timm.create_model`` arguments (``patch_size``, ``depth``, ``embed_dim``...).
            pretrained: weights to start from, never downloaded: a local weight file, a Hugging Face cache
                directory, or the ``.ckpt`` of another run of this module (e.g. softmax, to fine-tune into poly3).
            optim: optimizer and schedule.
            mixup: Mixup/CutMix and label smoothing.
            drop_path_rate: stochastic depth.
            test_after_fit: at the end of ``fit``, test with the best checkpoint.
            recipe: deprecated, the block that held ``optim``, ``mixup`` and ``drop_path_rate`` before (old runs).
            attention_strict: refuse a model in which some attention would keep softmax (the default); false
                switches what can be switched and logs one line naming what stays softmax
                (docs/reference/timm-models.md).
            convert: converting ``pretrained`` softmax weights to ``attention`` before fine-tuning (``method:
                transfer`` or ``calibrate``, on the first ``samples`` training images; once, saved in the
                checkpoint; docs/papers.md, "Fine-tuning softmax weights into another attention").
            lora: LoRA adapters (peft, ``[lora]``) on the attention's q/k/v/o layers instead of full fine-tuning:
                ``{r: 8, alpha: 16, target: [q, k, v, o]}``; only the adapters and the classifier train.
        """
        super().__init__()
        from_recipe(self.hparams)
        self.mixup_recipe = as_dataclass(self.hparams.mixup, MixupRecipe)
        self.model: nn.Module | None = None

    @classmethod
    def check_init_args(cls, init_args: Mapping[str, Any]) -> None:
        """The attention spec, ``model_kwargs`` (:func:`check_model_kwargs`), the timm model name and the pretrained
        file (the CLI drops it for ``--ckpt_path``)."""
        super().check_init_args(init_args)
        check_model_kwargs(init_args.get("model_kwargs"))
        for key, check in (("model_name", check_model_name), ("pretrained", resolve_pretrained_file)):
            if init_args.get(key) is not None:
                try:
                    check(init_args[key])
                except UserInputError as err:
                    raise type(err)(f"model.init_args.{key}: {err}") from err

    def build(self) -> None:
        hp = self.hparams
        check_model_kwargs(hp.model_kwargs)
        self.model = create_timm_model(
            hp.model_name, hp.num_classes, hp.img_size, hp.drop_path_rate, hp.pretrained, **(hp.model_kwargs or {})
        )
        mix = self.mixup_recipe
        self.mixup = Mixup(**asdict(mix), num_classes=hp.num_classes) if mix.enabled else None
        self.train_loss = (
            SoftTargetCrossEntropy() if mix.enabled else nn.CrossEntropyLoss(label_smoothing=mix.label_smoothing)
        )
        self.set_metrics(
            MetricCollection(
                {
                    "top1": MulticlassAccuracy(hp.num_classes, top_k=1, average="micro"),
                    "top5": MulticlassAccuracy(hp.num_classes, top_k=min(5, hp.num_classes), average="micro"),
                }
            )
        )

    def attention_options(self) -> dict[str, Any]:
        # the probe forward runs at the configured image size
        return {
            "strict": self.hparams.get("attention_strict", True),
            "probe": image_probe(self.model, self.hparams.img_size),
        }

    @property
    def num_classes(self) -> int | None:
        return self.hparams.num_classes

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def lora_trainable(self) -> list[nn.Module]:
        """The classifier trains beside the adapters (a new head, or the pretrained one on new data)."""
        return [self.model.get_classifier()]

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Say what ``--ckpt_path`` loads (weights and, for ``fit``, the training state). Not for
        ``load_from_checkpoint``, which does not tell the module the file: its caller names it (``polyattn maps``)."""
        super().on_load_checkpoint(checkpoint)
        path = self._trainer.ckpt_path if self._trainer is not None else None
        if path is None:
            return
        rank_zero_info(
            f"checkpoint {path}: {len(checkpoint.get('state_dict', {}))} tensors loaded, saved at epoch "
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

    def evaluate(self, batch: tuple[Tensor, Tensor], stage: str | None) -> None:
        images, targets = batch
        logits_evaluation(self, self(images), targets, stage)

    def predict(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        """Class probabilities."""
        return self(batch[0]).softmax(dim=-1)
