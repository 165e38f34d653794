"""The folder an HF task exports its model to: what it holds (:func:`write_export`), what marks an export
(:data:`EXPORT_MARKER`) and which folders an export may write (:func:`check_export_dir`: nothing the user had is
overwritten)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import ConfigError
from ..sharding import plain_class

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


__all__ = ["EXPORT_MARKER", "check_export_dir", "write_export"]


def write_export(model, state: dict, folder: Path, tokenizer, run_dir: Path | None, step: int | None) -> str:
    """``save_pretrained`` of ``model`` with the weights ``state`` (its config names the activation), the
    ``tokenizer`` (None: none), :data:`EXPORT_MARKER` naming ``run_dir`` and the global ``step``, and where the
    model allows it the code that loads it with ``trust_remote_code``
    (:func:`~..attention.switch.hf.saved.remote_code.write_remote_code`); returns how the folder loads, for the line
    the export says."""
    from ..attention.switch.hf.saved import remote_code  # imports transformers, as the model did

    model.save_pretrained(folder, state_dict=state)
    architecture = plain_class(model).__name__
    if model.config.architectures != [architecture]:  # FSDP2's subclass (FSDPLlamaForCausalLM)
        model.config.architectures = [architecture]
        model.config.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    marker = {"run_dir": str(run_dir.resolve()) if run_dir is not None else None, "global_step": step}
    (folder / EXPORT_MARKER).write_text(json.dumps(marker, indent=1) + "\n")
    loads = "with polyattn_lightning.attention.switch.hf.load_pretrained"
    if remote_code.remote_code_refusal(model) is None:
        remote_code.write_remote_code(model, folder)
        loads += ", or with trust_remote_code=True where the project is not installed"
    return loads
