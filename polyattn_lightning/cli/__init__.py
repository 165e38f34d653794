"""``lightning`` / ``polyattn`` / ``python -m polyattn_lightning``: a LightningCLI over this project's tasks.

Usage: ``lightning fit --config configs/classification/quickstart.yaml``. Any LightningModule or LightningDataModule
can be named in ``class_path``; this project's are imported first, so their short names (``ClassificationModule``,
``DigitsDataModule``...) work.

One module per concern: :mod:`.parser` (options matched in full, short errors, help) and :mod:`.defaults` (precision,
logger, plugins, the standard callbacks' short keys); :mod:`.prechecks` (the YAML files before jsonargparse, the
values before any model is built); :mod:`.ckpt_path` (what ``--ckpt_path`` names); :mod:`.runs` (run folders);
:mod:`.console` (what a run shows); :mod:`.polyattn_cli` (the LightningCLI subclass wiring them); :mod:`.dispatch`
(the verbs: ``main``, ``make_cli``, ``COMMANDS``); :mod:`.config` (reading a parsed config).
"""

from .. import deprecated
from .dispatch import main, make_cli
from .polyattn_cli import PolyattnCLI

__all__ = ["PolyattnCLI", "main", "make_cli"]


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
