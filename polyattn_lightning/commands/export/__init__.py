"""``polyattn export``: a run's model, or a saved switched Hugging Face folder, where it is deployed (:mod:`.command`),
in the formats of :mod:`.formats`, from the model and inputs of :mod:`.source`."""

from .command import TOLERANCE, export_checkpoint, main, parser
from .formats import FORMATS, export_program, write_export
from .source import ExportRefused, exportable

__all__ = [
    "FORMATS",
    "TOLERANCE",
    "ExportRefused",
    "export_checkpoint",
    "export_program",
    "exportable",
    "main",
    "parser",
    "write_export",
]
