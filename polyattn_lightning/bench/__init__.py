"""Benchmarks: ``python -m polyattn_lightning.bench attention``."""

from pathlib import Path

from ..logs import quiet_loggers  # noqa: F401  (the benches' import of it)

#: The project's configs as installed: ``polyattn_lightning/configs`` (in a checkout a link to ``configs/``,
#: in a wheel a copy, shipped as package data), so the benches' defaults need no source tree.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
