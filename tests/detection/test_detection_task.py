"""DetectionModule: CocoMetric scoring, learning, predict files in original-image coordinates, exact resume."""
from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pycocotools.mask as mask_utils
import pytest
import torch
from detection_harness import TINY_SET, tiny_data, tiny_detector, tiny_detector_config, write_tiny_coco
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval
from training_helpers import Killed, KillAt, cpu_trainer

from polyattn_lightning.callbacks import ExactResume, NonFiniteLossGuard, PredictionWriter
from polyattn_lightning.detection.scoring import METRIC_ITEMS, coco_metric, coco_scores


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return write_tiny_coco(tmp_path_factory.mktemp("coco") / "shapes")


def val_coco(root: Path) -> COCO:
    return COCO(str(root / "annotations" / "instances_val2017.json"))


def ground_truth_results(coco: COCO, shift: float = 0.0, rng: np.random.Generator | None = None) -> list[dict]:
    """The validation annotations as CocoMetric-style results; ``shift`` moves boxes and masks right by that
    fraction of their width, ``rng`` draws the scores."""
    label = {cat_id: i for i, cat_id in enumerate(coco.getCatIds())}
    results = []
    for image_id in coco.getImgIds():
        anns = coco.loadAnns(coco.getAnnIds(imgIds=[image_id]))
        boxes, masks = [], []
        for ann in anns:
            x, y, w, h = ann["bbox"]
            dx = round(shift * w)
            boxes.append([x + dx, y, x + w + dx, y + h])
            masks.append(mask_utils.encode(np.asfortranarray(np.roll(coco.annToMask(ann), dx, axis=1))))
        n = len(anns)
        results.append({
            "img_id": image_id,
            "bboxes": np.array(boxes, dtype=np.float32).reshape(n, 4),
            "scores": rng.uniform(0.1, 1.0, n).astype(np.float32) if rng is not None else np.ones(n, np.float32),
            "labels": np.array([label[a["category_id"]] for a in anns], dtype=np.int64),
            "masks": masks,
        })
    return results


def test_ground_truth_as_predictions_scores_one_for_boxes_and_masks(coco_root):
    metric = coco_metric(coco_root / "annotations" / "instances_val2017.json", ["rectangle", "ellipse", "triangle"],
                         with_mask=True)
    scores = coco_scores(metric, ground_truth_results(val_coco(coco_root)))
    assert set(scores) == {f"{kind}_{item}" for kind in ("bbox", "segm") for item in METRIC_ITEMS}
    for kind in ("bbox", "segm"):
        assert scores[f"{kind}_mAP"] == 1.0 and scores[f"{kind}_mAP_50"] == 1.0 and scores[f"{kind}_mAP_75"] == 1.0


def test_scores_equal_pycocotools_on_imperfect_predictions_and_cover_only_the_images_given(coco_root):
    coco = val_coco(coco_root)
    results = ground_truth_results(coco, shift=0.2, rng=np.random.default_rng(0))
    results[0]["labels"] = (results[0]["labels"] + 1) % 3  # wrong classes on one image
    metric = coco_metric(coco_root / "annotations" / "instances_val2017.json", ["rectangle", "ellipse", "triangle"],
                         with_mask=False)
    scored = results[:4]  # as if validation had stopped after 4 images
    scores = coco_scores(metric, scored)

    detections = [
        {"image_id": r["img_id"], "category_id": coco.getCatIds()[label], "score": float(score),
         "bbox": [float(b[0]), float(b[1]), float(b[2] - b[0]), float(b[3] - b[1])]}
        for r in scored for b, label, score in zip(r["bboxes"], r["labels"], r["scores"])
    ]
    reference = COCOeval(coco, coco.loadRes(detections), "bbox")
    reference.params.imgIds = [r["img_id"] for r in scored]
    reference.params.maxDets = [100, 300, 1000]
    reference.evaluate(), reference.accumulate(), reference.summarize()
    assert 0 < scores["bbox_mAP"] < 1
    for i, item in enumerate(METRIC_ITEMS):
        assert scores[f"bbox_{item}"] == pytest.approx(round(float(reference.stats[i]), 3), abs=1e-9)


def test_no_detections_score_zero(coco_root):
    metric = coco_metric(coco_root / "annotations" / "instances_val2017.json", ["rectangle", "ellipse", "triangle"],
                         with_mask=True)
    empty = [{**r, "bboxes": r["bboxes"][:0], "scores": r["scores"][:0], "labels": r["labels"][:0], "masks": []}
             for r in ground_truth_results(val_coco(coco_root))]
    assert set(coco_scores(metric, empty).values()) == {0.0}


