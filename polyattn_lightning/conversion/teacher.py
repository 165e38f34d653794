"""The softmax teacher: what every attention layer was given and gave back, and how far a student layer is from it.

A conversion's teacher is the model itself with softmax: every switched module's ``activation_spec`` is set back
to ``softmax`` for a forward (:func:`activation`; softmax through the switch equals the library's own SDPA), with
the student's edits turned off. :func:`record` runs that forward on one batch with hooks that keep each
layer's call (its positional and keyword arguments: the hidden states, the mask, RoPE's cos/sin...) and its
output; a student layer is then run on the teacher's own inputs (:func:`layer_output`), layer by layer, so the
layers are independent and can be trained all at once or a chunk at a time.

The output compared is the attention's contribution to the residual stream: the module's output after its
output projection (Llama's ``o_proj``, timm's ``proj``), or, for a module that returns its heads unprojected
(BERT), those heads through the projection that follows (``output.dense``). The error of a layer is relative:
``sum ||student - teacher||^2 / sum ||teacher||^2`` over the batch's real tokens (HF's ``attention_mask``), so
layers of any width weigh alike and 1.0 is the error of a zero output.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..attention.registry import ActivationSpec
from ..attention.switch import AttentionInputs, SwitchedAttention, attention_modules

Batch = Any  # a tensor (timm) or a mapping of tensors (Hugging Face), as the model takes it


@dataclass
class Layer:
    """One attention layer being converted: its name, the switched module, and the projection that follows it when
    the module returns its heads unprojected."""

    name: str
    module: SwitchedAttention
    outer_output: nn.Module | None = None


@dataclass
class Call:
    """One recorded call of a layer: its arguments, and the teacher's output (after the output projection)."""

    args: tuple
    kwargs: dict
    target: Tensor


def run_model(model: nn.Module, batch: Batch) -> Any:
    """One forward of ``model`` on ``batch`` (a mapping is passed as keyword arguments)."""
    return model(**batch) if isinstance(batch, Mapping) else model(batch)


@contextmanager
def activation(model: nn.Module, spec: ActivationSpec) -> Iterator[None]:
    """Every switched attention module of ``model`` attends with ``spec`` meanwhile (its own spec restored after)."""
    modules = [module for _, module in attention_modules(model)]
    saved = [module.activation_spec for module in modules]
    try:
        for module in modules:
            module.activation_spec = spec
        yield
    finally:
        for module, spec_before in zip(modules, saved):
            module.activation_spec = spec_before


@contextmanager
def quiet(model: nn.Module, train: Iterable[nn.Parameter] = ()) -> Iterator[None]:
    """Eval mode (no dropout), no KV cache (the recorded calls are replayed: a cache would grow), no grad for the
    model's parameters but ``train``; all put back after."""
    modes = [(m, m.training) for m in model.modules()]
    keep = {id(p) for p in train}
    grads = [(p, p.requires_grad) for p in model.parameters() if id(p) not in keep]
    config = getattr(model, "config", None)
    use_cache = getattr(config, "use_cache", None)
    try:
        model.eval()
        for p, _ in grads:
            p.requires_grad_(False)
        if use_cache:
            config.use_cache = False
        yield
    finally:
        for m, training in modes:
            m.training = training
        for p, flag in grads:
            p.requires_grad_(flag)
        if use_cache:
            config.use_cache = use_cache


def _first(output: Any) -> Tensor:
    return output[0] if isinstance(output, (tuple, list)) else output


def _detached(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, (tuple, list)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, dict):
        return {k: _detached(v) for k, v in value.items()}
    return value


def record(
    model: nn.Module,
    layers: Sequence[Layer],
    batch: Batch,
    capture: Callable[[int, AttentionInputs], None] | None = None,
) -> list[list[Call]]:
    """The softmax forward of ``batch``: per layer, its calls (a layer may be called more than once). ``capture``
    gets ``(layer index, AttentionInputs)`` of each call, as the diagnostics' capture contract gives them.
    The caller turns the student's edits off and holds :func:`quiet`."""
    calls: list[list[Call]] = [[] for _ in layers]
    hooks = []

    def keep(index: int, layer: Layer):
        def hook(module, args, kwargs, output):
            target = _first(output)
            if layer.outer_output is not None:
                target = layer.outer_output(target)
            calls[index].append(Call(_detached(args), _detached(kwargs), target.detach()))

        return hook

    saved = [layer.module.capture for layer in layers]
    try:
        for index, layer in enumerate(layers):
            hooks.append(layer.module.register_forward_hook(keep(index, layer), with_kwargs=True))
            if capture is not None:
                layer.module.capture = lambda module, inputs, index=index: capture(index, inputs)
        with torch.no_grad(), activation(model, "softmax"):  # every layer, also those not recorded
            run_model(model, batch)
    finally:
        for hook in hooks:
            hook.remove()
        for layer, previous in zip(layers, saved):
            layer.module.capture = previous
    return calls


def layer_output(layer: Layer, call: Call) -> Tensor:
    """The layer's output (after its output projection) on the teacher's inputs of ``call``, with the current
    weights and activation."""
    out = _first(layer.module(*call.args, **call.kwargs))
    return layer.outer_output(out) if layer.outer_output is not None else out


def token_weights(batch: Batch, like: Tensor) -> Tensor | None:
    """``(B, N, 1)`` weights of the real tokens (HF's ``attention_mask``), or None (every token counts)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if mask is None or tuple(mask.shape) != tuple(like.shape[:2]):
        return None
    return mask.to(like.dtype)[..., None]


def squared_errors(student: Tensor, target: Tensor, weights: Tensor | None) -> tuple[Tensor, Tensor]:
    """``(sum ||student - target||^2, sum ||target||^2)`` over the weighted tokens, in fp32."""
    diff = (student.float() - target.float()) ** 2
    norm = target.float() ** 2
    if weights is not None:
        diff, norm = diff * weights, norm * weights
    return diff.sum(), norm.sum()


def layer_errors(
    model: nn.Module, layers: Sequence[Layer], samples: Sequence[Batch], set_edits: Callable[[bool], None] | None
) -> list[float]:
    """Each layer's relative error over ``samples``: the model as it is (activation and edits) against softmax."""
    sums = torch.zeros(len(layers), 2, dtype=torch.float64)
    with quiet(model):
        for batch in samples:
            if set_edits is not None:
                set_edits(False)
            calls = record(model, layers, batch)
            if set_edits is not None:
                set_edits(True)
            with torch.no_grad():
                for index, layer in enumerate(layers):
                    for call in calls[index]:
                        error, norm = squared_errors(
                            layer_output(layer, call), call.target, token_weights(batch, call.target)
                        )
                        sums[index] += torch.stack([error, norm]).double().cpu()
    return (sums[:, 0] / sums[:, 1].clamp_min(1e-30)).tolist()


__all__ = [
    "Batch",
    "Call",
    "Layer",
    "activation",
    "layer_errors",
    "layer_output",
    "quiet",
    "record",
    "run_model",
    "squared_errors",
    "token_weights",
]
