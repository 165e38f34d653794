"""Scoring detections with mmdet's ``CocoMetric`` (pycocotools), quietly, over every DDP rank's results.

Imported through :mod:`polyattn_lightning.detection`, so mmcv's ops and mmdet's registries are in place.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import tempfile
from pathlib import Path

from ..distributed import gather_objects

#: CocoMetric's summary numbers, logged as ``val/<iou type>_<item>`` (e.g. ``val/bbox_mAP_50``).
METRIC_ITEMS = ("mAP", "mAP_50", "mAP_75", "mAP_s", "mAP_m", "mAP_l")
#: The run folder's file that keeps pycocotools' full tables of every evaluation (the console gets one line per IoU
#: type).
COCO_REPORT = "coco_eval.txt"
log = logging.getLogger(__name__)


def mmdet_detection():
    """mmdet's model registry and CocoMetric, once this project's mmcv op shim and modules are installed."""
    from mmdet.evaluation import CocoMetric
    from mmdet.registry import MODELS
    from mmengine.config import ConfigDict

    return MODELS, ConfigDict, CocoMetric


@contextlib.contextmanager
def quiet_mmengine():
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
def pycocotools_output():
    """What pycocotools prints (``loading annotations``, the 12-line summary tables), kept in the yielded buffer
    instead of the console; mmengine's info lines are dropped (the same numbers)."""
    buffer = io.StringIO()
    with quiet_mmengine(), contextlib.redirect_stdout(buffer):
        yield buffer


def gather_results(items: list) -> list:
    """Every rank's ``items`` concatenated in rank order (on every rank)."""
    return [item for part in gather_objects(items) for item in part]


def by_image(results: list[dict]) -> list[dict]:
    """One result per image id, sorted by it: what CocoMetric scores does not depend on rank count or order."""
    unique = {result["img_id"]: result for result in results}
    return [unique[image_id] for image_id in sorted(unique)]


def coco_metric(ann_file: str | os.PathLike, class_names: list[str], with_mask: bool):
    """mmdet's ``CocoMetric`` scoring boxes (and masks) against ``ann_file`` with these classes."""
    _, _, metric_class = mmdet_detection()
    with pycocotools_output() as output:
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
    return {
        f"{kind}_{item}": float(scores.get(f"{kind}_{item}", 0.0)) for kind in metric.metrics for item in METRIC_ITEMS
    }


def report(metric, where: str, scores: dict[str, float], tables: str, log_dir: str | None) -> None:
    """One console line per IoU type; pycocotools' full tables to the debug log and the run folder's
    :data:`COCO_REPORT`."""
    from lightning.pytorch.utilities.rank_zero import rank_zero_info

    for kind in metric.metrics:
        rank_zero_info(
            f"{where} {kind}: " + ", ".join(f"{item} {scores[f'{kind}_{item}']:.3f}" for item in METRIC_ITEMS)
        )
    log.debug(tables)
    if log_dir is not None and tables:
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(log_dir) / COCO_REPORT, "a") as file:
            file.write(f"==== {where}\n{tables}\n")


def write_results(metric, results: list[dict], out_dir: Path) -> None:
    """``results`` as COCO results JSON, ``<out_dir>/results.bbox.json`` (and ``results.segm.json``), written
    through a staging folder so that a reader never sees half a file; ``[]`` when there is no detection."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as staging:
        files = metric.results2json(results, os.path.join(staging, "results")) if results else {}
        for kind in metric.metrics:
            if kind in files:
                os.replace(files[kind], out_dir / f"results.{kind}.json")
            elif not results:
                (out_dir / f"results.{kind}.json").write_text("[]")