class LossHistory(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


def test_training_lowers_the_loss_and_logs_every_loss_by_name(coco_root, tmp_path):
    pl.seed_everything(0)
    history = LossHistory()
    # overfit_batches validates on that batch too: its COCO tables go to the run folder, here tmp_path
    trainer = cpu_trainer(max_steps=25, overfit_batches=1, limit_val_batches=0, callbacks=[history],
                          default_root_dir=tmp_path)
    model = tiny_detector()
    trainer.fit(model, tiny_data(coco_root, train_sizes=[64], crop_sizes=None))
    assert np.mean(history.losses[-5:]) < 0.6 * np.mean(history.losses[:5])
    assert (tmp_path / "coco_eval.txt").is_file()  # not the working directory's
    logged = set(trainer.callback_metrics)
    assert {"train/loss", "train/loss_rpn_cls", "train/loss_rpn_bbox", "train/loss_cls", "train/loss_bbox",
            "train/loss_mask", "train/acc"} <= logged


def test_predict_writes_coco_results_in_original_image_coordinates(coco_root, tmp_path):
    pl.seed_everything(0)
    detector = tiny_detector_config()
    detector["test_cfg"]["rcnn"]["score_thr"] = 0.0  # an untrained model: keep every detection
    model = tiny_detector(detector=detector)
    trainer = cpu_trainer(default_root_dir=tmp_path, callbacks=[PredictionWriter()])
    trainer.predict(model, tiny_data(coco_root, test_size=96), return_predictions=False)  # resized x1.5 for the model

    size = TINY_SET.image_size
    boxes = json.loads((tmp_path / "predictions" / "results.bbox.json").read_text())
    masks = json.loads((tmp_path / "predictions" / "results.segm.json").read_text())
    assert len(boxes) == len(masks) > 0
    assert {d["image_id"] for d in boxes} <= set(val_coco(coco_root).getImgIds())
    for box, mask in zip(boxes, masks):
        assert box["category_id"] in (1, 2, 3) and 0 <= box["score"] <= 1
        x, y, w, h = box["bbox"]
        assert 0 <= x and 0 <= y and x + w <= size + 1e-3 and y + h <= size + 1e-3
        assert mask_utils.decode(mask["segmentation"]).shape == (size, size)
    assert max(d["bbox"][0] + d["bbox"][2] for d in boxes) > size / 2  # not all squeezed into a corner


def test_a_class_count_that_disagrees_with_the_data_stops_the_run(coco_root):
    model = tiny_detector(num_classes=5)
    with pytest.raises(ValueError, match=r"num_classes is 5 but COCODataModule has num_classes=3"):
        cpu_trainer(max_steps=1).fit(model, tiny_data(coco_root))


# ---- exact resume ----------------------------------------------------------------------------------

STEPS_PER_EPOCH, EPOCHS = 3, 2


class RecordImages(Callback):
    """The (step, image ids, image shapes) each optimizer step trained on: order and augmentation."""

    def __init__(self) -> None:
        self.seen: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.seen.append((trainer.global_step, [s.img_id for s in batch["data_samples"]],
                          [tuple(x.shape) for x in batch["inputs"]]))


def train(root: Path, ckpt_dir: Path, kill_at: int | None = None, ckpt_path: Path | None = None,
          num_workers: int = 0) -> dict:
    pl.seed_everything(0)
    model, record = tiny_detector(), RecordImages()
    trainer = cpu_trainer(
        max_epochs=EPOCHS, limit_train_batches=STEPS_PER_EPOCH, limit_val_batches=0, enable_checkpointing=True,
        callbacks=[ExactResume(), NonFiniteLossGuard(), record, KillAt(kill_at),
                   ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2)],
    )
    try:
        trainer.fit(model, tiny_data(root, num_workers=num_workers), ckpt_path=ckpt_path)
    except Killed:
        return {}
    return {"weights": model.state_dict(), "optimizer": trainer.optimizers[0].state_dict(), "seen": record.seen}


