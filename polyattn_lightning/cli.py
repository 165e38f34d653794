"""``lightning`` / ``polyattn`` / ``python -m polyattn_lightning``: a LightningCLI over this project's tasks.

Usage: ``lightning fit --config configs/classification/quickstart.yaml``. Any
LightningModule or LightningDataModule can be named in ``class_path``; this
project's are imported first, so their short names (``ClassificationModule``,
``DigitsDataModule``...) work.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback

from . import data, tasks  # noqa: F401  (registers the short class names)
from .checkpoint import CheckpointLoadError, load_checkpoint
from .distributed import distributed_teardown

#: TensorBoardLogger's default run name, which the CLI replaces with the config file's name.
DEFAULT_RUN_NAME = "lightning_logs"


def default_precision() -> str:
    """bf16 mixed precision where the GPU has it, fp16 mixed on older GPUs, fp32 on CPU."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


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


class PolyattnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.precision": default_precision()})

    def _parse_ckpt_path(self) -> None:
        """Lightning reads ``--ckpt_path``'s hyperparameters with a bare ``torch.load``, whose errors
        (``OSError: [Errno 22] Invalid argument`` for a truncated file) do not name the file: when that
        fails, load the file the safe way, which raises a :class:`CheckpointLoadError` naming it and why."""
        try:
            super()._parse_ckpt_path()
        except Exception:
            subcommand = self.config.get("subcommand")
            ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
            if not ckpt_path or not Path(ckpt_path).is_file():
                raise
            try:
                load_checkpoint(ckpt_path)
            except CheckpointLoadError as err:
                raise err from err.__cause__  # without the bare torch.load traceback as context
            raise

    def before_instantiate_classes(self) -> None:
        """Log to ``runs/<config name>/version_N`` unless the logger was given a name; with
        ``--ckpt_path``, build the model without its ``pretrained`` file: the checkpoint's weights
        replace those anyway, and resuming or evaluating a fine-tuned run must not need that file."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        logger, files = config.trainer.logger, config.get("config")
        if files and hasattr(logger, "init_args") and logger.init_args.get("name") == DEFAULT_RUN_NAME:
            logger.init_args.name = Path(str(files[-1])).stem
        model_args = config.model.get("init_args") if hasattr(config.model, "get") else None
        if config.get("ckpt_path") and model_args is not None and model_args.get("pretrained"):
            model_args.pretrained = None


def make_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` when None) and, with ``run``, execute the subcommand."""
    return PolyattnCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the tasks build their own optimizer from their recipe
        save_config_callback=KeepingSaveConfigCallback,
        args=args,
        run=run,
    )


#: Verbs beside LightningCLI's fit/validate/test/predict: ``polyattn maps|norms|sweep ...``, one module each in
#: ``polyattn_lightning.commands`` with a ``main(argv)``.
COMMANDS = ("maps", "norms", "sweep")


@distributed_teardown()  # every verb ends with the process group torn down in order, on every backend
def main(args: list[str] | None = None) -> None:
    """Console-script entry point."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] in COMMANDS:
        importlib.import_module(f"{__package__}.commands.{argv[0]}").main(argv[1:])
        return
    make_cli(args)
