"""The probe: one forward of a fixed small batch with the ``capture`` hook set on chosen attention layers.

What every diagnostic shares (the norm and map callbacks, ``polyattn maps``, the benches): which layers
(:func:`select_layers`), which input (:func:`probe_batch`: a task's ``attention_probe`` hook, else
:func:`default_probe`; which samples: :func:`spread_indices`), a forward that leaves training as it would have
been (:func:`probing`: no grad, eval mode, every ``training`` flag and RNG state put back) and what each layer
attended (:func:`probe_attention`, through the ``capture`` contract of
:mod:`polyattn_lightning.attention.switch.base`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch
from lightning.pytorch.utilities import move_data_to_device
from torch import Tensor, nn

from ..attention.switch.base import AttentionInputs, SwitchedAttention, attention_modules
from ..errors import ConfigError
from ..rng import capture_rng_state, restore_rng_state


#: A layer to watch: its 1-based position among the model's attention modules, or its module name.
LayerRef = int | str


class Layer(NamedTuple):
    """One attention layer of a model: 1-based ``index`` in forward order, module ``name``, the module."""

    index: int
    name: str
    module: SwitchedAttention


def select_layers(model: nn.Module, layers: Sequence[LayerRef] | None = None) -> list[Layer]:
    """The attention layers ``layers`` names (1-based numbers or module names; None: all), in model order.

    A layer is a module with the ``capture`` hook (:class:`SwitchedAttention`), numbered
    in ``named_modules`` order, which is forward order for timm models and the LRA encoder.
    """
    found = [Layer(i, name, module) for i, (name, module) in enumerate(attention_modules(model), 1)]
    if not found:
        raise ValueError(
            f"{type(model).__name__} has no attention module with the capture hook (a SwitchedAttention); "
            "switch a timm model with set_attention or build it from SwitchedAttention modules"
        )
    if layers is None:
        return found
    by_name = {layer.name: layer for layer in found}
    chosen = []
    for ref in layers:
        if isinstance(ref, int) and 1 <= ref <= len(found):
            chosen.append(found[ref - 1])
        elif isinstance(ref, str) and ref in by_name:
            chosen.append(by_name[ref])
        else:
            raise ConfigError(
                f"no attention layer {ref!r}: expected a number 1..{len(found)} or one of the module names "
                f"{', '.join(by_name)}"
            )
    return sorted(set(chosen), key=lambda layer: layer.index)


def probe_attention(layers: Sequence[Layer], run: Callable[[], object]) -> dict[int, list[AttentionInputs]]:
    """Call ``run()`` (a forward of the model ``layers`` are in) with ``capture`` set on ``layers``; returns each
    layer's
    captured inputs by layer index, detached, one entry per call of that layer (two-tower models call twice).

    The hooks that were set before are put back, also when ``run`` raises.
    """
    records: dict[int, list] = {layer.index: [] for layer in layers}
    saved = [layer.module.capture for layer in layers]

    def keep(index: int) -> Callable:
        def hook(module: nn.Module, inputs: AttentionInputs) -> None:
            records[index].append(type(inputs)(*(x.detach() if isinstance(x, Tensor) else x for x in inputs)))

        return hook

    try:
        for layer in layers:
            layer.module.capture = keep(layer.index)
        run()
    finally:
        for layer, hook in zip(layers, saved):
            layer.module.capture = hook
    return records


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


def probe_batch(pl_module: nn.Module, batch: Any, size: int) -> Any:
    """The probe of ``batch``'s first ``size`` samples: the module's ``attention_probe(batch, size)``
    (:meth:`~polyattn_lightning.tasks.base.TaskModule.attention_probe`), else :func:`default_probe`'s."""
    hook = getattr(pl_module, "attention_probe", None)  # a LightningModule not built on the tasks' base has none
    return hook(batch, size) if hook is not None else default_probe(pl_module, batch, size)


def spread_indices(count: int, size: int, labels: Sequence[int] | np.ndarray | None = None) -> list[int]:
    """``size`` (at most ``count``) indices of a data set of ``count`` samples, spread over it: where ``labels``
    (each sample's class) are known, each class's first sample in class order, then each class's second, and so
    on; else evenly spaced. So a probe of a validation set sorted by class (an image folder) holds several classes,
    not the first class's first samples."""
    size = min(size, count)
    if labels is None:
        return [i * count // size for i in range(size)]
    labels = np.asarray(labels)
    by_class = [np.flatnonzero(labels == label) for label in np.unique(labels)]
    rounds = (members[turn] for turn in range(max(map(len, by_class))) for members in by_class if turn < len(members))
    return [int(index) for _, index in zip(range(size), rounds)]


def default_probe(pl_module: nn.Module, batch: Any, size: int) -> Any:
    """The model input of the first ``size`` samples of ``batch``, copied: ``batch`` itself if a tensor, its
    first item if ``(inputs, targets, ...)``, and for a dict the entries named like ``forward``'s parameters
    (as a tuple of positional arguments).

    This is :meth:`~polyattn_lightning.tasks.base.TaskModule.attention_probe`'s default; a task whose batches are
    none of these overrides that hook (a tuple it returns is passed as positional arguments).
    """
    if isinstance(batch, Mapping):
        names = [
            p.name
            for p in inspect.signature(pl_module.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
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


def follow_probe(pl_module: nn.Module, probe: Any) -> None:
    """The probe forward a rank other than 0 runs while rank 0 probes a sharded model: the same forward (so the same
    all-gathers of each block), nothing recorded, under :func:`probing`."""
    with probing(pl_module):
        run_probe(pl_module, probe)
