"""Object detection and instance segmentation with an mmdet detector, trained by Lightning.

The detector (RPN, RoI heads, losses, post-processing) is mmdet's, built with
its registry from a config mapping; this module only drives it: the batch goes
through the detector's data preprocessor and ``mode='loss'`` for training and
``mode='predict'`` for evaluation, scored by mmdet's ``CocoMetric`` once over the
whole validation set (gathered from every DDP rank).
"""
from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from jsonargparse.typing import Path_fr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

from ..attention import ActivationSpec
from ..distributed import gather_objects
from ..errors import ConfigError, MissingPathError
from .base import TaskModule
from .optim import OptimRecipe

#: CocoMetric's summary numbers, logged as ``val/<iou type>_<item>`` (e.g. ``val/bbox_mAP_50``).
METRIC_ITEMS = ("mAP", "mAP_50", "mAP_75", "mAP_s", "mAP_m", "mAP_l")
#: The run folder's file that keeps pycocotools' full tables of every evaluation (the console gets one line per IoU type).
COCO_REPORT = "coco_eval.txt"
log = logging.getLogger(__name__)


def _mmdet_detection():
    """mmdet's model registry and CocoMetric, once this project's mmcv op shim and modules are installed."""
    from .. import detection  # noqa: F401  (mmcv ops from torchvision; mmdet's registries and our backbone)
    from mmdet.evaluation import CocoMetric
    from mmdet.registry import MODELS
    from mmengine.config import ConfigDict

    return MODELS, ConfigDict, CocoMetric


@contextlib.contextmanager
def _quiet_mmengine():
    """mmengine's logger at WARNING for the duration."""
    from mmengine.logging import MMLogger

    logger = MMLogger.get_current_instance()
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _pycocotools_output():
    """What pycocotools prints (``loading annotations``, the 12-line summary tables), kept in the yielded buffer
    instead of the console; mmengine's info lines are dropped (the same numbers)."""
    buffer = io.StringIO()
    with _quiet_mmengine(), contextlib.redirect_stdout(buffer):
        yield buffer


def load_detector_config(detector: Mapping[str, Any] | str | os.PathLike) -> dict[str, Any]:
    """The mmdet model config: the mapping itself, or the mapping held by a YAML file, over its ``_base_``.

    A mapping with ``_base_: <yaml file>`` (relative to the file holding the mapping; for a mapping given inline,
    to the working directory) is that file's mapping (itself loaded this way) deep-merged with the rest: mappings
    are merged key by key, any other value (a list too) replaces the base's. A path given in a config file arrives
    as jsonargparse's ``Path_fr``, already resolved against that config file's folder (its ``absolute``).
    """
    if isinstance(detector, Mapping):
        return _with_base(copy.deepcopy(dict(detector)), Path.cwd(), "the detector mapping")
    absolute = getattr(detector, "absolute", None)  # jsonargparse's Path_fr: a str; pathlib's Path: a method
    path = Path(absolute if isinstance(absolute, str) else detector)
    if not path.is_file():
        raise MissingPathError(f"detector config {path} does not exist (a YAML file holding an mmdet model mapping)")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the detector config {path}: {err}") from err
    if not isinstance(config, dict) or not ("type" in config or "_base_" in config):
        raise ConfigError(f"{path}: expected an mmdet model config mapping with a 'type' (e.g. MaskRCNN)")
    return _with_base(config, path.parent, str(path))


def _with_base(config: dict[str, Any], folder: Path, where: str) -> dict[str, Any]:
    """``config`` deep-merged over the mapping its ``_base_`` names (relative to ``folder``); itself without one."""
    base = config.pop("_base_", None)
    if base is None:
        if "type" not in config:
            raise ConfigError(f"{where}: expected an mmdet model config mapping with a 'type' (e.g. MaskRCNN)")
        return config
    if not isinstance(base, str):
        raise ConfigError(f"{where}: _base_ must name one YAML file, got {base!r}")
    return deep_merge(load_detector_config(folder / base), config)


def deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override``'s values: mappings merged key by key, anything else (lists too) replaced."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


#: the RoI heads that have a ``num_classes`` (Mask R-CNN: the box and the mask head)
CLASS_HEADS = ("bbox_head", "mask_head")


def heads_num_classes(config: Mapping[str, Any]) -> int | None:
    """The ``num_classes`` the detector config's RoI heads state (None if none does); they must agree."""
    roi_head = config.get("roi_head")
    stated = {f"roi_head.{key}.num_classes": roi_head[key]["num_classes"] for key in CLASS_HEADS
              if isinstance(roi_head, Mapping) and isinstance(roi_head.get(key), Mapping)
              and "num_classes" in roi_head[key]} if isinstance(roi_head, Mapping) else {}
    if len(set(stated.values())) > 1:
        raise ConfigError(f"the detector config's heads disagree on the class count: {stated}")
    return next(iter(stated.values()), None)


