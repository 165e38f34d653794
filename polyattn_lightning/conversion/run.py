"""One conversion, :func:`convert`: switch the model, find its attention layers, run the method, fold its edits,
report (the package's docstring describes the methods)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from ..attention.registry import ActivationSpec, get_activation
from ..attention.switch import AttentionInputs, attention_modules, set_attention
from ..errors import ConfigError, check_options
from .calibrate import calibrate
from .folding import Edits, Projections, find_projections, fold, library_class
from .holdout import gap, judgement, rows, split
from .recipe import METHODS, OPTIONS
from .report import ConversionReport
from .teacher import Batch, Layer, layer_errors, quiet, record
from .transfer import Progress, Student, TransferOptions


def convert(
    model: nn.Module, spec: ActivationSpec, samples: Iterable[Batch], method: str = "transfer", **options: Any
) -> ConversionReport:
    """Switch ``model`` to ``spec`` and convert it in place on ``samples`` (the methods:
    :mod:`polyattn_lightning.conversion`).

    ``options`` are ``transfer``'s (:class:`~.transfer.TransferOptions`: ``qk``, ``rank``, ``lr``, ``steps``,
    ``patience``, ``min_delta``, ``holdout``, ``check_every``, ``layers_per_pass``, ``seed``, ``bias``); an
    unknown one is refused in one line naming them all. A transfer trains on all but ``holdout`` of the samples and
    stops on the others' layer error; it warns (and the report keeps the warning) when they are too few or too
    like the training ones to judge it, when it reached ``steps`` still improving, and when the converted layers
    fit the samples they trained on far better than the held-out ones (too few samples for what it trains). Refusals
    (:class:`ConfigError`: a module whose projections a method cannot edit, a temperature that cannot fold) come
    before any weight changes.

    Example:
        A small timm ViT (softmax, as a pretrained one would be) converted to x^3 by attention transfer on 32 images
        in 4 batches (a quarter held out to stop on), for at most 40 steps; each layer's error falls:

        >>> import timm, torch
        >>> from polyattn_lightning import convert
        >>> _ = torch.manual_seed(0)
        >>> model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=10)
        >>> batches = [torch.randn(8, 3, 32, 32) for _ in range(4)]
        >>> report = convert(model, "poly3", batches, method="transfer", steps=40)
        >>> report.layers
        ['blocks.0.attn', 'blocks.1.attn']
        >>> all(after < before for after, before in zip(report.error_after, report.error_before))
        True
    """
    begin = time.perf_counter()
    check_options(OPTIONS, options, "convert")
    if method not in METHODS:
        raise ConfigError(f"convert: method {method!r} is not one of {', '.join(METHODS)}")
    if options and method != "transfer":
        raise ConfigError(f"convert: {', '.join(sorted(options))} are options of method=transfer, not {method}")
    transfer_options = TransferOptions(**options)
    get_activation(spec)
    samples = list(samples)
    if not samples:
        raise ConfigError("convert: samples is empty; give at least one batch of the model's inputs")
    count = sum(rows(batch) for batch in samples)
    set_attention(model, spec, probe=_probe(model, samples[0]))
    layers, projections = attention_layers(model, samples[0], need_projections=method != "none")
    report: dict[str, Any] = {"transfer": {}, "warnings": []}
    held_out: list[Batch] = []
    judged: list[str] = []  # why the held-out part cannot judge the transfer (none: it can)
    progress = Progress(len(layers), transfer_options)
    if method == "transfer":
        samples, held_out = split(samples, transfer_options.holdout)
        judged = judgement(samples, held_out, transfer_options.holdout)
        report["warnings"] = list(judged)
        for warning in judged:
            rank_zero_warn(warning)
        kept = sum(rows(batch) for batch in held_out)
        judge = f"stopping on the layer error of {kept} held out" if kept else "none held out"
        progress.say(
            f"convert transfer: {len(layers)} layers on {count - kept} samples, {judge}, checked every "
            f"{transfer_options.check_every} steps, at most {transfer_options.steps} steps"
        )
    elif method == "calibrate":
        rank_zero_info(
            f"convert calibrate: {len(layers)} layers on {count} samples, a temperature per head from a grid"
        )
    before = layer_errors(model, layers, samples, None)
    edits = Edits()
    if method == "calibrate":
        report["temperatures"] = [t.tolist() for t in calibrate(model, layers, projections, spec, samples, edits)]
    elif method == "transfer":
        progress.phase("the closed-form start of each head's factor")
        student = Student(model, layers, projections, spec, transfer_options, samples)
        edits = student.edits
        progress.phase("the layer errors at that start")
        report["error_start"] = layer_errors(model, layers, samples, edits.set_enabled)
        result = student.fit(samples, held_out, progress)
        report.update(gains=result.gains, temperatures=result.temperatures)
        report["transfer"] = {
            **{k: v for k, v in asdict(result).items() if k not in ("gains", "temperatures")},
            "qk": transfer_options.qk,
            "rank": transfer_options.rank,
        }
        if result.stopped == "steps":
            report["warnings"].append(
                f"convert: the transfer reached its step cap (steps {transfer_options.steps}) with its "
                f"{'held-out error' if held_out else 'training loss'} still falling; give more steps"
            )
            rank_zero_warn(report["warnings"][-1])
        progress.phase(
            f"the converted layers' errors on the {'training and held-out' if held_out else 'training'} samples"
        )
    # against the teacher's own weights (the edits off): folded, the softmax model is no longer the teacher
    after = layer_errors(model, layers, samples, edits.set_enabled) if edits.edits else before
    if held_out:
        report["error_held_out"] = layer_errors(model, layers, held_out, edits.set_enabled)
        if not judged:  # a held-out part that cannot judge cannot say this either
            for warning in gap(after, report["error_held_out"]):
                report["warnings"].append(warning)
                rank_zero_warn(warning)
    fold(edits)
    return ConversionReport(
        method=method,
        activation=spec if isinstance(spec, (str, dict)) else str(spec),
        layers=[layer.name for layer in layers],
        error_before=before,
        error_after=after,
        samples=count,
        held_out=sum(rows(batch) for batch in held_out),
        seconds=time.perf_counter() - begin,
        **report,
    )


def _probe(model: nn.Module, batch: Batch):
    """set_attention's probe: the batch's keyword arguments for an HF model, a forward on it for a timm one."""
    return dict(batch) if isinstance(batch, Mapping) else (lambda: model(batch))


def attention_layers(
    model: nn.Module, batch: Batch, need_projections: bool = True
) -> tuple[list[Layer], list[Projections]]:
    """Every switched attention layer of ``model`` and, when a method edits them, its projections (heads and
    head size read from what it attends in a softmax forward of ``batch``: the size of what a query row holds, or,
    for attention over channels, the channels per head, the rows attended)."""
    modules = attention_modules(model)
    layers = [Layer(name, module) for name, module in modules]
    shapes: dict[int, AttentionInputs] = {}
    with quiet(model):
        record(model, layers, batch, capture=lambda index, inputs: shapes.setdefault(index, inputs))
    projections = []
    for index, layer in enumerate(layers):
        if index not in shapes:
            raise ConfigError(f"convert: {layer.name} ({library_class(layer.module)}) attended nothing on the samples")
        q = shapes[index].q
        head_dim = q.shape[-2] if getattr(layer.module, "map_layout", "tokens") == "channels" else q.shape[-1]
        try:
            found = find_projections(model, layer.module, heads=q.shape[1], head_dim=head_dim)
        except ConfigError:
            if need_projections:
                raise
            continue  # method=none compares the module's own output
        layer.outer_output = found.outer_output
        projections.append(found)
    return layers, projections


__all__ = ["attention_layers", "convert"]
