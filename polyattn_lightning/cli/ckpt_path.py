"""What ``--ckpt_path`` names, probed before any model is built: a Lightning checkpoint file (not a weight file), a
sharded checkpoint folder, or, for ``validate``/``test``/``predict`` given no config, a run whose saved config is
used; and what goes wrong reading its saved hyperparameters, said with the file's name. A checkpoint that does not
exist is named with the checkpoints that do, nearby (:func:`missing_checkpoint`).

LightningCLI reads a checkpoint's hyperparameters with a bare ``torch.load`` and replaces the config's model
arguments with them; its errors do not name the file, and a folder or a missing file is silently passed over.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ..checkpoint import CheckpointLoadError, load_checkpoint
from ..errors import ConfigError, MissingPathError
from ..sharding.checkpoints import check_sharded_folder
from .config import init_args
from .runs import EVALUATION_VERBS, RUNS_DIR, checkpoint_run_dir, names_a_path, saved_configs

#: How many checkpoint files the error for a missing ``--ckpt_path`` lists.
SHOWN_CHECKPOINTS = 10
#: How many folders it searches at most for them (a path far off the mark can name a large tree).
SEARCHED_FOLDERS = 2000


def is_lightning_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a dict with a ``state_dict`` (memory-mapped: no tensor is read); True when that cannot
    be told this way (a legacy-format or damaged file: the safe load that follows names what is wrong)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return True
    return isinstance(checkpoint, dict) and "state_dict" in checkpoint


def checkpoints_near(ckpt_path: str) -> tuple[Path, list[Path]] | None:
    """The folder searched for the checkpoints a missing ``ckpt_path`` may have meant, and the ``*.ckpt`` files
    in it (any depth, sorted; at most :data:`SEARCHED_FOLDERS` folders): the nearest folder above the path that
    exists, or ``runs/`` where that is the working directory or a folder above it (None: no ``runs/`` here)."""
    here = Path.cwd().resolve()
    folder = Path(ckpt_path).expanduser().resolve().parent
    while not folder.is_dir():
        folder = folder.parent
    if folder == here or folder in here.parents:
        folder = here / RUNS_DIR
        if not folder.is_dir():
            return None
    found = []
    for count, (parent, children, files) in enumerate(os.walk(folder)):
        if count == SEARCHED_FOLDERS:
            break
        children.sort()
        found += [Path(parent, name) for name in sorted(files) if name.endswith(".ckpt")]
    return folder, found


def missing_checkpoint(ckpt_path: str) -> MissingPathError:
    """``--ckpt_path X: no such checkpoint file or sharded folder``, with the checkpoint files near it
    (:func:`checkpoints_near`, the first :data:`SHOWN_CHECKPOINTS`), or that there is none."""
    message = f"--ckpt_path {ckpt_path}: no such checkpoint file or sharded folder"
    near = checkpoints_near(ckpt_path)
    if near is None:
        return MissingPathError(message)
    here = Path.cwd().resolve()

    def shown(path: Path) -> str:
        return str(path.relative_to(here)) if path.is_relative_to(here) else str(path)

    folder, found = near
    if not found:
        return MissingPathError(f"{message}; there is no checkpoint (*.ckpt) under {shown(folder)}")
    lines = [f"  {shown(path)}" for path in found[:SHOWN_CHECKPOINTS]]
    if len(found) > SHOWN_CHECKPOINTS:
        lines.append(f"  ... and {len(found) - SHOWN_CHECKPOINTS} more")
    return MissingPathError("\n".join([f"{message}; the checkpoints under {shown(folder)}:", *lines]))


def sharded_folder(ckpt_path: str) -> Path | None:
    """The sharded checkpoint folder ``ckpt_path`` names, or None for a file or a name Lightning resolves (``last``,
    a URL). A local path that does not exist, a folder that is not a sharded checkpoint or a file that is not a
    Lightning checkpoint (a weight file) stops the run here."""
    if names_a_path(ckpt_path):
        if Path(ckpt_path).is_dir():
            return check_sharded_folder(ckpt_path)
        if not Path(ckpt_path).is_file():
            raise missing_checkpoint(ckpt_path)
    if Path(ckpt_path).is_file() and not is_lightning_checkpoint(ckpt_path):
        raise CheckpointLoadError(
            f"--ckpt_path {ckpt_path} is not a Lightning checkpoint (it has no 'state_dict'): "
            "to start from a weight file, pass it as --model.pretrained instead"
        )
    return None


@contextlib.contextmanager
def load_errors_named(ckpt_path: str) -> Iterator[None]:
    """When reading ``ckpt_path`` fails meanwhile (Lightning's bare ``torch.load``: ``OSError: [Errno 22] Invalid
    argument`` for a truncated file), load the file the safe way, which raises a :class:`CheckpointLoadError`
    naming it and why."""
    try:
        yield
    except Exception:
        if not Path(ckpt_path).is_file():
            raise
        try:
            load_checkpoint(ckpt_path)
        except CheckpointLoadError as err:
            raise err from err.__cause__  # without the bare torch.load traceback as context
        raise


#: Init arguments that say where a run writes, not what its model is: given to a run resumed with ``--ckpt_path``
#: (config or command line), they win over the value saved in the checkpoint's hyperparameters (which is the default:
#: a run resumed in its own folder rewrites its own export; ``tasks/hf.py``).
RUN_OUTPUTS = ("export_dir",)


def keep_run_outputs(model, given: dict) -> None:
    """Put back in ``model`` (the config's model entry) the :data:`RUN_OUTPUTS` this run was given (``given``: the
    model's init arguments before the checkpoint's replaced them)."""
    for key in RUN_OUTPUTS:
        if given.get(key) is not None and key in init_args(model):
            setattr(model.init_args, key, given[key])


def say_replaced(ckpt_path: str, before: dict, after: dict) -> None:
    """One info line listing the model arguments the checkpoint's saved hyperparameters replaced (``pretrained``
    is not one: a run from a checkpoint drops it)."""
    replaced = {
        key: value for key, value in after.items() if key in before and before[key] != value and key != "pretrained"
    }
    if replaced:
        rank_zero_info(
            f"checkpoint {ckpt_path}: its saved hyperparameters replace the config's: "
            + "; ".join(f"model.init_args.{key} {before[key]!r} -> {value!r}" for key, value in replaced.items())
        )


def saved_run_config(args: list[str]) -> Path | None:
    """For ``validate``/``test``/``predict --ckpt_path <run>/checkpoints/<name>.ckpt`` given without ``--config``
    or ``--model``: the config that run saved beside it (``<run>/config.yaml``, or the newest ``config.<n>.yaml`` a
    resumed run wrote); an error when it saved none. None for other command lines."""
    if not args or args[0] not in EVALUATION_VERBS:
        return None
    options = [arg.split("=", 1)[0] for arg in args[1:]]
    if any(option in ("--config", "-c", "--model", "--model.class_path") for option in options):
        return None
    paths = [value for flag, value in zip(args, args[1:]) if flag == "--ckpt_path"]
    paths += [arg.split("=", 1)[1] for arg in args if arg.startswith("--ckpt_path=")]
    if not paths or not names_a_path(paths[-1]):
        return None
    if not Path(paths[-1]).exists():
        raise missing_checkpoint(paths[-1])
    if not Path(paths[-1]).is_file():
        raise MissingPathError(f"--ckpt_path {paths[-1]}: no such checkpoint file")
    run_dir = checkpoint_run_dir(paths[-1])
    saved = saved_configs(run_dir)
    if not saved:
        raise ConfigError(
            f"--ckpt_path {paths[-1]}: no --config given and no config.yaml beside it in {run_dir} (a run's "
            "checkpoints/ folder has one above it); give --config, the config it was trained with"
        )
    return max(saved, key=lambda path: int(path.suffixes[0][1:]) if len(path.suffixes) > 1 else 0)
