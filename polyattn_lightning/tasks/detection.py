"""Object detection and instance segmentation with an mmdet detector, trained by Lightning.

The detector (RPN, RoI heads, losses, post-processing) is mmdet's, built with
its registry from a config mapping (``detection/config.py``); this module only drives it: the batch goes
through the detector's data preprocessor and ``mode='loss'`` for training and
``mode='predict'`` for evaluation, scored by mmdet's ``CocoMetric`` once over the
whole validation set (gathered from every DDP rank; ``detection/scoring.py``). The mmdet glue is imported
when a detector is built, so the other tasks never import mmdet.

Pretrained softmax backbones: the ``convert`` and ``lora`` options work on the backbone (the base's
:meth:`~.base.TaskModule.attention_target`) as in classification; the detector's neck and heads are new, so they
always train. There is no export: the checkpoint is the fine-tuned detector (LoRA adapters under peft's names).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from jsonargparse.typing import Path_fr
from torch import Tensor, nn

from .. import deprecated
from ..attention import ActivationSpec
from ..conversion import ConvertRecipe
from ..conversion.lora import LoraRecipe
from ..errors import ConfigError
from .base import TaskModule
from .optim import OptimRecipe


def _detection():
    """``(config, scoring)``: the mmdet glue, with mmcv's ops and mmdet's registries installed."""
    from ..detection import config, scoring

    return config, scoring


class DetectionModule(TaskModule):
    """An mmdet detector (e.g. XCiT Mask R-CNN + FPN) whose backbone attention comes from the registry.

    The class count is the DataModule's unless given (here or by the config's heads, not both).

    Example:
        In a config, ``model: {class_path: DetectionModule, init_args: {detector: model/mask_rcnn_xcit_quickstart.yaml,
        attention: {name: poly3, scale: 0.0714}}}`` (``configs/detection/quickstart.yaml``); in Python, the same
        detector mapping (a path, or the mapping itself) with 3 classes; its 4 XCiT blocks are switched:

        >>> from pathlib import Path
        >>> import polyattn_lightning
        >>> from polyattn_lightning.attention.switch import SwitchedAttention
        >>> from polyattn_lightning.tasks import DetectionModule
        >>> configs = Path(polyattn_lightning.__file__).resolve().parents[1] / "configs"
        >>> module = DetectionModule(configs / "detection/model/mask_rcnn_xcit_quickstart.yaml", attention="poly3",
        ...                          num_classes=3)
        >>> sum(isinstance(layer, SwitchedAttention) for layer in module.modules())
        4
    """

    #: the metric the best checkpoint keeps (the CLI's ``--checkpoint.monitor`` default), higher is better
    monitor, mode = "val/bbox_mAP", "max"
    data_args = ("num_classes",)

    def __init__(
        self,
        detector: dict[str, Any] | Path_fr,
        attention: ActivationSpec | None = None,
        num_classes: int | None = None,
        pretrained: str | None = None,
        optim: OptimRecipe = OptimRecipe(),
        test_after_fit: bool = False,
        convert: ConvertRecipe = ConvertRecipe(),
        lora: LoraRecipe | None = None,
    ):
        """
        Args:
            detector: an mmdet model config mapping (``type: MaskRCNN``, ``backbone``, ``neck``,
                ``rpn_head``, ``roi_head``, ``train_cfg``, ``test_cfg``, ``data_preprocessor``), built
                with mmdet's ``MODELS`` registry, or a YAML file holding one (in a config file, relative
                to that file), either possibly over a ``_base_`` (:func:`load_detector_config`). The
                hyperparameters keep the merged mapping, not the path.
            attention: registry activation for every attention layer of the backbone, as in
                classification: ``softmax``, ``poly3``, ``{name: poly3, scale: 0.0714}``...; None takes the
                backbone mapping's ``attention``, else softmax. Given in both places, it is an error.
            num_classes: the RoI heads' class count; None takes the heads' ``num_classes`` if the detector
                config states one, else the data's. A count that differs from the data's is an error.
            pretrained: backbone weights to start from: this project's classification ``.ckpt`` or a
                timm/official XCiT state dict; never downloaded. (Not in the backbone mapping: ``--ckpt_path``
                skips this one.)
            optim: optimizer and schedule (the XCiT 3x recipe in ``configs/detection/recipes``).
            test_after_fit: at the end of ``fit``, test with the best checkpoint (by box AP).
            convert: converting the ``pretrained`` softmax backbone weights to ``attention`` before fine-tuning
                (``method: transfer`` or ``calibrate``, on the first ``samples`` training images as the detector's
                preprocessor makes them; once, saved in the checkpoint; docs/papers.md, "Fine-tuning softmax
                weights into another attention").
            lora: LoRA adapters (peft, ``[lora]``) on the backbone attention's q/k/v/o layers instead of fully
                fine-tuning the backbone: ``{r: 8, alpha: 16, target: [q, k, v, o]}``; the adapters, the
                backbone's new resampling branches, the neck and the heads train, the pretrained XCiT is frozen.
        """
        super().__init__()
        config = _detection()[0].load_detector_config(detector)
        self.hparams.detector = copy.deepcopy(config)  # checkpoints hold the config itself (weights_only-loadable)
        backbone = config.get("backbone") if isinstance(config.get("backbone"), dict) else {}
        if "pretrained" in backbone:
            raise ConfigError(
                "detector.backbone.pretrained: give the backbone weights as model.init_args.pretrained "
                "(one place, which --ckpt_path knows to skip)"
            )
        backbone_attention = backbone.pop("attention", None)  # switched once, by the base, to the one spec
        if attention is not None and backbone_attention is not None:
            raise ConfigError(
                f"the backbone attention is given twice: model.init_args.attention {attention!r} and "
                f"detector.backbone.attention {backbone_attention!r}; give it in one place"
            )
        self._attention = attention if attention is not None else backbone_attention or "softmax"
        stated = _detection()[0].heads_num_classes(config)
        if num_classes is not None and stated is not None and num_classes != stated:
            raise ConfigError(
                f"the class count is given twice: model.init_args.num_classes {num_classes} and the "
                f"detector config's heads num_classes {stated}; give it in one place (or leave both out: "
                "the data's count is used)"
            )
        self.hparams.num_classes = num_classes if num_classes is not None else stated
        self._config = config
        self.detector = None
        self._results: list[dict] = []
        self._metric = None

    def build(self) -> None:
        detector_config, scoring = _detection()
        models, config_dict, _ = scoring.mmdet_detection()
        config = detector_config.with_num_classes(copy.deepcopy(self._config), self.hparams.num_classes)
        self.detector = models.build(config_dict(config))  # mmdet reads nested settings as attributes
        with scoring.quiet_mmengine():  # mmengine logs one line per parameter that init_weights leaves alone
            self.detector.init_weights()
        if self.hparams.pretrained is not None:
            self.detector.backbone.load_pretrained(self.hparams.pretrained)

    def attention_target(self) -> nn.Module:
        return self.detector.backbone

    def attention_spec(self) -> ActivationSpec:
        return self._attention

    def optimized_module(self) -> nn.Module:
        return self.detector

    def lora_trainable(self) -> list[nn.Module]:
        """The backbone's parts that no pretrained file holds (the XCiT backbone's stride 4/8/16/32 branches), which
        train beside the adapters; the neck and heads are outside the backbone peft freezes, so they train anyway."""
        backbone = self.detector.backbone
        new = getattr(backbone, "new_modules", None)
        return list(new()) if callable(new) else []

    def conversion_inputs(self, batch: dict) -> Tensor:
        """What the backbone takes from an mmdet batch (``inputs``, ``data_samples``): the images as the data
        preprocessor makes them for evaluation (normalised, padded to the size divisor)."""
        return self._preprocess(batch, False)["inputs"]

    # ---- set-up ------------------------------------------------------------------------------------

    @property
    def num_classes(self) -> int | None:
        return self.hparams.num_classes

    def setup(self, stage: str) -> None:
        """Check the classes against the data and make the COCO metric for its annotation file."""
        datamodule = self.trainer.datamodule
        names = getattr(datamodule, "classes", None)
        if names is None or not hasattr(datamodule, "val_ann_file"):
            raise ConfigError(
                f"DetectionModule needs a COCO-format DataModule (classes, val_ann_file), got "
                f"{type(datamodule).__name__}"
            )
        super().setup(stage)
        with_mask = (
            isinstance(self._config.get("roi_head"), dict) and self._config["roi_head"].get("mask_head") is not None
        )
        self._metric = _detection()[1].coco_metric(
            datamodule.val_ann_file, names, with_mask
        )  # set up before the detector is built

    def _preprocess(self, batch: dict, training: bool) -> dict:
        preprocessor = self.detector.data_preprocessor
        preprocessor.to(self.device)  # mmengine keeps its own device record, which Lightning's .to() never sets
        return preprocessor(batch, training)

    # ---- attention diagnostics (diagnostics/, through callbacks.AttentionNorms and AttentionMaps) ------------------

    def attention_probe(self, batch: dict, size: int) -> Tensor:
        """The diagnostics' probe: the first ``size`` images of a batch, preprocessed as for evaluation."""
        sample = {key: value[:size] for key, value in batch.items()}
        return self._preprocess(sample, False)["inputs"].detach().clone()

    def forward(self, images: Tensor) -> tuple[Tensor, ...]:
        """The backbone and neck's feature maps: all the diagnostics need (the heads hold no attention)."""
        return self.detector.extract_feat(images)

    # ---- steps -------------------------------------------------------------------------------------

    def training_step(self, batch: dict, batch_idx: int) -> Tensor:
        losses = self.detector(**self._preprocess(batch, True), mode="loss")
        loss, parts = self.detector.parse_losses(losses)  # the sum of every entry named *loss*
        batch_size = len(batch["inputs"])
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size)
        self.log_dict(
            {f"train/{name}": value for name, value in parts.items() if name != "loss"}, batch_size=batch_size
        )
        return loss

    def _predict(self, batch: dict) -> list[dict]:
        """Detections per image in original-image coordinates, as CocoMetric keeps them (RLE masks, numpy)."""
        samples = self.detector(**self._preprocess(batch, False), mode="predict")
        self._metric.process({}, [sample.to_dict() for sample in samples])
        converted, self._metric.results = self._metric.results, []
        return [result for _gt, result in converted]

    def evaluate(self, batch: dict, stage: str | None) -> None:
        """Keep the batch's detections (not a padding batch's); they are scored together at the end of the epoch."""
        results = self._predict(batch)
        if stage is not None:
            self._results.extend(results)

    def predict(self, batch: dict) -> list[dict]:
        """Per image: ``img_id``, ``bboxes`` (x1, y1, x2, y2), ``scores``, ``labels`` and RLE ``masks``."""
        return self._predict(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_coco("val")

    def on_test_epoch_end(self) -> None:
        self._log_coco("test")

    def _log_coco(self, stage: str) -> None:
        """Score every rank's detections together, once, on rank 0; every rank logs the same numbers."""
        scoring = _detection()[1]
        results, self._results = scoring.by_image(scoring.gather_results(self._results)), []
        scores, log_dir = None, self.trainer.log_dir  # log_dir broadcasts: every rank asks, before rank 0 scores
        if self.trainer.is_global_zero:
            with scoring.pycocotools_output() as output:
                scores = scoring.coco_scores(self._metric, results)
            where = f"{stage} (step {self.trainer.global_step}, {len(self._metric.img_ids)} images)"
            scoring.report(self._metric, where, scores, output.getvalue(), log_dir)
        scores = self.trainer.strategy.broadcast(scores, src=0)
        for name, value in scores.items():
            self.log(f"{stage}/{name}", value, prog_bar=name.endswith("mAP_50"))

    # ---- prediction files --------------------------------------------------------------------------

    def save_predictions(self, predictions: list[dict], out_dir: Path) -> bool:
        """Write every rank's detections as COCO results JSON, ``<out_dir>/results.bbox.json`` and (with
        masks) ``results.segm.json``: one entry per detection with ``image_id``, ``category_id``, ``bbox``
        (x, y, w, h), ``score`` and, in the latter, the RLE ``segmentation``. Called by
        :class:`~polyattn_lightning.callbacks.PredictionWriter` on every rank; rank 0 writes."""
        scoring = _detection()[1]
        results = scoring.by_image(scoring.gather_results(predictions))
        if self.trainer.is_global_zero:
            self._metric.cat_ids = self.trainer.datamodule.category_ids
            scoring.write_results(self._metric, results, out_dir)
        return True


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
