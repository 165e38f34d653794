"""DataModules: real JPEG layouts on disk, the built-in digits, and clear errors for bad data."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from PIL import Image

from polyattn_lightning.data import CorruptImageError, DigitsDataModule, ImageFolderDataModule, TinyImageNetDataModule


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
