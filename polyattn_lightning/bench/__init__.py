"""Benchmarks: ``python -m polyattn_lightning.bench attention``."""

import argparse
from pathlib import Path

from ..logs import quiet_loggers  # noqa: F401  (the benches' import of it)

#: The project's configs as installed: ``polyattn_lightning/configs`` (in a checkout a link to ``configs/``,
#: in a wheel a copy, shipped as package data), so the benches' defaults need no source tree.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def chosen_parts(parser: argparse.ArgumentParser, value: str, known) -> list[str]:
    """The benchmark's ``--parts`` comma list, each checked against ``known`` (an unknown one is the parser's
    usage error, naming what is expected)."""
    parts = value.split(",")
    unknown = set(parts) - set(known)
    if unknown:
        parser.error(f"--parts: unknown {sorted(unknown)}; expected a comma list of {', '.join(known)}")
    return parts
