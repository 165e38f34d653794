"""The folder an HF task exports its model to: what marks an export (:data:`EXPORT_MARKER`) and which folders an
export may write (:func:`check_export_dir`: nothing the user had is overwritten)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError

#: The file an export writes beside the model: ``{"run_dir": the run folder that wrote it (None: no run folder),
#: "global_step": ...}``.
EXPORT_MARKER = "polyattn_export.json"


def check_export_dir(folder: Path, run_dir: Path | None, option: str = "model.init_args.export_dir") -> None:
    """Refuse, in one line naming ``option``, an export folder that holds anything but the export of ``run_dir``
    (this run's folder; None: there is none): files without :data:`EXPORT_MARKER`, or the export of another run
    folder. A new or empty folder is always fine."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    key = f"{option} {folder}"
    try:
        writer = json.loads((folder / EXPORT_MARKER).read_text())["run_dir"]
    except (OSError, ValueError, KeyError, TypeError):
        names = sorted(path.name for path in folder.iterdir())
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(
            f"{key} already holds files this run did not write ({shown}); give a new or empty folder, or move them "
            "away (the export would overwrite them)"
        ) from None
    if run_dir is not None and writer == str(run_dir.resolve()):
        return  # this run folder's own export: a resumed run rewrites it
    if writer is None:
        raise ConfigError(
            f"{key} holds an export written outside any run folder (polyattn consolidate, or a run without a "
            "logger); give a new or empty folder, or move it away"
        )
    raise ConfigError(
        f"{key} holds the export of the run in {writer}; give a new or empty folder, or resume that run in its own "
        f"folder (fit --ckpt_path {Path(writer) / 'checkpoints' / 'last.ckpt'}), which rewrites its own export"
    )


__all__ = ["EXPORT_MARKER", "check_export_dir"]
