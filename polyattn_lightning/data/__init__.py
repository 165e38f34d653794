"""DataModules (image classification, COCO detection, Long Range Arena, text for HF models); importing this package
makes their short
names usable in YAML. ``coco`` imports mmdet only when its data sets are built."""

from .base import CorruptImageError, DataModule, ImageList, read_rgb
from .coco import COCODataModule
from .digits import DigitsDataModule
from .generated_text import GeneratedStoriesData, NegatedSentimentData
from .image_folder import ImageFolderDataModule
from .text import CausalLMText, TextClassificationData
from .lra import AANDataModule, CIFAR10GrayDataModule, IMDbDataModule, ListOpsDataModule, PathfinderDataModule
from .tiny_imagenet import TinyImageNetDataModule
from .transforms import AugmentRecipe, build_transform

__all__ = [
    "AANDataModule",
    "AugmentRecipe",
    "CausalLMText",
    "CIFAR10GrayDataModule",
    "COCODataModule",
    "CorruptImageError",
    "DigitsDataModule",
    "DataModule",
    "GeneratedStoriesData",
    "ImageFolderDataModule",
    "IMDbDataModule",
    "ImageList",
    "ListOpsDataModule",
    "NegatedSentimentData",
    "PathfinderDataModule",
    "TextClassificationData",
    "TinyImageNetDataModule",
    "build_transform",
    "read_rgb",
]
