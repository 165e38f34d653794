"""DataModules: real JPEG layouts on disk, the built-in digits, and clear errors for bad data."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image
from timm.data.auto_augment import RandAugment
from timm.data.random_erasing import RandomErasing
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision import transforms

from training_helpers import QUICKSTART

from polyattn_lightning import cli
from polyattn_lightning.data import (
    AugmentRecipe,
    CorruptImageError,
    DigitsDataModule,
    ImageFolderDataModule,
    TinyImageNetDataModule,
)
from polyattn_lightning.data.transforms import recipe_for

#: the ``data:`` block an image-folder run saved in its config.yaml before the augmentation was chosen by the data
#: (main's code at 829df6e, ``fit --config configs/classification/quickstart.yaml --data ImageFolderDataModule``)
OLD_RUN_DATA = """
class_path: polyattn_lightning.data.ImageFolderDataModule
init_args:
  root: ROOT
  img_size: 16
  augment:
    auto_augment: rand-m9-mstd0.5-inc1
    re_prob: 0.25
    re_mode: pixel
    color_jitter: 0.3
    interpolation: bicubic
    scale:
    - 0.08
    - 1.0
    hflip: 0.5
    crop_pct: 0.875
    mean:
    - 0.485
    - 0.456
    - 0.406
    std:
    - 0.229
    - 0.224
    - 0.225
  batch_size: 4
  num_workers: 0
  pin_memory: true
  check_images: false
  predict_root: null
"""


@pytest.fixture
def info_lines(caplog):
    """The info lines Lightning's loggers write (they do not propagate to the root logger caplog listens on)."""
    logger = logging.getLogger("lightning.pytorch")
    logger.addHandler(caplog.handler)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
        yield caplog
    logger.removeHandler(caplog.handler)


def training_steps(datamodule) -> dict[type, object]:
    """The training transform's steps by their type."""
    return {type(step): step for step in datamodule.train_set.transform.transforms}


def test_digits_split_is_fixed_and_stratified():
    first, second = DigitsDataModule(img_size=16), DigitsDataModule(img_size=16)
    first.setup("fit"), second.setup("fit")
    images, labels = first.val_set.tensors
    assert images.shape == (360, 3, 16, 16) and len(first.train_set) == 1437
    assert torch.equal(labels, second.val_set.tensors[1])
    assert labels.bincount().min() >= 35  # every digit is in the validation split


def test_image_folder_reads_classes_from_train_folders(image_folder: Path):
    datamodule = ImageFolderDataModule(str(image_folder), img_size=32, batch_size=4, num_workers=0)
    datamodule.setup("fit")
    assert datamodule.num_classes == 3
    assert (len(datamodule.train_set), len(datamodule.val_set)) == (12, 6)
    image, label = datamodule.val_set[5]
    assert image.shape == (3, 32, 32) and label == 2


def majority(dataset) -> tuple[int, float]:
    """The most frequent label of a data set and its share, counted sample by sample (each one loaded)."""
    label, count = Counter(int(dataset[i][1]) for i in range(len(dataset))).most_common(1)[0]
    return label, count / len(dataset)


def test_the_chance_rate_is_the_validation_splits_majority_class(image_folder: Path):
    for extra in range(3):  # three more validation images of class 1: 5 of the 9
        path = image_folder / "val" / sorted(p.name for p in (image_folder / "val").iterdir())[1] / f"extra{extra}.png"
        Image.new("RGB", (8, 8)).save(path)
    folder = ImageFolderDataModule(str(image_folder), img_size=32, batch_size=4, num_workers=0)
    digits = DigitsDataModule(img_size=8)
    for datamodule, noun in ((folder, "images"), (digits, "images")):
        datamodule.setup("fit")
        chance = datamodule.chance_rate()
        n = len(datamodule.val_set)
        assert (chance.label, chance.rate) == majority(datamodule.val_set)
        assert chance.samples == n and chance.source == f"majority class of {n} validation {noun}"
        assert chance.standard_error() == pytest.approx((chance.rate * (1 - chance.rate) / n) ** 0.5)
        # no test split: the test metrics are the validation split's
        assert datamodule.chance_rate("test").source == f"majority class of {n} validation {noun}"
    assert folder.chance_rate().rate == 5 / 9  # 2 + 3 of the 9 images


def test_tiny_imagenet_labels_follow_sorted_wnids(tiny_imagenet: Path):
    datamodule = TinyImageNetDataModule(str(tiny_imagenet), batch_size=4, num_workers=0)
    datamodule.setup("fit")
    assert datamodule.num_classes == 3
    assert sorted({label for _, label in datamodule.train_set.samples}) == [0, 1, 2]
    for path, label in datamodule.train_set.samples + datamodule.val_set.samples:
        assert Path(path).exists()
    # val_0/1 belong to the first sorted wnid per val_annotations.txt
    assert [label for _, label in datamodule.val_set.samples[:2]] == [0, 0]
    assert datamodule.train_set[0][0].shape == (3, 64, 64)


@pytest.mark.parametrize("datamodule_class", [ImageFolderDataModule, TinyImageNetDataModule])
def test_missing_data_path_names_path_and_layout(tmp_path: Path, datamodule_class):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match=rf"(?s){missing}.*does not exist.*expected layout"):
        datamodule_class(str(missing)).setup("fit")


def test_empty_data_path_names_path_and_layout(tmp_path: Path):
    with pytest.raises(FileNotFoundError, match=rf"(?s){tmp_path}.*is empty.*expected layout.*train/<class>"):
        ImageFolderDataModule(str(tmp_path)).setup("fit")


