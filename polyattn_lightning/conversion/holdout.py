"""The samples a transfer does not train on: the held-out part whose layer error stops it, and whether it can judge.

:func:`split` holds out a fraction of the samples, row by row, spread evenly through them (with ``holdout`` 0.25:
the 4th, 8th, 12th... sample, counted across batches in order), so every batch gives both parts a share and the
split is the same on every run and every rank. A batch is a tensor (timm) or a mapping of tensors (HF): a row is
the slice of every tensor whose first dimension is the batch's; other values (a flag, a shared tensor) go to both
parts as they are.

:func:`judgement` says in words when the held-out part cannot judge what the transfer does on samples it has not
seen: too few held-out samples (fewer than :data:`MIN_HELD_OUT`), or held-out samples that repeat training ones
(the same tokens, or inputs within :data:`DUPLICATE_DISTANCE` of one another, relatively), so that their error
is the training error again. :func:`gap` says, once the transfer has trained, when its training samples were too
few or too alike for what it trains: the converted layers' median error on the held-out samples is more than
:data:`GAP` times that on the samples they trained on, so what they learnt holds on those samples, not beyond.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from ..errors import ConfigError
from .teacher import Batch

#: Fewer held-out samples than this make the held-out error too noisy to judge.
MIN_HELD_OUT = 8
#: Two inputs this close (``||a - b|| <= DUPLICATE_DISTANCE * ||b||``) are the same sample.
DUPLICATE_DISTANCE = 1e-3
#: Above this fraction of held-out samples repeating training ones, the held-out error is the training error again.
DUPLICATE_FRACTION = 0.25
#: Above this ratio of the held-out to the training layer error (medians over the layers), too few samples trained.
GAP = 2.0


def rows(batch: Batch) -> int:
    """The samples in ``batch``: the first dimension of the tensor (a mapping's first tensor)."""
    first = next((v for v in batch.values() if isinstance(v, Tensor)), None) if isinstance(batch, Mapping) else batch
    if first is None or first.ndim == 0:
        raise ConfigError("convert: a batch of samples holds no tensor with a batch dimension")
    return int(first.shape[0])


def take(batch: Batch, index: Tensor) -> Batch:
    """The rows ``index`` of ``batch`` (every tensor sliced along its batch dimension)."""
    if not isinstance(batch, Mapping):
        return batch[index]
    count = rows(batch)
    return {
        key: value[index] if isinstance(value, Tensor) and value.ndim and value.shape[0] == count else value
        for key, value in batch.items()
    }


def split(samples: Sequence[Batch], holdout: float) -> tuple[list[Batch], list[Batch]]:
    """``(train, held_out)``: ``floor(holdout * samples)`` samples held out, evenly spread (module docstring); a
    batch left with no row in a part is not in that part."""
    train, held_out, seen = [], [], 0
    for batch in samples:
        count = rows(batch)
        index = torch.arange(seen, seen + count)
        mask = torch.floor((index + 1) * holdout) > torch.floor(index * holdout)
        seen += count
        for part, chosen in ((train, ~mask), (held_out, mask)):
            if chosen.all():
                part.append(batch)
            elif chosen.any():
                part.append(take(batch, chosen.nonzero().flatten()))
    return train, held_out


def _inputs(batch: Batch) -> list[Tensor]:
    """Each sample of ``batch`` as one flat fp64 vector: its slice of every batched tensor, only its real tokens
    where the batch has an ``attention_mask``."""
    count = rows(batch)
    values = [batch] if not isinstance(batch, Mapping) else [
        batch[key] for key in sorted(batch)
        if isinstance(batch[key], Tensor) and batch[key].ndim and batch[key].shape[0] == count
    ]  # fmt: skip
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    out = []
    for row in range(count):
        parts = []
        for value in values:
            part = value[row]
            if mask is not None and part.ndim and part.shape[0] == mask.shape[1]:
                part = part[mask[row].bool()]
            parts.append(part.detach().flatten().double().cpu())
        out.append(torch.cat(parts))
    return out


def repeated(train: Sequence[Batch], held_out: Sequence[Batch]) -> int:
    """How many held-out samples repeat a training sample (within :data:`DUPLICATE_DISTANCE`)."""
    by_size: dict[int, list[Tensor]] = {}
    for batch in train:
        for vector in _inputs(batch):
            by_size.setdefault(vector.numel(), []).append(vector)
    stacked = {size: torch.stack(vectors) for size, vectors in by_size.items()}
    count = 0
    for batch in held_out:
        for vector in _inputs(batch):
            others = stacked.get(vector.numel())
            if others is None:
                continue
            distance = (others - vector).norm(dim=1).min()
            count += bool(distance <= DUPLICATE_DISTANCE * vector.norm())
    return count


def judgement(train: Sequence[Batch], held_out: Sequence[Batch], holdout: float) -> list[str]:
    """Why the held-out error cannot judge the transfer, one sentence each (none: it can)."""
    total = sum(rows(b) for b in train) + sum(rows(b) for b in held_out)
    kept = sum(rows(b) for b in held_out)
    if holdout == 0:
        return []
    if kept < MIN_HELD_OUT:
        return [
            f"convert: only {kept} of {total} samples held out (holdout {holdout:g}), fewer than {MIN_HELD_OUT}: "
            f"too few to judge the transfer on samples it has not seen (its stop and its held-out error are noise); "
            f"give at least {math.ceil(MIN_HELD_OUT / holdout)} samples"
        ]
    twins = repeated(train, held_out)
    if twins > DUPLICATE_FRACTION * kept:
        return [
            f"convert: {twins} of the {kept} held-out samples repeat training samples: too alike to judge the "
            f"transfer on samples it has not seen (their error is the training error again); give distinct samples"
        ]
    return []


def gap(trained: Sequence[float], held_out: Sequence[float]) -> list[str]:
    """The warning when the layers' errors on the held-out samples (``held_out``, one per layer) are, in their
    median, more than :data:`GAP` times those on the samples they trained on (``trained``); none when not."""
    on_train, on_held_out = statistics.median(trained), statistics.median(held_out)
    if not on_held_out > GAP * on_train:
        return []
    return [
        f"convert: the converted layers' median error is {on_held_out:.3g} on the held-out samples, "
        f"{on_held_out / on_train:.1f} times the {on_train:.3g} on those they trained on: too few or too alike samples "
        f"for what the transfer trains (it fits them, not inputs it has not seen); give more, and more varied, samples"
    ]


__all__ = [
    "DUPLICATE_DISTANCE",
    "DUPLICATE_FRACTION",
    "GAP",
    "MIN_HELD_OUT",
    "gap",
    "judgement",
    "repeated",
    "rows",
    "split",
]
