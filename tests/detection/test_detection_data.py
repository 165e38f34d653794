"""The synthetic COCO writer and COCODataModule: valid COCO on disk, mmdet batches, classes, and bad input."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from detection_harness import TINY_SET, tiny_data, write_tiny_coco
from pycocotools.coco import COCO

from polyattn_lightning.data.coco import COCODataError, COCODataModule, ImageLoadError
from polyattn_lightning.data.synthetic_coco import MARKER, SyntheticCOCO, default_root, ensure_synthetic_coco
from polyattn_lightning.errors import ConfigError


@pytest.fixture(scope="module")
def coco_root(tmp_path_factory) -> Path:
    return write_tiny_coco(tmp_path_factory.mktemp("coco") / "shapes")


def copy_set(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


def edit_annotations(root: Path, split: str, edit) -> Path:
    path = root / "annotations" / f"instances_{split}.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))
    return path


def test_synthetic_set_is_valid_coco_whose_masks_match_boxes_and_areas(coco_root):
    for split, count in (("train2017", TINY_SET.train_images), ("val2017", TINY_SET.val_images)):
        coco = COCO(str(coco_root / "annotations" / f"instances_{split}.json"))
        assert len(coco.getImgIds()) == count
        assert [c["name"] for c in coco.loadCats(coco.getCatIds())] == ["rectangle", "ellipse", "triangle"]
        assert all(1 <= len(coco.getAnnIds(imgIds=[i])) <= TINY_SET.max_objects for i in coco.getImgIds())
        for ann in coco.loadAnns(coco.getAnnIds()):
            image = coco.loadImgs([ann["image_id"]])[0]
            assert (coco_root / split / image["file_name"]).is_file()
            mask = coco.annToMask(ann)
            assert mask.shape == (image["height"], image["width"])
            ys, xs = np.nonzero(mask)
            x, y, w, h = ann["bbox"]
            # the rasterised polygon fills its box to within a pixel and a half (pixel-centre rule), its area is the polygon's
            assert abs(xs.min() - x) <= 1.5 and abs(ys.min() - y) <= 1.5
            assert abs(xs.max() + 1 - (x + w)) <= 1.5 and abs(ys.max() + 1 - (y + h)) <= 1.5
            assert mask.sum() == pytest.approx(ann["area"], rel=0.15)


def test_synthetic_set_is_a_function_of_its_seed(tmp_path):
    config = SyntheticCOCO(train_images=2, val_images=1, image_size=32, seed=3)
    a, b = write_tiny_coco(tmp_path / "a", config), write_tiny_coco(tmp_path / "b", config)
    c = write_tiny_coco(tmp_path / "c", SyntheticCOCO(train_images=2, val_images=1, image_size=32, seed=4))
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert all((a / f).read_bytes() == (b / f).read_bytes() for f in files)
    assert (a / "train2017" / "000000000001.jpg").read_bytes() != (c / "train2017" / "000000000001.jpg").read_bytes()


def test_generated_on_first_use_reused_regenerated_for_other_settings_never_over_a_foreign_folder(tmp_path):
    config = SyntheticCOCO(train_images=2, val_images=1, image_size=32)
    data = COCODataModule(synthetic=config, synthetic_root=str(tmp_path / "gen"), num_workers=0)
    data.prepare_data()
    marker = tmp_path / "gen" / MARKER
    stamp = marker.stat().st_mtime_ns
    data.prepare_data()
    assert marker.stat().st_mtime_ns == stamp  # reused, not rewritten
    data.setup("validate")
    assert len(data.val_set) == 1
    ensure_synthetic_coco(tmp_path / "gen", SyntheticCOCO(train_images=2, val_images=3, image_size=32))
    assert len(json.loads((tmp_path / "gen" / "annotations" / "instances_val2017.json").read_text())["images"]) == 3

    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("user data")
    with pytest.raises(ConfigError, match="mine.*not generated"):
        ensure_synthetic_coco(foreign, config)
    assert (foreign / "keep.txt").read_text() == "user data"


def test_the_default_folder_is_in_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_root() == tmp_path / "polyattn_lightning" / "synthetic_coco"
    assert COCODataModule(synthetic=SyntheticCOCO()).data_root == default_root()
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_root() == Path.home() / ".cache" / "polyattn_lightning" / "synthetic_coco"


def test_a_root_that_does_not_exist_is_an_error_not_a_reason_to_generate(tmp_path):
    data = COCODataModule(root=str(tmp_path / "nowhere"), synthetic=SyntheticCOCO(train_images=1, val_images=1),
                          synthetic_root=str(tmp_path / "gen"))
    data.prepare_data()
    with pytest.raises(FileNotFoundError, match=r"nowhere does not exist; expected layout:\n.*instances_train2017"):
        data.setup("fit")
    assert not (tmp_path / "gen").exists()


def test_no_root_and_no_synthetic_settings_asks_for_the_root():
    with pytest.raises(ValueError, match="needs --data.init_args.root"):
        COCODataModule().setup("fit")


def test_batches_are_mmdet_samples_and_classes_come_from_the_file_in_its_order(coco_root, tmp_path):
    root = copy_set(coco_root, tmp_path / "set")
    reorder = lambda d: d.update(categories=list(reversed(d["categories"])))  # noqa: E731
    edit_annotations(root, "train2017", reorder)
    edit_annotations(root, "val2017", reorder)
    data = tiny_data(root)
    data.setup("fit")
    assert data.classes == ["triangle", "ellipse", "rectangle"]
    assert data.category_ids == [3, 2, 1]
    assert data.num_classes == 3
    batch = next(iter(data.train_dataloader()))
    assert len(batch["inputs"]) == 2 and batch["inputs"][0].dtype == torch.uint8
    sample = batch["data_samples"][0]
    # label = position in the file's category list: a triangle (id 3) is label 0
    coco = COCO(str(root / "annotations" / "instances_train2017.json"))
    file_labels = sorted(2 - (a["category_id"] - 1) for a in coco.loadAnns(coco.getAnnIds(imgIds=[sample.img_id])))
    assert sorted(sample.gt_instances.labels.tolist()) == file_labels
    assert 56 <= min(sample.img_shape) and max(sample.img_shape) <= 120
    assert len(sample.gt_instances.masks) == len(sample.gt_instances.bboxes)


def test_images_without_annotations_are_left_out_of_training_only(coco_root, tmp_path):
    root = copy_set(coco_root, tmp_path / "set")
    for split in ("train2017", "val2017"):
        first = json.loads((root / "annotations" / f"instances_{split}.json").read_text())["images"][0]["id"]
        edit_annotations(root, split, lambda d: d.update(annotations=[a for a in d["annotations"]
                                                                      if a["image_id"] != first]))
    data = tiny_data(root)
    data.setup("fit")
    assert len(data.train_set) == TINY_SET.train_images - 1
    assert len(data.val_set) == TINY_SET.val_images


def test_configured_classes_must_match_the_file(coco_root):
    tiny_data(coco_root, classes=["rectangle", "ellipse", "triangle"]).setup("fit")
    with pytest.raises(COCODataError, match=r"configured but not in the file: \['person'\]; "
                                            r"in the file but not configured: \['triangle'\]"):
        tiny_data(coco_root, classes=["rectangle", "ellipse", "person"]).setup("fit")
    with pytest.raises(COCODataError, match="another order"):
        tiny_data(coco_root, classes=["ellipse", "rectangle", "triangle"]).setup("fit")


@pytest.mark.parametrize("missing", ["annotations/instances_train2017.json", "train2017", "val2017"])
def test_missing_annotation_file_or_image_folder_is_named_with_the_layout(coco_root, tmp_path, missing):
    import shutil

    root = copy_set(coco_root, tmp_path / "set")
    target = root / missing
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(FileNotFoundError, match=rf"{missing} does not exist; expected layout"):
        tiny_data(root).setup("fit")


def test_annotation_of_a_missing_image_file_is_named(coco_root, tmp_path):
    root = copy_set(coco_root, tmp_path / "set")
    (root / "val2017" / "000000000010.jpg").unlink()
    with pytest.raises(COCODataError, match=r"instances_val2017.json lists 1 image\(s\) missing from .*val2017 "
                                            r"\(id 10: 000000000010.jpg\)"):
        tiny_data(root).setup("validate")


def test_annotation_naming_an_unknown_image_or_category_is_named(coco_root, tmp_path):
    root = copy_set(coco_root, tmp_path / "set")
    edit_annotations(root, "train2017", lambda d: d["annotations"][0].update(category_id=7))
    with pytest.raises(COCODataError, match=r"annotation 1 of image id 1 has category id 7, which is not in the "
                                            r"file's categories \[1, 2, 3\]"):
        tiny_data(root).setup("fit")
    edit_annotations(root, "train2017", lambda d: d["annotations"][0].update(category_id=1, image_id=99))
    with pytest.raises(COCODataError, match="annotation 1 refers to image id 99"):
        tiny_data(root).setup("fit")


def test_an_undecodable_image_is_named_when_loaded(coco_root, tmp_path):
    root = copy_set(coco_root, tmp_path / "set")
    (root / "val2017" / "000000000011.jpg").write_bytes(b"not a jpeg at all")
    data = tiny_data(root)
    data.setup("validate")
    index = [data.val_set.get_data_info(i)["img_id"] for i in range(len(data.val_set))].index(11)
    with pytest.raises(ImageLoadError, match=r"instances_val2017.json: image id 11 \(.*000000000011.jpg\)"):
        data.val_set[index]


def test_check_data_and_check_images_name_every_corrupt_jpeg_of_a_coco_folder(coco_root, tmp_path, capsys):
    from polyattn_lightning.commands import check_data
    from polyattn_lightning.data.base import CorruptImageError
    from polyattn_lightning.errors import DataError

    root = copy_set(coco_root, tmp_path / "set")
    bad = [root / "train2017" / "000000000003.jpg", root / "val2017" / "000000000011.jpg"]
    bad[0].write_bytes(bad[0].read_bytes()[:100])  # truncated
    bad[1].write_bytes(b"not a jpeg at all")
    config = Path(__file__).parents[2] / "configs" / "detection" / "quickstart.yaml"
    with pytest.raises(DataError, match=r"2 of 13 images of COCODataModule cannot be read"):
        check_data.main(["--config", str(config), "--data.root", str(root), "--workers", "2"])
    listing = capsys.readouterr().out
    assert all(f"{path}: " in listing for path in bad)
    with pytest.raises(CorruptImageError, match="2 of 13 images cannot be read") as error:
        tiny_data(root, check_images=True).setup("fit")
    assert all(str(path) in str(error.value) for path in bad)
    tiny_data(coco_root, check_images=True).setup("fit")  # an intact set passes


def test_reading_the_annotations_says_so_once_it_lasts(coco_root, tmp_path, monkeypatch):
    """COCO 2017's annotation files take a while to read and check: each read that lasts says what it reads, in the
    run's log, then how long it took (here the reads are slowed until their first line is out)."""
    import time

    from polyattn_lightning import waits
    from polyattn_lightning.cli.run_log import run_log
    from polyattn_lightning.data import coco

    monkeypatch.setattr(waits, "QUIET_SECONDS", 0.05)
    monkeypatch.setattr(waits, "LOG_SECONDS", 0.05)
    log_file = tmp_path / "run" / "run.log"

    def until_logged(text: str) -> None:
        deadline = time.monotonic() + 120
        while not (log_file.is_file() and text in log_file.read_text()):
            assert time.monotonic() < deadline, f"{text!r} never reached {log_file}"
            time.sleep(0.01)

    read_annotations, checked_class = coco.read_annotations, coco._checked_dataset_class
    checking, loading = "checking the COCO annotations", "loading the COCO annotations"

    def slow_read(ann_file, img_dir):
        until_logged(f"{checking} {ann_file}")
        return read_annotations(ann_file, img_dir)

    def slow_class(dataset_class):
        def make(**kwargs):
            until_logged(f"{loading} {kwargs['ann_file']}")
            return checked_class(dataset_class)(**kwargs)

        return make

    monkeypatch.setattr(coco, "read_annotations", slow_read)
    monkeypatch.setattr(coco, "_checked_dataset_class", slow_class)
    with run_log(log_file.parent):
        data = tiny_data(coco_root)
        data.setup("fit")
    said = log_file.read_text()
    for split in ("train2017", "val2017"):
        ann_file = coco_root / "annotations" / f"instances_{split}.json"
        assert f"{checking} {ann_file} (for " in said and f"{checking} {ann_file}: done in " in said, said
        loads = f"{loading} {ann_file} into mmdet's CocoDataset"
        assert f"{loads} (for " in said and f"{loads}: done in " in said, said
    assert len(data.train_set) == TINY_SET.train_images and len(data.val_set) == TINY_SET.val_images
