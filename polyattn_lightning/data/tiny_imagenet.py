"""Tiny-ImageNet (200 classes, 64x64) in the layout its zip file unpacks to."""

from __future__ import annotations

from pathlib import Path

from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from ..errors import DataError, MissingPathError
from .base import available_cpus, require_dir
from .image_folder import ImageFolderDataModule, Samples
from .transforms import AugmentRecipe


class TinyImageNetDataModule(ImageFolderDataModule):
    """Tiny-ImageNet: train images per wnid folder, val labels in ``val_annotations.txt``.

    Classes are the sorted wnids, the order ImageFolder would give. The official
    test split has no labels, so validation doubles as the test split.
    """

    layout = (
        "<root>/wnids.txt (one wnid per line), <root>/train/<wnid>/images/*.JPEG, "
        "<root>/val/images/*.JPEG and <root>/val/val_annotations.txt (<file>\\t<wnid>\\t...)"
    )

    def __init__(
        self,
        root: str,
        img_size: int = 64,
        augment: AugmentRecipe = AugmentRecipe(),
        batch_size: int = 128,
        num_workers: int = available_cpus(),
        pin_memory: bool = True,
        check_images: bool = False,
        predict_root: str | None = None,
    ):
        """
        Args:
            root: the ``tiny-imagenet-200`` folder as unzipped (wnids.txt, train/, val/); relative paths are taken
                from the working directory.
            img_size: side of the square crops (64, the images' size); must equal the model's ``img_size``.
            augment: training augmentation: DeiT's ImageNet policy by default, the recipe of this project's
                Tiny-ImageNet runs (``configs/classification/recipes/tiny_imagenet.yaml``), whatever the split's size.
            batch_size: per-device batch size (the task scales the learning rate by the global batch).
            num_workers: loader worker processes per device, which decode the images.
            pin_memory: page-locked host memory for faster host-to-GPU copies (ignored without a CUDA device).
            check_images: decode every image once before training and list all unreadable files.
            predict_root: ``predict`` reads every image under this folder (no labels) instead of the val split.
        """
        super().__init__(root, img_size, augment, batch_size, num_workers, pin_memory, check_images, predict_root)

    def find_samples(self, root: Path) -> tuple[list[str], Samples, Samples]:
        wnids_file = root / "wnids.txt"
        annotations = root / "val" / "val_annotations.txt"
        for required in (wnids_file, annotations):
            if not required.is_file():
                raise MissingPathError(f"missing {required}; expected layout:\n{self.layout}")
        classes = sorted(wnids_file.read_text().split())
        class_to_idx = {wnid: i for i, wnid in enumerate(classes)}
        try:
            train = make_dataset(require_dir(root / "train", self.layout), class_to_idx, extensions=IMG_EXTENSIONS)
        except FileNotFoundError as err:
            raise MissingPathError(f"{root}: {err}; expected layout:\n{self.layout}") from None
        val = []
        for line_no, line in enumerate(annotations.read_text().splitlines(), 1):
            fields = line.split()  # tab-separated in the official file; other whitespace is taken too
            if not fields:
                continue
            if len(fields) < 2:
                raise DataError(f"{annotations}:{line_no}: expected '<file>\\t<wnid>\\t...', got {line!r}")
            name, wnid = fields[:2]
            if wnid not in class_to_idx:
                raise DataError(f"{annotations}:{line_no}: wnid {wnid!r} is not in {wnids_file}")
            val.append((str(root / "val" / "images" / name), class_to_idx[wnid]))
        if not val:
            raise MissingPathError(f"{annotations} lists no images; expected layout:\n{self.layout}")
        return classes, train, val
