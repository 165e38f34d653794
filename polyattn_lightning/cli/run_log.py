"""The run's text log, ``<run folder>/run.log``: what the terminal said, with times, kept beside the run's other files.

It receives Lightning's info lines and warnings (the ``lightning.pytorch`` and ``lightning.fabric`` loggers: the
run's folder, the standard callbacks' decisions, the model summary, the end-of-fit table) and the project's own
(the ``polyattn_lightning`` loggers: the long waits of :mod:`polyattn_lightning.waits`, the training progress lines
of :class:`~polyattn_lightning.callbacks.progress_lines.ProgressLines`, the attention switch's report). Rank 0 writes
it; a resumed run, which goes on in its run's folder, appends to it; ``validate``/``test``/``predict`` of a
checkpoint write one in their own evaluation folder. Python warnings and tracebacks stay on stderr only.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path
from typing import Iterable, Iterator

#: The log file's name in the run folder.
RUN_LOG = "run.log"
#: The loggers whose records the file receives.
LOGGERS = ("lightning.pytorch", "lightning.fabric", "polyattn_lightning")
#: One record per line: its time, level and text.
FORMAT = "%(asctime)s %(levelname)s %(message)s"


@contextlib.contextmanager
def _attached(handler: logging.Handler) -> Iterator[None]:
    """Meanwhile, ``handler`` receives :data:`LOGGERS`' records of level INFO and above; the loggers are set to INFO
    where nothing set their level, and back afterwards."""
    handler.setLevel(logging.INFO)
    loggers = [logging.getLogger(name) for name in LOGGERS]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:
            logger.setLevel(logging.INFO)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.removeHandler(handler)
            logger.setLevel(level)
        handler.close()


class _Keeper(logging.Handler):
    """Keeps the records it receives, in order."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextlib.contextmanager
def kept_for_run_log() -> Iterator[list[logging.LogRecord]]:
    """Meanwhile, :data:`LOGGERS`' records of level INFO and above are kept in the yielded list, for
    :func:`run_log`'s ``earlier``: the CLI builds the model and data module (a build, a conversion or a kernel
    compilation that says what it does) before the trainer knows the run's folder."""
    keeper = _Keeper()
    with _attached(keeper):
        yield keeper.records


@contextlib.contextmanager
def run_log(log_dir: Path | None, earlier: Iterable[logging.LogRecord] = ()) -> Iterator[Path | None]:
    """Meanwhile, :data:`LOGGERS`' records of level INFO and above are appended to ``log_dir/run.log`` (the folder is
    created; ``None``, as on ranks other than 0: nothing), after the ``earlier`` records (:func:`kept_for_run_log`),
    each with its own time."""
    if log_dir is None:
        yield None
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_dir / RUN_LOG, mode="a", encoding="utf-8")
    handler.setFormatter(logging.Formatter(FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    for record in earlier:
        handler.handle(record)
    with _attached(handler):
        yield log_dir / RUN_LOG
