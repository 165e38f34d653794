"""Draw the attention maps at the end of validation
(:func:`~polyattn_lightning.diagnostics.figures.attention_pictures`)."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import move_data_to_device
from torch.utils.data import IterableDataset

from .. import deprecated
from ..diagnostics.figures import attention_pictures
from ..diagnostics.probe import LayerRef, follow_probe, probe_batch, spread_indices
from ..sharding import sharded_strategy


class AttentionMaps(Callback):
    """At the end of validation, draw :func:`attention_pictures` on a fixed probe batch.

    The probe is ``probe_size`` validation samples spread over the classes (:func:`spread_indices`, the labels
    read by the data module's ``split_labels``; evenly spaced over the validation set where they are unknown),
    taken once: an image folder's validation set is sorted by class. Where the validation data cannot be indexed
    (an iterable data set) it is the first validation batch's first samples. PNGs go to
    ``<log dir>/attention_maps/step{global step}_{heatmaps,overlay}.png`` and to TensorBoard (``add_figure``)
    when the run logs there; with other loggers the files are the record. Only global rank zero draws and writes;
    no rank waits. Under the sharded strategy every rank runs the probe forward (each block is gathered from all
    ranks).
    """

    def __init__(
        self,
        layers: Sequence[LayerRef] | None = None,
        heads: Sequence[int] | None = None,
        probe_size: int = 8,
        samples: int = 4,
        every_n_epochs: int = 1,
    ):
        """
        Args:
            layers: 1-based attention layer numbers or module names; None: every layer.
            heads: head indices (0-based) to draw; None: every head.
            probe_size: samples in the probe batch (the heat maps average over them).
            samples: probe samples shown in the overlay.
            every_n_epochs: draw after every n-th validation.
        """
        self.layers = None if layers is None else list(layers)
        self.heads = None if heads is None else list(heads)
        self.probe_size, self.samples, self.every_n_epochs = probe_size, samples, every_n_epochs
        self._probe: Any = None
        self._dir: Path | None = None
        self._validations = 0

    def state_dict(self) -> dict[str, Any]:
        """The probe, so that a resumed run draws the same samples."""
        return {"probe": move_data_to_device(self._probe, "cpu"), "validations": self._validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._probe, self._validations = state_dict.get("probe"), state_dict.get("validations", 0)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._dir = Path(trainer.log_dir or trainer.default_root_dir) / "attention_maps"  # log_dir: every rank

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._probe is None and self._probes(trainer) and not trainer.sanity_checking:
            spread = self._spread_batch(trainer, dataloader_idx)
            self._probe = probe_batch(pl_module, batch if spread is None else spread, self.probe_size)

    def _spread_batch(self, trainer: pl.Trainer, dataloader_idx: int) -> Any:
        """A batch of ``probe_size`` samples of the validation set spread over its classes, made as the loader
        makes its batches and moved to the device as Lightning moves them; None where the set cannot be indexed."""
        loaders = trainer.val_dataloaders
        loader = loaders[dataloader_idx] if isinstance(loaders, (list, tuple)) else loaders
        dataset = getattr(loader, "dataset", None)
        if isinstance(dataset, IterableDataset) or not isinstance(dataset, Sized) or not len(dataset):
            return None
        split_labels = getattr(trainer.datamodule, "split_labels", None)  # the project's DataModule has it
        indices = spread_indices(len(dataset), self.probe_size, split_labels(dataset) if split_labels else None)
        batch = loader.collate_fn([dataset[index] for index in indices])
        return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)

    @staticmethod
    def _probes(trainer: pl.Trainer) -> bool:
        return trainer.is_global_zero or sharded_strategy(trainer) is not None

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not self._probes(trainer) or self._probe is None:
            return
        self._validations += 1
        if (self._validations - 1) % self.every_n_epochs:
            return
        if not trainer.is_global_zero:
            return follow_probe(pl_module, self._probe)
        step = trainer.global_step
        figures = attention_pictures(
            pl_module,
            self._probe,
            self.layers,
            self.heads,
            self.samples,
            f" (epoch {trainer.current_epoch}, step {step})",
        )
        self._dir.mkdir(parents=True, exist_ok=True)
        for name, fig in figures.items():
            fig.savefig(self._dir / f"step{step:07d}_{name}.png", dpi=100)
            for logger in trainer.loggers:
                if isinstance(logger, TensorBoardLogger):
                    logger.experiment.add_figure(f"attention_maps/{name}", fig, global_step=step, close=False)


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
