"""Keep what ``lightning predict`` computes: Lightning itself only returns it to the caller."""

from __future__ import annotations

from pathlib import Path

import torch
from lightning.pytorch.callbacks import BasePredictionWriter

from ..checkpoint import atomic_save


class PredictionWriter(BasePredictionWriter):
    """Saves each rank's predictions to ``<log dir>/<dirname>/rank<k>.pt`` at the end of ``predict``.

    A file holds ``{"predictions": Tensor, "indices": Tensor}``: the concatenated
    ``predict_step`` outputs (class probabilities for classification) and the
    index of each row in the predict data set, so the ranks' files merge back
    into data-set order, each sample once (a padding batch's None is left out).
    For file-based data sets (a data set with ``samples`` of ``(path, label)``,
    e.g. image folders) it also holds ``"paths"``, each row's file, and
    ``"classes"``, the DataModule's class names by index.

    A task whose predictions are not tensors (detections) writes its own format: the LightningModule's
    ``save_predictions(predictions, out_dir)`` (:meth:`~polyattn_lightning.tasks.base.TaskModule.save_predictions`)
    is called on every rank with that rank's ``predict_step`` outputs, flattened, and returns True when it wrote
    them; a module without one, or whose one returns False, gets the tensor file above.
    """

    def __init__(self, dirname: str = "predictions"):
        super().__init__(write_interval="epoch")
        self.dirname = dirname

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        # Lightning nests both per predict loader (batch_indices even for a single one). A padding batch (a sharded
        # run's rank with fewer samples, data/evaluation.py) predicted None: it is left out with its indices.
        per_loader = predictions if len(batch_indices) > 1 else [predictions]
        kept = [
            (output, indices)
            for outputs, loader_indices in zip(per_loader, batch_indices)
            for output, indices in zip(outputs, loader_indices)
            if output is not None
        ]
        predictions, batch_indices = [output for output, _ in kept], [indices for _, indices in kept]
        out_dir = Path(trainer.log_dir or trainer.default_root_dir) / self.dirname
        save = getattr(pl_module, "save_predictions", None)  # a LightningModule not built on the tasks' base has none
        if save is not None and save(list(_flatten(predictions)), out_dir):
            return
        outputs = torch.cat([p.cpu() for p in _flatten(predictions)])
        indices = torch.tensor(list(_flatten(batch_indices)), dtype=torch.long)
        saved = {"predictions": outputs, "indices": indices}
        loaders = trainer.predict_dataloaders
        dataset = (loaders[0] if isinstance(loaders, (list, tuple)) else loaders).dataset
        if hasattr(dataset, "samples"):
            saved["paths"] = [str(dataset.samples[i][0]) for i in indices.tolist()]
        if getattr(trainer.datamodule, "classes", None) is not None:
            saved["classes"] = list(trainer.datamodule.classes)
        atomic_save(saved, out_dir / f"rank{trainer.global_rank}.pt")


def _flatten(items):
    """The leaves (tensors or ints) of nested lists, in order."""
    for item in items:
        if isinstance(item, (list, tuple)):
            yield from _flatten(item)
        else:
            yield item