def test_class_folder_without_images_is_an_error(image_folder: Path):
    emptied = sorted((image_folder / "train").iterdir())[1]
    for image in emptied.iterdir():
        image.unlink()
    with pytest.raises(FileNotFoundError, match=rf"(?s){image_folder}.*{emptied.name}.*expected layout"):
        ImageFolderDataModule(str(image_folder)).setup("fit")


def test_tiny_imagenet_without_wnids_names_the_file(tiny_imagenet: Path):
    (tiny_imagenet / "wnids.txt").unlink()
    with pytest.raises(FileNotFoundError, match=rf"missing {tiny_imagenet / 'wnids.txt'}"):
        TinyImageNetDataModule(str(tiny_imagenet)).setup("fit")


def test_tiny_imagenet_malformed_annotation_line_is_named(tiny_imagenet: Path):
    annotations = tiny_imagenet / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text() + "val_99.JPEG\n")
    lines = len(annotations.read_text().splitlines())
    with pytest.raises(ValueError, match=rf"{annotations}:{lines}: expected .*'val_99.JPEG'"):
        TinyImageNetDataModule(str(tiny_imagenet)).setup("fit")


def test_tiny_imagenet_annotations_separated_by_spaces_are_read(tiny_imagenet: Path):
    annotations = tiny_imagenet / "val" / "val_annotations.txt"
    annotations.write_text(annotations.read_text().replace("\t", " "))
    data = TinyImageNetDataModule(str(tiny_imagenet))
    data.setup("fit")
    assert len(data.val_set) == 2 * data.num_classes


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_jpeg_error_names_the_file_through_a_worker(image_folder: Path, damage: str):
    victim = sorted((image_folder / "train").rglob("*.JPEG"))[0]
    data = victim.read_bytes()
    victim.write_bytes(b"not a jpeg" * 10 if damage == "garbage" else data[: len(data) // 2])
    datamodule = ImageFolderDataModule(str(image_folder), img_size=16, batch_size=12, num_workers=1, pin_memory=False)
    datamodule.setup("fit")
    with pytest.raises(CorruptImageError, match=str(victim)):
        next(iter(datamodule.train_dataloader()))


@pytest.mark.parametrize(
    "images, size, deit",
    [(45, 16, False), (9_999, 224, False), (50_000, 32, False), (10_000, 64, True), (1_281_167, 224, True)],
)
def test_deits_policy_is_the_default_only_for_large_sets_of_large_images(images, size, deit):
    recipe, why = recipe_for(images, size)
    assert recipe == (AugmentRecipe() if deit else AugmentRecipe.light())
    assert f"{images} training images at {size} px" in why


def test_a_small_image_folder_is_augmented_lightly_and_says_so(image_folder: Path, info_lines):
    datamodule = ImageFolderDataModule(str(image_folder), img_size=16, batch_size=4, num_workers=0)
    datamodule.setup("fit")
    steps = training_steps(datamodule)
    assert RandAugment not in steps and RandomErasing not in steps and transforms.ColorJitter not in steps
    assert steps[RandomResizedCropAndInterpolation].scale == (0.5, 1.0)
    assert steps[transforms.RandomHorizontalFlip].p == 0.5
    line = [record.getMessage() for record in info_lines.records if "augmentation" in record.getMessage()]
    assert line == [
        "ImageFolderDataModule: training augmentation light (flips, crops of 50-100% of the image; no RandAugment, "
        "colour jitter or random erasing): 12 training images at 16 px; DeiT's policy is the default from 10000 "
        "images at 64 px up, the light one below"
    ]
    image, _ = datamodule.train_set[0]
    assert image.shape == (3, 16, 16)


def test_tiny_imagenet_keeps_deits_policy_whatever_its_size(tiny_imagenet: Path, info_lines):
    datamodule = TinyImageNetDataModule(str(tiny_imagenet), batch_size=4, num_workers=0)
    datamodule.setup("fit")
    assert datamodule.recipe == AugmentRecipe()
    steps = training_steps(datamodule)
    assert steps[RandomErasing].probability == 0.25 and steps[RandomResizedCropAndInterpolation].scale == (0.08, 1.0)
    assert (steps[RandAugment].num_layers, steps[RandAugment].ops[0].magnitude) == (2, 9)
    assert "training augmentation DeiT's ImageNet policy (RandAugment m9" in info_lines.text


def test_an_old_runs_saved_augmentation_means_what_it_meant(image_folder: Path, tmp_path: Path, info_lines):
    old = tmp_path / "old_data.yaml"
    old.write_text(OLD_RUN_DATA.replace("ROOT", str(image_folder)))
    run = cli.make_cli(["--config", str(QUICKSTART), "--data", str(old)], run=False)
    run.datamodule.setup("fit")
    assert run.datamodule.recipe == AugmentRecipe()
    assert RandomErasing in training_steps(run.datamodule)
    assert "DeiT's ImageNet policy (RandAugment m9, random erasing 0.25, crops of 8-100%, flips): as given" in (
        info_lines.text
    )
    partial = AugmentRecipe(auto_augment=None, hflip=0.0)
    assert partial.describe() == "DeiT's ImageNet policy with auto_augment=None, hflip=0.0"


def test_the_imagenet_configs_ask_for_deits_policy():
    root = Path(__file__).resolve().parents[2] / "configs" / "classification" / "data"
    for name in ("imagenet.yaml", "tiny_imagenet.yaml"):
        given = yaml.safe_load((root / name).read_text())["init_args"]["augment"]
        recipe = AugmentRecipe(
            **{key: tuple(value) if isinstance(value, list) else value for key, value in given.items()}
        )
        assert recipe == AugmentRecipe(crop_pct=recipe.crop_pct), name
