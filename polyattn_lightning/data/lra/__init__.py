"""Long Range Arena DataModules, one module per task format; batches are described in :mod:`.base`."""
from .base import PAD_ID, PAD_MULTIPLE, LRADataModule, PadCollate, Sequences, TokenDataset
from .listops import ListOpsDataModule, ListOpsSpec

__all__ = [
    "PAD_ID",
    "PAD_MULTIPLE",
    "LRADataModule",
    "ListOpsDataModule",
    "ListOpsSpec",
    "PadCollate",
    "Sequences",
    "TokenDataset",
]
