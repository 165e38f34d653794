"""Logging for commands that run many fits or models in one process: quieter meanwhile, as it was afterwards."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager


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
