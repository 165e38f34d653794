"""Decode every image file of a data set once, in parallel, and list every file that cannot be read.

``polyattn check-data`` and ``--data.check_images true`` (image folders, COCO, LRA Pathfinder) use it on the
files a DataModule's ``image_files()`` names, so a data set with a few bad files among a million costs one
check, not one crashed run per file.
"""

from __future__ import annotations

import contextlib
from concurrent.futures import ProcessPoolExecutor
from typing import Iterable, Sequence

from .. import waits
from .base import CorruptImageError, available_cpus, read_rgb

#: How many unreadable files an error message lists; ``polyattn check-data`` prints them all.
SHOWN_BAD_FILES = 20


def _read_error(path: str) -> str | None:
    try:
        read_rgb(path)
    except CorruptImageError as err:
        return str(err.__cause__ or err)
    return None


def find_unreadable_images(paths: Sequence[str], workers: int | None = None, progress: bool = True) -> dict[str, str]:
    """Every file of ``paths`` that PIL cannot decode (or that is missing), with why, from one pass over all.

    ``workers`` processes (default: the CPUs this process may use) decode the files in parallel;
    ``progress``: a check that lasts says its count, rate and time left (:class:`~polyattn_lightning.waits.Wait`,
    on the terminal and in the run's log).
    """
    workers = workers or available_cpus(cap=None)
    wait = waits.Wait(f"checking {len(paths)} images", total=len(paths), unit="images", after=waits.QUIET_SECONDS)
    with wait if progress else contextlib.nullcontext():

        def counted(results: Iterable[str | None]) -> Iterable[str | None]:
            for result in results:
                wait.add()
                yield result

        if workers == 1 or len(paths) < 2:
            results = counted(map(_read_error, paths))
            return {path: error for path, error in zip(paths, results) if error is not None}
        with ProcessPoolExecutor(workers) as pool:
            chunksize = max(1, min(256, len(paths) // (8 * workers)))
            results = counted(pool.map(_read_error, paths, chunksize=chunksize))
            return {path: error for path, error in zip(paths, results) if error is not None}


def unreadable_message(bad: dict[str, str], total: int) -> str:
    """``N of M images cannot be read:`` and the first :data:`SHOWN_BAD_FILES` files with why."""
    lines = [f"  {path}: {error}" for path, error in list(bad.items())[:SHOWN_BAD_FILES]]
    if len(bad) > SHOWN_BAD_FILES:
        lines.append(f"  ... and {len(bad) - SHOWN_BAD_FILES} more (`polyattn check-data --config ...` lists all)")
    return "\n".join([f"{len(bad)} of {total} images cannot be read:", *lines])


def require_readable(paths: Sequence[str], workers: int | None = None) -> None:
    """A :class:`CorruptImageError` listing the unreadable files of ``paths``, if there are any."""
    bad = find_unreadable_images(list(paths), workers)
    if bad:
        raise CorruptImageError(unreadable_message(bad, len(paths)))
