"""What a model given to ``polyattn eval`` names, read before anything is built: a ``save_pretrained`` folder of a
causal LM (its tokenizer beside it), or a run's Lightning checkpoint (a ``.ckpt`` file, or a run folder: its
best checkpoint, else its last), of a causal LM or of a vision task.

A checkpoint of a conversion run (a pretrained ``model`` folder converted with ``convert``) names its softmax
teacher: :func:`teacher_of` finds it, for the teacher to stand beside the student in the table.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ..checkpoint import load_checkpoint
from ..cli.config import class_from_path
from ..cli.runs import checkpoint_run_dir, newest_saved_config
from ..errors import ConfigError, MissingPathError

#: The checkpoints a run folder stands for: its best (the newest ``best*.ckpt``), else its last.
RUN_CHECKPOINTS = ("checkpoints/best*.ckpt", "checkpoints/last.ckpt")
#: The task classes whose checkpoints hold a causal LM.
CAUSAL_TASKS = ("HFCausalLM",)


@dataclass
class Source:
    """A model to evaluate: its ``label`` in the table, its ``path`` and what it is: ``folder`` (a saved HF
    model) or ``checkpoint``, and for a checkpoint its task class name and hyperparameters."""

    label: str
    path: Path
    kind: str
    task: str = ""
    hparams: dict[str, Any] | None = None

    @property
    def language(self) -> bool:
        """Whether it is a causal LM (else a vision task, evaluated by ``lightning test``)."""
        return self.kind == "folder" or self.task in CAUSAL_TASKS


def parse(given: str) -> tuple[str | None, Path]:
    """``LABEL=PATH`` or ``PATH`` (label None)."""
    label, sep, path = given.partition("=")
    return (label, Path(path)) if sep and label and "/" not in label else (None, Path(given))


def find(given: str) -> Source:
    """The model ``given`` (``[LABEL=]PATH``) names, checked; its default label is the folder's or run's name."""
    label, path = parse(given)
    if not path.exists():
        raise MissingPathError(f"{path} does not exist: expected a save_pretrained folder, a .ckpt or a run folder")
    if path.is_dir() and (path / "config.json").is_file():
        return Source(label or path.name, path, "folder")
    if path.is_dir():
        found = [
            max(files, key=lambda f: f.stat().st_mtime) for name in RUN_CHECKPOINTS if (files := list(path.glob(name)))
        ]
        if not found:
            raise MissingPathError(
                f"{path} is neither a save_pretrained folder (no config.json) nor a run folder (no "
                f"{' or '.join(RUN_CHECKPOINTS)})"
            )
        label, path = label or path.name, found[0]
    checkpoint = load_checkpoint(path)
    if not isinstance(checkpoint, dict) or "hyper_parameters" not in checkpoint:
        raise ConfigError(f"{path} is not a Lightning checkpoint of a task that saves its hyperparameters")
    hparams = dict(checkpoint["hyper_parameters"])
    task = str(hparams.get("_class_path") or "").rpartition(".")[2]
    if not task:
        raise ConfigError(f"{path}: the checkpoint does not name its task class (no _class_path)")
    return Source(label or checkpoint_run_dir(path).name, path, "checkpoint", task, hparams)


def teacher_of(source: Source) -> Source | None:
    """The softmax teacher a conversion run started from: its pretrained ``model`` folder, where the checkpoint's
    task converted it (``convert`` set) to another attention; None otherwise."""
    hparams = source.hparams or {}
    convert, folder = hparams.get("convert"), hparams.get("model")
    method = getattr(convert, "method", None) or (convert.get("method") if isinstance(convert, dict) else None)
    if not (folder and method and hparams.get("attention") not in (None, "softmax")):
        return None
    from ..models.hf_pretrained import model_folder

    path = model_folder(folder, f"{source.path}: model (the teacher)")
    return Source("teacher", Path(path), "folder")


def run_config(source: Source) -> dict:
    """The saved ``config.yaml`` of the run a checkpoint belongs to (the newest, for a resumed run)."""
    config = newest_saved_config(checkpoint_run_dir(source.path))
    if config is None:
        raise MissingPathError(f"{source.path}: no config.yaml in its run folder {checkpoint_run_dir(source.path)}")
    return yaml.safe_load(config.read_text()) or {}


def tokenizer_folder(source: Source) -> str:
    """Where a causal LM's tokenizer is: its folder, or the tokenizer of its run's data (the saved config's data
    module, built from its arguments: a generated set writes its tokenizer on first use)."""
    if source.kind == "folder":
        return str(source.path)
    data = run_config(source).get("data") or {}
    cls = class_from_path(data.get("class_path"))
    if cls is None:
        raise ConfigError(f"{source.path}: its run's config names no data class to take the tokenizer from")
    module = cls(**(data.get("init_args") or {}))
    module.prepare_data()
    return str(module.tokenizer_path)