def with_num_classes(config: dict, num_classes: int) -> dict:
    """``config`` with every RoI head's ``num_classes`` set (Mask R-CNN: the box and the mask head)."""
    roi_head = config.get("roi_head")
    heads = [roi_head[key] for key in CLASS_HEADS if isinstance(roi_head.get(key), dict)] if isinstance(roi_head, dict) else []
    if not heads:
        raise ConfigError("the detector config has no roi_head.bbox_head or mask_head to set num_classes on")
    for head in heads:
        head["num_classes"] = num_classes
    return config


def _gather(items: list) -> list:
    """Every rank's ``items`` concatenated in rank order (on every rank)."""
    return [item for part in gather_objects(items) for item in part]


def _by_image(results: list[dict]) -> list[dict]:
    """One result per image id, sorted by it: what CocoMetric scores does not depend on rank count or order."""
    unique = {result["img_id"]: result for result in results}
    return [unique[image_id] for image_id in sorted(unique)]


def coco_metric(ann_file: str | os.PathLike, class_names: list[str], with_mask: bool):
    """mmdet's ``CocoMetric`` scoring boxes (and masks) against ``ann_file`` with these classes."""
    _, _, metric_class = _mmdet_detection()
    with _pycocotools_output() as output:
        metric = metric_class(ann_file=str(ann_file), metric=["bbox", "segm"] if with_mask else ["bbox"])
    log.debug(output.getvalue())
    metric.dataset_meta = {"classes": tuple(class_names)}
    return metric


def coco_scores(metric, results: list[dict]) -> dict[str, float]:
    """``metric``'s AP, AP50, AP75, APs/m/l for each of its IoU types over the images in ``results``.

    ``results`` are per-image dicts as ``CocoMetric.process`` makes them. Only
    those images are scored, so a validation limited to some batches is scored
    on what it saw. No detection at all scores 0 (mmdet would return nothing).
    """
    metric.img_ids = [result["img_id"] for result in results]
    scores = metric.compute_metrics([({}, result) for result in results]) if results else {}
    return {f"{kind}_{item}": float(scores.get(f"{kind}_{item}", 0.0)) for kind in metric.metrics for item in METRIC_ITEMS}


