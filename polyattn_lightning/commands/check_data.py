"""``polyattn check-data --config CONFIG.yaml [--data.root DIR ...] [--workers N]``

Decodes every image file of the config's data set (image folders, Tiny-ImageNet, COCO, LRA
Pathfinder: the DataModule's ``image_files()``) once, in parallel with a progress bar, and lists
every file that cannot be read, so a data set with a few bad files among a million costs one
check, not one crashed run per file. Takes the same ``--config`` and ``--data.*`` arguments as
``polyattn fit``; no model is built. Exits with status 0 when every image reads, 2 (after listing
them all) otherwise. ``--data.check_images true`` runs the same check at the start of training.
"""

from __future__ import annotations

import re
import sys

from ..cli import PolyattnCLI, make_cli
from ..cli.config import resolve_task_defaults
from ..cli.prechecks import check_config
from ..data.base import DataModule
from ..data.image_check import find_unreadable_images
from ..errors import UNRECOGNIZED, ArgumentParser, ConfigError, DataError


class DataOnlyCLI(PolyattnCLI):
    """The CLI's parsing and data path checks (:func:`~polyattn_lightning.cli.prechecks.check_config`), instantiating
    only the data: the model's values (a pretrained file not yet downloaded) do not matter here."""

    def before_instantiate_classes(self) -> None:
        check_config(self._data_only())

    def instantiate_classes(self) -> None:
        self.datamodule = self.parser.instantiate_classes(self._data_only()).data

    def _data_only(self):
        config = self.config.clone()
        config.model = None
        resolve_task_defaults(config)  # the standard best checkpoint is built too (never used here)
        return config


def image_paths(datamodule) -> list[str]:
    """The DataModule's ``image_files()`` (another LightningDataModule: its splits' ``samples``)."""
    datamodule.prepare_data()  # a generated set (the synthetic COCO shapes) is written first
    if hasattr(datamodule, "image_files"):
        return datamodule.image_files()
    return DataModule.image_files(datamodule)


#: The options passed on to the fit parser (``--data ImageFolderDataModule``, ``--data.root DIR``...); any other one
#: is this command's, matched in full.
PASSED_ON = re.compile(r"--(data|model|trainer|seed_everything)([.=]|$)")


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="polyattn check-data",
        description=__doc__.split("\n\n")[1],
        epilog="Further --data.* / --model.* / --trainer.* arguments are passed on as for `polyattn fit`.",
    )
    p.add_argument("--config", "-c", action="append", required=True, help="experiment config (repeat to compose)")
    p.add_argument(
        "--workers", type=int, default=None, help="decoding processes (default: the CPUs this process may use)"
    )
    return p


def main(argv: list[str] | None = None) -> dict[str, str]:
    """Run the check; returns the unreadable files with why (raises a DataError after printing them)."""
    command = parser()
    args, overrides = command.parse_known_args(argv)
    unknown = [arg for arg in overrides if arg.startswith("--") and not PASSED_ON.match(arg)]
    if unknown:
        command.error(f"{UNRECOGNIZED}{' '.join(unknown)}")
    config_args = [arg for path in args.config for arg in ("--config", path)]
    sys.argv = sys.argv[:1]  # parsed here: LightningCLI would warn that its args and sys.argv both hold some
    datamodule = make_cli([*config_args, *overrides], run=False, cli_class=DataOnlyCLI).datamodule
    if datamodule is None:
        raise ConfigError(f"{', '.join(args.config)} names no data (data: class_path ...)")
    paths = image_paths(datamodule)
    name = type(datamodule).__name__
    if not paths:
        print(f"{name} reads no image files (nothing to check)")
        return {}
    bad = find_unreadable_images(paths, workers=args.workers)
    for path, error in bad.items():
        print(f"{path}: {error}")
    sys.stdout.flush()  # the list before the error line, also when stdout is a file
    if bad:
        raise DataError(f"{len(bad)} of {len(paths)} images of {name} cannot be read (listed above)")
    print(f"all {len(paths)} images of {name} read")
    return bad
