"""Lightning's rich progress bar, without its ``Epoch 6/-2`` in runs counted in steps.

A run with ``max_steps`` and no ``max_epochs`` (the LRA trainers) has ``max_epochs = -1``, which
``RichProgressBar`` prints as the last epoch, ``-2``; this bar says ``Epoch 6`` there. The CLI uses it
where rich is installed and no other progress bar is given.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepsRichProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training description names no last epoch when the run has none."""

    def _get_train_description(self, current_epoch: int) -> str:
        description = super()._get_train_description(current_epoch)
        max_epochs = self.trainer.max_epochs
        if max_epochs is None or max_epochs >= 0:
            return description
        counted = f"Epoch {current_epoch}/{max_epochs - 1}"
        return description.replace(counted, f"Epoch {current_epoch}".ljust(len(counted)), 1)
