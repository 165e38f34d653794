"""Long Range Arena DataModules, one module per task format; the batch format is described in :mod:`.base`."""

from .base import PAD_ID, PAD_MULTIPLE, LRADataModule, PadCollate, SequenceBuilder, Sequences, TokenDataset
from .image import CIFAR10GrayDataModule
from .listops import ListOpsDataModule, ListOpsSpec
from .pathfinder import PathfinderDataModule
from .snakes import PathfinderSpec
from .retrieval import AANDataModule
from .text import IMDbDataModule

__all__ = [
    "PAD_ID",
    "PAD_MULTIPLE",
    "AANDataModule",
    "CIFAR10GrayDataModule",
    "IMDbDataModule",
    "LRADataModule",
    "ListOpsDataModule",
    "ListOpsSpec",
    "PadCollate",
    "PathfinderDataModule",
    "PathfinderSpec",
    "SequenceBuilder",
    "Sequences",
    "TokenDataset",
]
