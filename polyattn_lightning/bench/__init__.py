"""Benchmarks: ``python -m polyattn_lightning.bench attention``."""

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: The project's configs as installed: ``polyattn_lightning/configs`` (in a checkout a link to ``configs/``,
#: in a wheel a copy, shipped as package data), so the benches' defaults need no source tree.
CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@contextmanager
def quiet_loggers(*names: str, level: int = logging.ERROR) -> Iterator[None]:
    """These loggers at ``level`` meanwhile, and as they were afterwards (a bench called in-process, e.g. by a
    test, must not silence the rest of the process)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        for logger, previous in zip(loggers, levels):
            logger.setLevel(previous)
