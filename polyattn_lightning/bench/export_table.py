"""The ``exports`` column of the timm and Hugging Face support tables: which ``polyattn export`` formats work per
row, read from :data:`EXPORT_SUPPORT` (written by ``python -m polyattn_lightning.bench export-support``, which
measures them by exporting each row's tiny model), never typed by hand."""

from __future__ import annotations

import functools
import json
from pathlib import Path

#: The measured formats: ``{"timm": {model: entry}, "hf": {family: entry}}``, an entry
#: ``{"formats": [...], "refused": {format: reason}}``.
EXPORT_SUPPORT = Path(__file__).resolve().parents[2] / "docs" / "export-support.json"
#: The cell of a row the file does not hold.
NOT_MEASURED = "not measured"


@functools.cache
def export_support(path: Path = EXPORT_SUPPORT) -> dict:
    """The measured file (empty where there is none: a wheel ships no docs/)."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def export_cell(kind: str, row: str, path: Path = EXPORT_SUPPORT) -> str:
    """The formats that work for ``row`` (``kind``: ``timm`` or ``hf``), then each one that does not with its
    reason; :data:`NOT_MEASURED` where the file does not hold the row."""
    entry = export_support(path).get(kind, {}).get(row)
    if entry is None:
        return NOT_MEASURED
    works = ", ".join(entry["formats"]) or "none"
    refused = "<br>".join(f"not {fmt}: {reason}" for fmt, reason in entry.get("refused", {}).items())
    return (works + (f"<br>{refused}" if refused else "")).replace("|", "/")


__all__ = ["EXPORT_SUPPORT", "NOT_MEASURED", "export_cell", "export_support"]