class DetectionModule(TaskModule):
    """An mmdet detector (e.g. XCiT Mask R-CNN + FPN) whose backbone attention comes from the registry.

    The class count is the DataModule's unless given (here or by the config's heads, not both).
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
        """
        super().__init__()
        self.save_hyperparameters()
        config = load_detector_config(detector)
        self.hparams.detector = copy.deepcopy(config)  # checkpoints hold the config itself (weights_only-loadable)
        backbone = config.get("backbone") if isinstance(config.get("backbone"), dict) else {}
        if "pretrained" in backbone:
            raise ConfigError("detector.backbone.pretrained: give the backbone weights as model.init_args.pretrained "
                              "(one place, which --ckpt_path knows to skip)")
        backbone_attention = backbone.pop("attention", None)  # switched once, by the base, to the one spec
        if attention is not None and backbone_attention is not None:
            raise ConfigError(f"the backbone attention is given twice: model.init_args.attention {attention!r} and "
                              f"detector.backbone.attention {backbone_attention!r}; give it in one place")
        self._attention = attention if attention is not None else backbone_attention or "softmax"
        stated = heads_num_classes(config)
        if num_classes is not None and stated is not None and num_classes != stated:
            raise ConfigError(f"the class count is given twice: model.init_args.num_classes {num_classes} and the "
                              f"detector config's heads num_classes {stated}; give it in one place (or leave both out: "
                              "the data's count is used)")
        self.hparams.num_classes = num_classes if num_classes is not None else stated
        self._config = config
        self.detector = None
        self._results: list[dict] = []
        self._metric = None
        self.build_if_known()

    def build(self) -> None:
        models, config_dict, _ = _mmdet_detection()
        config = with_num_classes(copy.deepcopy(self._config), self.hparams.num_classes)
        self.detector = models.build(config_dict(config))  # mmdet reads nested settings as attributes
        with _quiet_mmengine():  # mmengine logs one line per parameter that init_weights leaves alone
            self.detector.init_weights()
        if self.hparams.pretrained is not None:
            self.detector.backbone.load_pretrained(self.hparams.pretrained)

    def attention_target(self) -> nn.Module:
        return self.detector.backbone

    def attention_spec(self) -> ActivationSpec:
        return self._attention

    def optimized_module(self) -> nn.Module:
        return self.detector

    # ---- set-up ------------------------------------------------------------------------------------

    @property
    def num_classes(self) -> int | None:
        return self.hparams.num_classes

    def setup(self, stage: str) -> None:
        """Check the classes against the data and make the COCO metric for its annotation file."""
        datamodule = self.trainer.datamodule
        names = getattr(datamodule, "classes", None)
        if names is None or not hasattr(datamodule, "val_ann_file"):
            raise ConfigError(f"DetectionModule needs a COCO-format DataModule (classes, val_ann_file), got "
                              f"{type(datamodule).__name__}")
        super().setup(stage)
        with_mask = isinstance(self._config.get("roi_head"), dict) and self._config["roi_head"].get("mask_head") is not None
        self._metric = coco_metric(datamodule.val_ann_file, names, with_mask)  # set up before the detector is built

    def _preprocess(self, batch: dict, training: bool) -> dict:
        preprocessor = self.detector.data_preprocessor
        preprocessor.to(self.device)  # mmengine keeps its own device record, which Lightning's .to() never sets
        return preprocessor(batch, training)

    # ---- attention diagnostics (callbacks/attention_norms.py, attention_maps.py) ------------------

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
        self.log_dict({f"train/{name}": value for name, value in parts.items() if name != "loss"},
                      batch_size=batch_size)
        return loss

    def _predict(self, batch: dict) -> list[dict]:
        """Detections per image in original-image coordinates, as CocoMetric keeps them (RLE masks, numpy)."""
        samples = self.detector(**self._preprocess(batch, False), mode="predict")
        self._metric.process({}, [sample.to_dict() for sample in samples])
        converted, self._metric.results = self._metric.results, []
        return [result for _gt, result in converted]

    def evaluate(self, batch: dict, stage: str) -> None:
        """Keep the batch's detections; they are scored together at the end of the epoch."""
        self._results.extend(self._predict(batch))

    def predict_step(self, batch: dict, batch_idx: int) -> list[dict]:
        """Per image: ``img_id``, ``bboxes`` (x1, y1, x2, y2), ``scores``, ``labels`` and RLE ``masks``."""
        return self._predict(batch)

    def on_validation_epoch_end(self) -> None:
        self._log_coco("val")

    def on_test_epoch_end(self) -> None:
        self._log_coco("test")

    def _log_coco(self, stage: str) -> None:
        """Score every rank's detections together, once, on rank 0; every rank logs the same numbers."""
        results, self._results = _by_image(_gather(self._results)), []
        scores, log_dir = None, self.trainer.log_dir  # log_dir broadcasts: every rank asks, before rank 0 scores
        if self.trainer.is_global_zero:
            with _pycocotools_output() as output:
                scores = coco_scores(self._metric, results)
            self._report_coco(stage, scores, output.getvalue(), log_dir)
        scores = self.trainer.strategy.broadcast(scores, src=0)
        for name, value in scores.items():
            self.log(f"{stage}/{name}", value, prog_bar=name.endswith("mAP_50"))

    def _report_coco(self, stage: str, scores: dict[str, float], tables: str, log_dir: str | None) -> None:
        """One console line per IoU type; pycocotools' full tables to the debug log and the run folder's
        :data:`COCO_REPORT`."""
        where = f"{stage} (step {self.trainer.global_step}, {len(self._metric.img_ids)} images)"
        for kind in self._metric.metrics:
            rank_zero_info(f"{where} {kind}: " + ", ".join(f"{item} {scores[f'{kind}_{item}']:.3f}" for item in METRIC_ITEMS))
        log.debug(tables)
        if log_dir is not None and tables:
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(log_dir) / COCO_REPORT, "a") as file:
                file.write(f"==== {where}\n{tables}\n")

    # ---- prediction files --------------------------------------------------------------------------

    def save_predictions(self, predictions: list[dict], out_dir: Path) -> bool:
        """Write every rank's detections as COCO results JSON, ``<out_dir>/results.bbox.json`` and (with
        masks) ``results.segm.json``: one entry per detection with ``image_id``, ``category_id``, ``bbox``
        (x, y, w, h), ``score`` and, in the latter, the RLE ``segmentation``. Called by
        :class:`~polyattn_lightning.callbacks.PredictionWriter` on every rank; rank 0 writes."""
        results = _by_image(_gather(predictions))
        if not self.trainer.is_global_zero:
            return True
        metric = self._metric
        metric.cat_ids = self.trainer.datamodule.category_ids
        out_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out_dir) as staging:
            files = metric.results2json(results, os.path.join(staging, "results")) if results else {}
            for kind in metric.metrics:
                if kind in files:
                    os.replace(files[kind], out_dir / f"results.{kind}.json")
                elif not results:
                    (out_dir / f"results.{kind}.json").write_text("[]")
        return True
