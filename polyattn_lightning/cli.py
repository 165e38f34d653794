"""``lightning`` / ``polyattn`` / ``python -m polyattn_lightning``: a LightningCLI over this project's tasks.

Usage: ``lightning fit --config configs/classification/quickstart.yaml``. Any
LightningModule or LightningDataModule can be named in ``class_path``; this
project's are imported first, so their short names (``ClassificationModule``,
``DigitsDataModule``...) work.
"""
from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

from . import data, tasks  # noqa: F401  (registers the short class names)

#: TensorBoardLogger's default run name, which the CLI replaces with the config file's name.
DEFAULT_RUN_NAME = "lightning_logs"


def default_precision() -> str:
    """bf16 mixed precision where the GPU has it, fp16 mixed on older GPUs, fp32 on CPU."""
    if not torch.cuda.is_available():
        return "32-true"
    return "bf16-mixed" if torch.cuda.is_bf16_supported() else "16-mixed"


class PolyattnCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.set_defaults({"trainer.precision": default_precision()})

    def before_instantiate_classes(self) -> None:
        """Log to ``runs/<config name>/version_N`` unless the logger was given a name."""
        config = self.config[self.subcommand] if self.subcommand else self.config
        logger, files = config.trainer.logger, config.get("config")
        if files and hasattr(logger, "init_args") and logger.init_args.get("name") == DEFAULT_RUN_NAME:
            logger.init_args.name = Path(str(files[-1])).stem


def make_cli(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` when None) and, with ``run``, execute the subcommand."""
    return PolyattnCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the tasks build their own optimizer from their recipe
        args=args,
        run=run,
    )


def main(args: list[str] | None = None) -> None:
    """Console-script entry point."""
    make_cli(args)
