"""DataModules (image classification, COCO detection, Long Range Arena); importing this package makes their short
names usable in YAML. ``coco`` imports mmdet only when its data sets are built."""
from .base import CorruptImageError, DataModule, ImageList, read_rgb
from .coco import COCODataModule
from .digits import DigitsDataModule
from .image_folder import ImageFolderDataModule
from .lra import AANDataModule, CIFAR10GrayDataModule, IMDbDataModule, ListOpsDataModule, PathfinderDataModule
from .tiny_imagenet import TinyImageNetDataModule
from .transforms import AugmentRecipe, build_transform

__all__ = [
    "AANDataModule",
    "AugmentRecipe",
    "CIFAR10GrayDataModule",
    "COCODataModule",
    "CorruptImageError",
    "DigitsDataModule",
    "DataModule",
    "ImageFolderDataModule",
    "IMDbDataModule",
    "ImageList",
    "ListOpsDataModule",
    "PathfinderDataModule",
    "TinyImageNetDataModule",
    "build_transform",
    "read_rgb",
]
