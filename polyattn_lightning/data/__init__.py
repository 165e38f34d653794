"""DataModules (image classification, Long Range Arena); importing this package makes their short names usable in YAML."""
from .base import CorruptImageError, ImageDataModule, ImageList, read_rgb
from .digits import DigitsDataModule
from .image_folder import ImageFolderDataModule
from .lra import ListOpsDataModule
from .tiny_imagenet import TinyImageNetDataModule
from .transforms import AugmentRecipe, build_transform

__all__ = [
    "AugmentRecipe",
    "CorruptImageError",
    "DigitsDataModule",
    "ImageDataModule",
    "ImageFolderDataModule",
    "ImageList",
    "ListOpsDataModule",
    "TinyImageNetDataModule",
    "build_transform",
    "read_rgb",
]
