"""Checkpoint files that are safe to load and never half-written.

:class:`SafeCheckpointIO` is the trainer's ``CheckpointIO`` plugin (see
``configs/classification/trainer/``); :func:`load_checkpoint` is the same loading for any
other file, e.g. weights passed to a task by path.

Loading uses ``torch.load(weights_only=True)``: a checkpoint from the internet
can hold tensors, containers and plain values but cannot run code. A project
class that hyperparameters may hold (a recipe dataclass) must be declared with
:func:`checkpoint_safe`. A truncated, corrupt or refused file raises
:class:`CheckpointLoadError` naming the file.

Saving a local file writes a temporary file next to the target, fsyncs it and
renames it over the target (``os.replace`` is atomic), then fsyncs the folder:
a crash at any moment leaves the previous file or the new one, never a torn
one. Lightning's own ``_atomic_save`` relies on an fsspec transaction and does
not fsync; remote (``s3://``...) paths still go through it.
"""

from __future__ import annotations

import os
import pickle
import uuid
import zipfile
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .errors import MissingPathError, UserInputError

_ZIP_MAGIC = b"PK\x03\x04"  # torch.save's format since PyTorch 1.6
T = TypeVar("T", bound=type)


class CheckpointLoadError(UserInputError, RuntimeError):
    """A checkpoint file that cannot be loaded; the message names the file and says why."""


def checkpoint_safe(cls: T) -> T:
    """Class decorator: allow ``cls`` (e.g. a hyperparameter dataclass) inside ``weights_only`` checkpoints."""
    torch.serialization.add_safe_globals([cls])
    return cls


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu", weights_only: bool = True) -> Any:
    """``torch.load`` a local file, turning every way it can be bad into a :class:`CheckpointLoadError`.

    ``weights_only=False`` runs arbitrary code from the file: pass it only for a file you made yourself.
    """
    path = Path(path)
    if not path.is_file():
        raise MissingPathError(f"checkpoint file {path} not found")
    if path.stat().st_size == 0:
        raise CheckpointLoadError(f"checkpoint {path} is truncated or corrupt (empty file)")
    is_zip = _verify_zip_records(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=weights_only)
    except Exception as err:
        if not is_zip:
            message = f"checkpoint {path} is truncated or corrupt, or not a PyTorch checkpoint"
        elif isinstance(err, pickle.UnpicklingError):
            message = (
                f"checkpoint {path} was refused by weights_only loading: it holds objects other than tensors and "
                "plain values (a project class needs @checkpoint_safe; load a file you do not trust only as weights)"
            )
        else:
            message = f"cannot load checkpoint {path}"
        raise CheckpointLoadError(f"{message} ({describe_error(err)})") from err


def describe_error(err: Exception) -> str:
    """The exception's type and what torch's long messages come down to: their last line but the doc link."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    last = next((line for line in reversed(lines) if not line.startswith("Check the documentation")), "")
    return f"{type(err).__name__}: {last}"


def _verify_zip_records(path: Path) -> bool:
    """Whether ``path`` is a zip checkpoint (torch.save's format), after checking every record's CRC32.

    ``torch.load`` checks no CRC: a flipped byte inside a tensor would load silently.
    """
    with open(path, "rb") as f:
        if f.read(len(_ZIP_MAGIC)) != _ZIP_MAGIC:
            return False  # legacy format or not a checkpoint at all: torch.load tells which
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, EOFError, OSError) as err:
        raise CheckpointLoadError(f"checkpoint {path} is truncated or corrupt ({err})") from err
    if bad is not None:
        raise CheckpointLoadError(f"checkpoint {path} is corrupt: record {bad!r} fails its CRC check")
    return True


def is_complete_checkpoint(path: str | os.PathLike) -> bool:
    """Whether the file ``path`` is a whole checkpoint: a zip checkpoint whose records all pass their CRC check (a
    file cut short fails it), or a file of another format that is not empty (``torch.load`` tells the rest)."""
    path = Path(path)
    try:
        if path.stat().st_size == 0:
            return False
        _verify_zip_records(path)  # raises for a zip cut short or corrupt
    except (CheckpointLoadError, OSError):
        return False
    return True


def atomic_save(obj: Any, path: str | os.PathLike, on_written: Callable[[Path], None] | None = None) -> None:
    """``torch.save`` to ``path`` so that ``path`` always holds either its old or its new complete content.

    ``on_written(path)`` runs when the temporary file is written and synced, before it replaces ``path``."""
    atomic_write(path, lambda file: torch.save(obj, file), on_written)


def atomic_write(
    path: str | os.PathLike, write: Callable[[Any], None], on_written: Callable[[Path], None] | None = None
) -> None:
    """``write(file)`` into a temporary binary file beside ``path``, synced, then renamed over ``path``: a reader (or
    a crash) finds the old complete content or the new, never a torn file. ``on_written`` as in :func:`atomic_save`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")  # same folder: os.replace cannot cross devices
    try:
        with open(tmp, "xb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        if on_written is not None:
            on_written(path)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    folder = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(folder)  # makes the rename itself survive a power loss
    finally:
        os.close(folder)


def _local_path(path: str | os.PathLike) -> str | None:
    fs, local = url_to_fs(str(path))
    return local if isinstance(fs, LocalFileSystem) else None


class SafeCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` with atomic, fsynced local writes and ``weights_only`` loading.

    ``Trainer.fit(ckpt_path=..., weights_only=False)`` still loads a trusted file the unsafe way.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        local = _local_path(path)
        if local is None or storage_options is not None:
            return super().save_checkpoint(checkpoint, path, storage_options)
        atomic_save(checkpoint, local, self.on_written)

    def on_written(self, path: Path) -> None:
        """Called between writing a local checkpoint and renaming it over ``path``: a hook for tests that
        interrupt a write (a signal, a kill); nothing by default."""

    def load_checkpoint(self, path, map_location: Any = "cpu", weights_only: bool | None = None) -> dict[str, Any]:
        local = _local_path(path)
        if local is None:
            return super().load_checkpoint(path, map_location, weights_only=weights_only is not False)
        return load_checkpoint(local, map_location, weights_only=weights_only is not False)