@pytest.mark.parametrize("num_workers", [0, 1], ids=["in_process", "worker"])
def test_resuming_mid_epoch_gives_the_weights_of_an_uninterrupted_run(coco_root, tmp_path, num_workers):
    """mmdet's random flips, sizes and crops draw from numpy's global RNG: seeded per (seed, epoch, image),
    they come out the same in a resumed run, in the main process or in a loader worker."""
    reference = train(coco_root, tmp_path / "reference", num_workers=num_workers)
    assert train(coco_root, tmp_path / "killed", kill_at=5, num_workers=num_workers) == {}
    last = tmp_path / "killed" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 4  # epoch 1, one batch in
    resumed = train(coco_root, tmp_path / "killed", ckpt_path=last, num_workers=num_workers)

    assert resumed["seen"] == reference["seen"][4:]  # same images, same random sizes and crops
    for name, weight in reference["weights"].items():
        assert torch.equal(resumed["weights"][name], weight), name
    for key, state in reference["optimizer"]["state"].items():
        assert all(torch.equal(resumed["optimizer"]["state"][key][k], v) for k, v in state.items())


# ---- the 3x recipe's optimizer and schedule, against mmengine's own ------------------------------------

def test_step_schedule_and_no_decay_groups_equal_mmengines(monkeypatch):
    """The recipe's parameter groups and lr curve, against mmengine's optimizer constructor (paramwise_cfg
    custom_keys with decay_mult 0) and its LinearLR + MultiStepLR schedulers, which the XCiT configs use."""
    from mmengine.optim import DefaultOptimWrapperConstructor, LinearLR, MultiStepLR

    from polyattn_lightning.tasks.optim import OptimRecipe, build_optimizer, build_scheduler

    detector = tiny_detector(num_classes=3).detector  # built without data: the count given
    keys = ["absolute_pos_embed", "relative_position_bias_table", "norm"]
    recipe = OptimRecipe(lr=1e-4, reference_batch=None, weight_decay=0.05, warmup_steps=5, warmup_lr=1e-7,
                         schedule="step", decay_epochs=[2, 3], decay_rate=0.1, no_decay_keys=keys)
    ours = build_optimizer(detector, recipe, recipe.lr)
    reference = DefaultOptimWrapperConstructor(
        {"type": "OptimWrapper", "optimizer": {"type": "AdamW", "lr": 1e-4, "weight_decay": 0.05}},
        {"custom_keys": {key: {"decay_mult": 0.0} for key in keys}},
    )(detector).optimizer  # (logs every parameter's options at INFO)
    decay_of = {id(p): g["weight_decay"] for g in reference.param_groups for p in g["params"]}
    assert {id(p): g["weight_decay"] for g in ours.param_groups for p in g["params"]} == decay_of
    assert 0 < sum(w == 0 for w in decay_of.values()) < len(decay_of)

    steps_per_epoch, total = 10, 40
    scheduler = build_scheduler(ours, recipe, total, steps_per_epoch)
    # mmengine's LinearLR reaches the full lr at update end - 1; the XCiT authors' mmcv 1.x warmup
    # (warmup_iters=500, ratio 0.001) reaches it at update 500, which is end = warmup + 1 here
    mm = [LinearLR(reference, start_factor=1e-3, by_epoch=False, begin=0, end=6),
          MultiStepLR(reference, milestones=[20, 30], gamma=0.1, by_epoch=False)]
    for update in range(total):
        assert ours.param_groups[0]["lr"] == pytest.approx(reference.param_groups[0]["lr"], rel=1e-6), update
        scheduler.step_update(num_updates=update + 1)
        for s in mm:
            s.step()


def test_a_validation_prints_one_line_per_iou_type_and_keeps_the_coco_tables_in_the_run_folder(coco_root, tmp_path,
                                                                                              capfd, caplog):
    from lightning.pytorch.loggers import CSVLogger

    from polyattn_lightning.detection.scoring import COCO_REPORT

    trainer = cpu_trainer(logger=CSVLogger(tmp_path, name="run"))
    with caplog.at_level("INFO"):
        trainer.validate(tiny_detector(), tiny_data(coco_root), verbose=False)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("val (step 0, 5 images) ")]
    assert [line.split(":")[0] for line in lines] == ["val (step 0, 5 images) bbox", "val (step 0, 5 images) segm"]
    assert all(f"{item} " in line for line in lines for item in METRIC_ITEMS)
    console = "".join(capfd.readouterr())
    assert "Average Precision" not in console and "loading annotations" not in console
    tables = (Path(trainer.log_dir) / COCO_REPORT).read_text()
    assert tables.count("Average Precision  (AP) @[ IoU=0.50      | area=   all") == 2  # bbox and segm
