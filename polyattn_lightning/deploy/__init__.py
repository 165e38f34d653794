"""A model where it is deployed: ``torch.export`` (``.pt2``), ONNX, a timm state dict, a Hugging Face
``save_pretrained`` folder (``deploy.formats``), each checked at once against the PyTorch model on the inputs of
its :class:`Source` (``deploy.model``). ``polyattn export`` (:mod:`polyattn_lightning.commands.export`) exports a
run's model with them; ``bench export-support`` and ``bench onnx`` measure them."""

from .formats import (
    FORMATS,
    KIND_FORMATS,
    TOLERANCE,
    dynamic_dims,
    export_program,
    refusal,
    write_checked,
    write_export,
    write_source,
)
from .model import ExportRefused, FirstOutput, Source, hf_source

__all__ = [
    "FORMATS",
    "KIND_FORMATS",
    "TOLERANCE",
    "ExportRefused",
    "FirstOutput",
    "Source",
    "dynamic_dims",
    "export_program",
    "hf_source",
    "refusal",
    "write_checked",
    "write_export",
    "write_source",
]
