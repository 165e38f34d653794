"""A task's ``convert`` option (:class:`ConvertRecipe`) and the names :func:`~.run.convert` takes."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from ..checkpoint import checkpoint_safe
from ..errors import ConfigError, options_checked
from .transfer import TransferOptions

#: The conversion methods, cheapest first.
METHODS = ("none", "calibrate", "transfer")


@checkpoint_safe
@options_checked("convert")
@dataclass
class ConvertRecipe(TransferOptions):
    """A task's ``convert`` option: the method, how many training samples it runs on (in batches of
    ``batch_size``, None: the data's; a transfer holds ``holdout`` of them out) and the transfer's options
    (:class:`~.transfer.TransferOptions`)."""

    method: str = "none"
    samples: int = 64
    batch_size: int | None = None

    def __post_init__(self):
        super().__post_init__()
        if self.method not in METHODS:
            raise ConfigError(f"convert.method: {self.method!r} is not one of {', '.join(METHODS)}")
        if self.samples < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise ConfigError(f"convert.samples and convert.batch_size must be at least 1, got {self.samples}, "
                              f"{self.batch_size}")  # fmt: skip

    @property
    def options(self) -> dict[str, Any]:
        """The transfer's options, as :func:`~.run.convert` takes them."""
        return {f.name: getattr(self, f.name) for f in fields(TransferOptions)}


#: What :func:`~.run.convert` takes by name besides the model, activation and samples.
OPTIONS = ("method", *(f.name for f in fields(TransferOptions)))

#: Checkpoints written before the recipe had a module of its own name it by the package.
torch.serialization.add_safe_globals([(ConvertRecipe, "polyattn_lightning.conversion.ConvertRecipe")])

__all__ = ["METHODS", "OPTIONS", "ConvertRecipe"]
