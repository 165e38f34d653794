"""Log the polynomial-attention paper's norms while training: ||phi(S)||_F, ||d phi(S)/dS||_F, ||phi(S) v||_F.

Every ``every_n_steps`` optimizer steps, one forward of a small fixed probe batch
(its first ``probe_size`` samples of the first training batch, taken once) runs
with the ``capture`` hook set on the chosen layers; the norms of each layer are
logged per head and averaged over heads under
``attention/{phi_norm,jacobian_norm,output_norm}/layer{i:02d}/{head{h},mean}``
(1-based layers, as in the paper's "layer 2 and 12"), at the trainer's global
step, to every logger of the run. ``polyattn norms RUN_DIR`` draws them.

The probe pass leaves training as it would have been without it: it runs under
``torch.no_grad`` in eval mode (no dropout or drop-path draws), every module's
``training`` flag and the torch/numpy/python/CUDA RNG states are put back after
it, and it only reads the model. Only global rank zero probes (loggers write on
rank zero; the probe calls the bare module, never the DDP wrapper, so no rank
waits on another). Under the sharded strategy every rank runs the probe forward
(each block is gathered from all ranks), on its own first samples; rank zero's
is measured and logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import move_data_to_device

from .. import deprecated
from ..diagnostics.norms import measure_norms
from ..diagnostics.probe import LayerRef, follow_probe, probe_batch
from ..errors import ConfigError
from ..sharding import sharded_strategy


class AttentionNorms(Callback):
    """Record the attention norms of the chosen layers every ``every_n_steps`` optimizer steps (step 0 too)."""

    def __init__(self, every_n_steps: int = 50, layers: Sequence[LayerRef] | None = None, probe_size: int = 8):
        """
        Args:
            every_n_steps: optimizer steps between two records.
            layers: 1-based attention layer numbers or module names; None: every layer.
            probe_size: samples in the fixed probe batch.
        """
        if every_n_steps < 1 or probe_size < 1:
            raise ConfigError(f"every_n_steps and probe_size must be >= 1, got {every_n_steps} and {probe_size}")
        self.every_n_steps = every_n_steps
        self.layers = None if layers is None else list(layers)
        self.probe_size = probe_size
        self._probe: Any = None
        self._last_step = -1

    def state_dict(self) -> dict[str, Any]:
        """The probe, so that a resumed run keeps measuring on the same samples."""
        return {"probe": move_data_to_device(self._probe, "cpu")}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._probe = state_dict.get("probe")

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        probing = trainer.is_global_zero or sharded_strategy(trainer) is not None
        if not probing or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        if self._probe is None:
            self._probe = probe_batch(pl_module, batch, self.probe_size)
        if not trainer.is_global_zero:
            return follow_probe(pl_module, self._probe)
        metrics = self.measure(pl_module, self._probe)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def measure(self, pl_module: pl.LightningModule, probe: Any) -> dict[str, float]:
        """The logged norms for one probe pass, by :func:`~polyattn_lightning.diagnostics.norms.metric_key`."""
        return measure_norms(pl_module, probe, self.layers)


def __getattr__(name: str):
    return deprecated.attribute(__name__, name)
