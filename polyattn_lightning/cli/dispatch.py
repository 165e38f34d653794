"""Which code runs a verb: ``fit``/``validate``/``test``/``predict`` go to :class:`~.polyattn_cli.PolyattnCLI`
(:func:`make_cli`), every verb of :data:`COMMANDS` to its module in ``polyattn_lightning.commands``.

A new verb is one module ``commands/<verb>.py`` with a ``main(argv)`` (subverbs are its own to parse) and one line
in :data:`COMMANDS`, which ``polyattn --help`` lists.
"""

from __future__ import annotations

import importlib
import sys

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI

from ..distributed import distributed_teardown
from ..errors import reported
from .console import quiet_known_noise
from .parser import KeepLinesHelpFormatter, ShortErrorParser
from .polyattn_cli import PolyattnCLI
from .runs import KeepingSaveConfigCallback

#: Verbs beside LightningCLI's fit/validate/test/predict: ``polyattn maps|norms|sweep|grid|check-data ...``, one module
#: each in ``polyattn_lightning.commands`` (``-`` spelled ``_``) with a ``main(argv)``; listed by ``polyattn --help``.
COMMANDS = {
    "maps": "phi(S) heat maps and where a checkpoint's model looks, over image files",
    "norms": "draw the attention norms that runs logged against the training step",
    "sweep": "validation accuracy against the activation's scale, per sequence length (short fits)",
    "check-data": "decode every image file of a config's data set once and list every bad file",
    "consolidate": "a sharded checkpoint folder as one checkpoint file, or as a save_pretrained folder",
    "eval": "evaluate models side by side: causal LMs with lm-eval (local tasks), vision runs with `test`",
    "export": "a run's model or a saved HF folder as .pt2, ONNX, a timm state dict or save_pretrained, checked",
    "grid": "train every cell of a grid of settings (activations x seeds...), resumable; `grid report DIR`",
}


def make_cli(
    args: list[str] | None = None, run: bool = True, cli_class: type[PolyattnCLI] | None = None
) -> LightningCLI:
    """Parse ``args`` (``sys.argv`` when None) and, with ``run``, execute the subcommand."""
    quiet_known_noise()
    return (cli_class or PolyattnCLI)(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,  # the tasks build their own optimizer from their recipe
        save_config_callback=KeepingSaveConfigCallback,
        parser_class=ShortErrorParser,
        parser_kwargs={
            "epilog": "other verbs (`polyattn VERB --help`):\n"
            + "\n".join(f"  {verb:<11} {what}" for verb, what in COMMANDS.items()),
            "formatter_class": KeepLinesHelpFormatter,
        },
        args=args,
        run=run,
    )


@reported  # a user-input error prints as one short `error: ...` line (POLYATTN_DEBUG=1: the traceback)
@distributed_teardown()  # every verb ends with the process group torn down in order, on every backend
def main(args: list[str] | None = None) -> None:
    """Console-script entry point (``lightning``, ``polyattn``, ``python -m polyattn_lightning``)."""
    argv = sys.argv[1:] if args is None else args
    if argv and argv[0] in COMMANDS:
        importlib.import_module(f"polyattn_lightning.commands.{argv[0].replace('-', '_')}").main(argv[1:])
        return
    make_cli(args)
