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
waits on another).
"""
from __future__ import annotations

import inspect
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn

from ..attention.diagnostics import LayerRef, captured_norms, probe_attention, select_layers
from .resume import capture_rng_state, restore_rng_state
from ..errors import ConfigError

#: Logged quantities, by the field of :class:`~polyattn_lightning.attention.diagnostics.CapturedNorms`.
QUANTITIES = {"phi": "phi_norm", "jacobian": "jacobian_norm", "output": "output_norm"}


def metric_key(quantity: str, layer: int, head: int | None) -> str:
    """``attention/phi_norm/layer02/head0`` (``.../mean`` for the average over heads)."""
    return f"attention/{quantity}/layer{layer:02d}/{'mean' if head is None else f'head{head}'}"


@contextmanager
def probing(module: nn.Module) -> Iterator[None]:
    """No grad, eval mode, and afterwards every ``training`` flag and RNG state as they were."""
    modes = [(m, m.training) for m in module.modules()]
    rng = capture_rng_state()
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training
        restore_rng_state(rng)


def probe_batch(pl_module: pl.LightningModule, batch: Any, size: int) -> Any:
    """The probe of ``batch``'s first ``size`` samples: the module's ``attention_probe(batch, size)``
    (:meth:`~polyattn_lightning.tasks.base.TaskModule.attention_probe`), else :func:`default_probe`'s."""
    hook = getattr(pl_module, "attention_probe", None)  # a LightningModule not built on the tasks' base has none
    return hook(batch, size) if hook is not None else default_probe(pl_module, batch, size)


def default_probe(pl_module: pl.LightningModule, batch: Any, size: int) -> Any:
    """The model input of the first ``size`` samples of ``batch``, copied: ``batch`` itself if a tensor, its
    first item if ``(inputs, targets, ...)``, and for a dict the entries named like ``forward``'s parameters
    (as a tuple of positional arguments).

    This is :meth:`~polyattn_lightning.tasks.base.TaskModule.attention_probe`'s default; a task whose batches are
    none of these overrides that hook (a tuple it returns is passed as positional arguments).
    """
    if isinstance(batch, Mapping):
        names = [p.name for p in inspect.signature(pl_module.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if names and all(isinstance(batch.get(name), Tensor) for name in names):
            return tuple(batch[name][:size].detach().clone() for name in names)
    inputs = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(inputs, Tensor):
        raise TypeError(
            f"cannot take a probe batch from a {type(batch).__name__} batch of {type(pl_module).__name__}: expected a "
            "tensor, (inputs, targets) or a dict holding forward's arguments by name; define "
            "attention_probe(batch, size) on the LightningModule"
        )
    return inputs[:size].detach().clone()


def run_probe(pl_module: nn.Module, probe: Any) -> Any:
    """``pl_module(probe)`` on the module's device, under the trainer's precision context when there is a trainer."""
    device = next(pl_module.parameters()).device
    args = move_data_to_device(probe if isinstance(probe, tuple) else (probe,), device)
    trainer = getattr(pl_module, "_trainer", None)  # a plain nn.Module has none
    if trainer is None:
        return pl_module(*args)
    with trainer.precision_plugin.forward_context():
        return pl_module(*args)


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
        if not trainer.is_global_zero or step % self.every_n_steps or step == self._last_step:
            return
        self._last_step = step
        if self._probe is None:
            self._probe = probe_batch(pl_module, batch, self.probe_size)
        metrics = self.measure(pl_module, self._probe)
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)

    def measure(self, pl_module: pl.LightningModule, probe: Any) -> dict[str, float]:
        """The logged norms for one probe pass, by :func:`metric_key`."""
        layers = select_layers(pl_module, self.layers)
        with probing(pl_module):
            records = probe_attention(layers, lambda: run_probe(pl_module, probe))
            metrics = {}
            for layer in layers:
                if not records[layer.index]:
                    raise RuntimeError(f"attention layer {layer.index} ({layer.name}) did not run in the probe forward")
                calls = [captured_norms(inputs, layer.module.activation) for inputs in records[layer.index]]
                for field, quantity in QUANTITIES.items():
                    per_head = torch.stack([getattr(norms, field) for norms in calls]).mean(0).tolist()
                    for head, value in enumerate(per_head):
                        metrics[metric_key(quantity, layer.index, head)] = value
                    metrics[metric_key(quantity, layer.index, None)] = sum(per_head) / len(per_head)
        return metrics
