"""Data sets this project generates on first use (LRA ListOps, the synthetic COCO shapes): where they are
cached, and how a folder is written so that no reader ever sees half of one."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator


def cache_root(*parts: str) -> Path:
    """``$XDG_CACHE_HOME/polyattn_lightning/<parts>`` (``~/.cache/...`` without ``XDG_CACHE_HOME``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser() / "polyattn_lightning" / Path(*parts)


@contextlib.contextmanager
def staged_dir(root: str | Path, replace: bool = False) -> Iterator[Path]:
    """A fresh folder beside ``root`` to write a data set into, moved to ``root`` when the body succeeds.

    An interrupted run leaves nothing at ``root`` that a later run would take for complete. A ``root``
    that exists by then is removed first with ``replace`` (regenerating for other settings); without it,
    a non-empty one is another process's identical copy and is kept.
    """
    root = Path(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        yield staging
        if replace and root.exists():
            shutil.rmtree(root)
        try:
            os.replace(staging, root)
        except OSError:
            if not (root.is_dir() and any(root.iterdir())):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
