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

import lightning.pytorch as pl
import yaml
from jsonargparse.typing import Path_fr
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor

from ..attention import ActivationSpec
from ..attention.timm_patch import set_attention
from ..distributed import gather_objects
from ..errors import ConfigError, MissingPathError
from .optim import OptimRecipe, configure_recipe, step_scheduler

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
    """The mmdet model config: the mapping itself, or the mapping held by a YAML file.

    A path given in a config file arrives as jsonargparse's ``Path_fr``, already
    resolved against that config file's folder (its ``absolute``).
    """
    if isinstance(detector, Mapping):
        return copy.deepcopy(dict(detector))
    path = Path(getattr(detector, "absolute", detector))
    if not path.is_file():
        raise MissingPathError(f"detector config {path} does not exist (a YAML file holding an mmdet model mapping)")
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read the detector config {path}: {err}") from err
    if not isinstance(config, dict) or "type" not in config:
        raise ConfigError(f"{path}: expected an mmdet model config mapping with a 'type' (e.g. MaskRCNN)")
    return config


def _with_num_classes(config: dict, num_classes: int) -> dict:
    """``config`` with every RoI head's ``num_classes`` set (Mask R-CNN: the box and the mask head)."""
    roi_head = config.get("roi_head")
    heads = [roi_head.get(key) for key in ("bbox_head", "mask_head")] if isinstance(roi_head, dict) else []
    if not any(isinstance(head, dict) and "num_classes" in head for head in heads):
        raise ConfigError("num_classes is given but the detector config has no roi_head.bbox_head/mask_head "
                         "with a num_classes to set")
    for head in heads:
        if isinstance(head, dict) and "num_classes" in head:
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


class DetectionModule(pl.LightningModule):
    """An mmdet detector (e.g. XCiT Mask R-CNN + FPN) whose backbone attention comes from the registry."""

    #: the metric the best checkpoint keeps (the CLI's ``--checkpoint.monitor`` default), higher is better
    monitor, mode = "val/bbox_mAP", "max"

    def __init__(
        self,
        detector: dict[str, Any] | Path_fr,
        attention: ActivationSpec = "softmax",
        num_classes: int | None = None,
        pretrained: str | None = None,
        optim: OptimRecipe = OptimRecipe(),
    ):
        """
        Args:
            detector: an mmdet model config mapping (``type: MaskRCNN``, ``backbone``, ``neck``,
                ``rpn_head``, ``roi_head``, ``train_cfg``, ``test_cfg``, ``data_preprocessor``), built
                with mmdet's ``MODELS`` registry, or a YAML file holding one (in a config file, relative
                to that file). The hyperparameters keep the mapping, not the path.
            attention: registry activation for every attention layer of the backbone, as in
                classification: ``softmax``, ``poly3``, ``{name: poly3, scale: 0.0714}``...
            num_classes: when set, the RoI heads' ``num_classes`` (which must match the data's classes);
                unset, the detector config's value is used and checked against the data.
            pretrained: backbone weights to start from: this project's classification ``.ckpt`` or a
                timm/official XCiT state dict; never downloaded.
            optim: optimizer and schedule (the XCiT 3x recipe in ``configs/detection/recipes``).
        """
        super().__init__()
        self.save_hyperparameters()
        config = load_detector_config(detector)
        self.hparams.detector = copy.deepcopy(config)  # checkpoints hold the config itself (weights_only-loadable)
        if num_classes is not None:
            config = _with_num_classes(config, num_classes)
        models, config_dict, _ = _mmdet_detection()
        self.detector = models.build(config_dict(config))  # mmdet reads nested settings as attributes
        with _quiet_mmengine():  # mmengine logs one line per parameter that init_weights leaves alone
            self.detector.init_weights()
        set_attention(self.detector.backbone, attention)
        if pretrained is not None:
            self.detector.backbone.load_pretrained(pretrained)
        self.optim = optim
        self._results: list[dict] = []
        self._metric = None

    # ---- set-up ------------------------------------------------------------------------------------

    @property
    def num_classes(self) -> int:
        return self.detector.roi_head.bbox_head.num_classes

    def setup(self, stage: str) -> None:
        """Check the classes against the data and make the COCO metric for its annotation file."""
        datamodule = self.trainer.datamodule
        names = getattr(datamodule, "class_names", None)
        if names is None or not hasattr(datamodule, "val_ann_file"):
            raise ConfigError(f"DetectionModule needs a COCO-format DataModule (class_names, val_ann_file), got "
                            f"{type(datamodule).__name__}")
        if len(names) != self.num_classes:
            raise ConfigError(f"the detector has num_classes={self.num_classes} but the data has {len(names)} "
                             f"classes {names}; set model.init_args.num_classes: {len(names)}")
        self._metric = coco_metric(datamodule.val_ann_file, names, self.detector.with_mask)

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

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self._results.extend(self._predict(batch))

    def test_step(self, batch: dict, batch_idx: int) -> None:
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
        scores = None
        if self.trainer.is_global_zero:
            with _pycocotools_output() as output:
                scores = coco_scores(self._metric, results)
            self._report_coco(stage, scores, output.getvalue())
        scores = self.trainer.strategy.broadcast(scores, src=0)
        for name, value in scores.items():
            self.log(f"{stage}/{name}", value, prog_bar=name.endswith("mAP_50"))

    def _report_coco(self, stage: str, scores: dict[str, float], tables: str) -> None:
        """One console line per IoU type; pycocotools' full tables to the debug log and the run folder's
        :data:`COCO_REPORT`."""
        where = f"{stage} (step {self.trainer.global_step}, {len(self._metric.img_ids)} images)"
        for kind in self._metric.metrics:
            rank_zero_info(f"{where} {kind}: " + ", ".join(f"{item} {scores[f'{kind}_{item}']:.3f}" for item in METRIC_ITEMS))
        log.debug(tables)
        if self.trainer.log_dir is not None and tables:
            Path(self.trainer.log_dir).mkdir(parents=True, exist_ok=True)
            with open(Path(self.trainer.log_dir) / COCO_REPORT, "a") as file:
                file.write(f"==== {where}\n{tables}\n")

    # ---- prediction files --------------------------------------------------------------------------

    def save_predictions(self, predictions: list[dict], out_dir: Path) -> None:
        """Write every rank's detections as COCO results JSON, ``<out_dir>/results.bbox.json`` and (with
        masks) ``results.segm.json``: one entry per detection with ``image_id``, ``category_id``, ``bbox``
        (x, y, w, h), ``score`` and, in the latter, the RLE ``segmentation``. Called by
        :class:`~polyattn_lightning.callbacks.PredictionWriter` on every rank; rank 0 writes."""
        results = _by_image(_gather(predictions))
        if not self.trainer.is_global_zero:
            return
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

    # ---- optimization ------------------------------------------------------------------------------

    def configure_optimizers(self) -> dict[str, Any]:
        return configure_recipe(self, self.detector, self.optim)

    def lr_scheduler_step(self, scheduler, metric) -> None:
        step_scheduler(self, scheduler)
