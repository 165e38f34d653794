"""Where a run writes: ``runs/<task family>/<config name>/version_N``, the folder of a checkpoint's evaluation,
the same folder again for ``fit`` resuming a run's checkpoint, and a saved config never written over.

A run folder holds the config it ran with (``config.yaml``; ``config.1.yaml``... for each resumed run), its logs
(TensorBoard's, and ``run.log``: :mod:`.run_log`) and ``checkpoints/``. A checkpoint's folder tells which run it
belongs to (:func:`checkpoint_run_dir`), so evaluating or resuming it writes beside that run's files, and a run that
fails before its first step leaves no folder behind.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Iterator

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import SaveConfigCallback

from ..sharding import is_sharded_checkpoint
from .config import component_class
from .prechecks import config_attention

#: TensorBoardLogger's default run name, which the CLI replaces with the config file's name.
DEFAULT_RUN_NAME = "lightning_logs"
#: Where runs are logged by default: ``runs/<task family>/<config name>/version_N``.
RUNS_DIR = "runs"
#: The loggers a resumed run can go on in its own folder with: TensorBoard adds an events file beside the first
#: run's (Lightning's CSVLogger would write its metrics.csv over the first run's).
FOLDER_LOGGERS = (".TensorBoardLogger",)
#: The verbs that evaluate a checkpoint: they write in its run's folder, and can take their config from there.
EVALUATION_VERBS = ("validate", "test", "predict")
#: ``--ckpt_path`` values that name no file: Lightning finds those checkpoints itself.
LIGHTNING_CKPT_NAMES = ("last", "best", "hpc", "registry")


class KeepingSaveConfigCallback(SaveConfigCallback):
    """Saves the resolved config in the run's log directory, never over an earlier run's.

    A run that logs into an existing directory (a requeued SLURM job keeps its
    ``slurm-<job id>`` version; ``--trainer.logger.init_args.version`` given
    again) writes ``config.1.yaml``, ``config.2.yaml``... beside ``config.yaml``
    where Lightning's callback would abort the run.
    """

    def setup(self, trainer, pl_module, stage: str) -> None:
        if not self.already_saved and self.save_to_log_dir and not self.overwrite:
            log_dir = trainer.log_dir  # broadcast from rank 0
            stem, suffix = os.path.splitext(self.config_filename)
            name, count = self.config_filename, 0
            if trainer.is_global_zero:
                fs = get_filesystem(log_dir)
                while fs.isfile(os.path.join(log_dir, name)):
                    count += 1
                    name = f"{stem}.{count}{suffix}"
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


def names_a_path(ckpt_path: str | os.PathLike | None) -> bool:
    """Whether a ``--ckpt_path`` value names a local file or folder (not ``last``/``best``..., not a URL)."""
    return str(ckpt_path) not in LIGHTNING_CKPT_NAMES and "://" not in str(ckpt_path)


def task_family(model_config) -> str:
    """The folder a task's runs go in: its module's name (``classification``, ``lra``, ``detection``), or its
    class name for a task defined in a script."""
    cls = component_class(model_config)
    if cls is None:
        return "model"
    module = cls.__module__.rpartition(".")[2]
    return cls.__name__ if module == "__main__" else module


def activation_label(spec) -> str:
    """A folder-name-safe label of an attention spec: ``relu``, ``poly3_scale0.0714``."""
    if isinstance(spec, str):
        label = spec
    else:
        options = dict(spec)
        label = "_".join(
            [
                str(options.pop("name", "attention")),
                *(f"{k}{v:g}" if isinstance(v, float) else f"{k}{v}" for k, v in sorted(options.items())),
            ]
        )
    return re.sub(r"[^\w.=-]+", "", label)


def checkpoint_run_dir(ckpt_path: str | os.PathLike) -> Path:
    """The run folder a checkpoint belongs to: the folder above its ``checkpoints/``, else its own folder."""
    ckpt = Path(ckpt_path)
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def evaluation_dir(ckpt_path: str, subcommand: str) -> tuple[Path, str]:
    """Where ``validate``/``test``/``predict`` of a checkpoint write: ``(folder, name)`` of
    ``<run>/<subcommand>_<checkpoint stem>`` (:func:`checkpoint_run_dir`), or ``..._2``, ``..._3``... when an
    earlier call wrote that folder: one folder per call, never overwritten (predictions included)."""
    run_dir, stem = checkpoint_run_dir(ckpt_path), f"{subcommand}_{Path(ckpt_path).stem}"
    name, count = stem, 1
    while (run_dir / name).exists():
        count += 1
        name = f"{stem}_{count}"
    return run_dir, name


def saved_configs(run_dir: Path) -> list[Path]:
    """The configs a run folder holds: ``config.yaml``, and the ``config.<n>.yaml`` each resumed run added."""
    return [path for path in run_dir.glob("config*.yaml") if re.fullmatch(r"config(\.\d+)?\.yaml", path.name)]


def resumed_run_dir(ckpt_path: str | os.PathLike | None) -> Path | None:
    """The run folder ``fit --ckpt_path`` continues in: the one above the checkpoint's ``checkpoints/`` folder, when
    a run of this CLI wrote it (a saved config is there); None for a checkpoint anywhere else."""
    if not ckpt_path or not names_a_path(ckpt_path):
        return None
    ckpt = Path(ckpt_path)
    if ckpt.parent.name != "checkpoints" or not (ckpt.is_file() or is_sharded_checkpoint(ckpt)):
        return None
    run_dir = checkpoint_run_dir(ckpt)
    return run_dir if saved_configs(run_dir) else None


def place_logs(config, subcommand: str | None, given_args: list[str]) -> None:
    """Point the logger of ``config`` (the subcommand's) at this run's folder, unless it was given one: a name of
    ``<task family>/<config name>`` (``<config name>_<activation>`` when ``--model.attention`` gives another
    activation than the config's; the family is :func:`task_family`, so the three quickstarts never share a
    folder); ``validate``/``test``/``predict`` of a checkpoint log to :func:`evaluation_dir`; ``fit`` resuming a
    checkpoint of a run's ``checkpoints/`` folder logs on in that run's folder (:func:`resumed_run_dir`), unless the
    logger was given a version, as the SLURM script does."""
    logger, files, ckpt_path = config.trainer.logger, config.get("config"), config.get("ckpt_path")
    model_args = config.model.get("init_args") if hasattr(config.model, "get") else None
    if files and hasattr(logger, "init_args") and logger.init_args.get("name") == DEFAULT_RUN_NAME:
        name = Path(str(files[-1])).stem
        if model_args is not None and any(re.match(r"--model\.(init_args\.)?attention\b", arg) for arg in given_args):
            label = activation_label(model_args.attention)
            if label != activation_label(config_attention(files) or ""):
                name = f"{name}_{label}"
        logger.init_args.name = f"{task_family(config.model)}/{name}"
    if subcommand in EVALUATION_VERBS and ckpt_path and hasattr(logger, "init_args"):
        if "://" not in str(ckpt_path) and (Path(ckpt_path).is_file() or is_sharded_checkpoint(ckpt_path)):
            save_dir, version = evaluation_dir(ckpt_path, subcommand)
            logger.init_args.save_dir, logger.init_args.name, logger.init_args.version = str(save_dir), "", version
    run_dir = resumed_run_dir(ckpt_path) if subcommand == "fit" else None
    folder_logger = str(getattr(logger, "class_path", "")).endswith(FOLDER_LOGGERS)
    if run_dir is not None and folder_logger and logger.init_args.get("version") is None:
        logger.init_args.save_dir, logger.init_args.name = str(run_dir.parent), ""
        logger.init_args.version = run_dir.name


@contextlib.contextmanager
def removed_if_unstarted(log_dir: Path | None, trainer) -> Iterator[None]:
    """A run that fails before its first training step removes the log folder it created (a config and an empty
    events file), and the folders above it that it created (``runs/`` itself on a first run) when left empty."""
    created = log_dir if log_dir is not None and not log_dir.exists() else None
    while created is not None and not created.parent.exists():
        created = created.parent  # the outermost folder this run will create
    try:
        yield
    except BaseException:
        if created is not None and trainer.global_step == 0 and log_dir.is_dir() and not any(log_dir.rglob("*.ckpt")):
            shutil.rmtree(log_dir, ignore_errors=True)
            for folder in [log_dir, *log_dir.parents][1 : len(log_dir.relative_to(created).parts) + 1]:
                with contextlib.suppress(OSError):  # only if empty: another run may be writing beside it
                    folder.rmdir()
        raise


def resume_command(args: list[str], ckpt_path: str) -> str:
    """The command line that resumes this run from ``ckpt_path``: the program as it was started (``lightning``,
    ``polyattn``, ``python -m polyattn_lightning``; under torchrun, with the user's torchrun options) and ``args``,
    with ``--ckpt_path ckpt_path`` in place of any ``--ckpt_path`` they gave."""
    kept, value_of_ckpt_path = [], False
    for arg in args:
        if not value_of_ckpt_path and arg != "--ckpt_path" and not arg.startswith("--ckpt_path="):
            kept.append(arg)
        value_of_ckpt_path = arg == "--ckpt_path"
    program = Path(sys.argv[0]).name
    program = program if program in ("lightning", "polyattn") else "python -m polyattn_lightning"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        program = "torchrun <your torchrun options> -m polyattn_lightning"
    return f"{program} {shlex.join([*kept, '--ckpt_path', str(ckpt_path)])}"
