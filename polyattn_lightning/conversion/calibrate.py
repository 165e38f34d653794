"""``method="calibrate"``: one temperature per head from a grid, folded into the query rows (the cheap baseline).

Why: a model pretrained with softmax has scores far from 0 (all-MiniLM-L6-v2: ``|S|`` up to ~45 in its first
layer), which softmax tolerates (it is shift-invariant and bounded) but ``S^3 / sqrt(N)`` does not: the first
layers' outputs grow by orders of magnitude and the pretrained features are lost at the switch. ``phi(t S)`` is
the same activation on scores ``t`` times smaller, so a temperature per head can make each switched layer start
closer to what softmax computed.

How: from what every layer attends in softmax forwards of the samples (the teacher's own inputs to each layer,
:func:`~.teacher.record`), each head's ``t`` is the value on :data:`TEMPERATURES` (a log grid, ``1`` included)
whose output ``phi(t S) v`` is nearest, in least squares summed over the samples' tokens, to the softmax output
``softmax(S) v``; ``t`` at the grid's low end means the activation does no better there than dropping the
head's attention. ``t`` is folded into the head's query rows (weight and bias, or a per-head q-norm slice:
:func:`~.folding.scale_queries`), so checkpoints, ``save_pretrained`` and DDP carry it with the weights.

It cannot change a head's pattern for x^p, relu and poly1 (``phi(t S) = t^p phi(S)``: only the head's output
scale): that is what ``method="transfer"`` trains. What it keeps on the tiny Llama, against no calibration and the
transfer: docs/benchmarks/conversion.md.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from ..attention.registry import ActivationSpec
from ..attention.switch import AttentionInputs, attention_map
from ..errors import ConfigError
from .folding import Edits, Factor, Projections, scale_queries
from .teacher import Batch, Layer, quiet, record

#: The temperatures tried per head: 10^-3 .. 10 in steps of 10^0.05 (12% apart), 1 among them.
TEMPERATURES = torch.logspace(-3, 1, 81, dtype=torch.float64)


def temperature_errors(inputs: AttentionInputs, activation: ActivationSpec) -> Tensor:
    """Per grid temperature and head, ``||phi(t S) v - softmax(S) v||^2``; fp64 ``(temperatures, heads)``."""
    v = inputs.v.double()
    target = attention_map(inputs, "softmax").double() @ v
    return torch.stack(
        [
            ((attention_map(inputs._replace(temperature=inputs.temperature * float(t)), activation).double() @ v)
             - target).pow(2).sum(dim=(0, 2, 3))
            for t in TEMPERATURES
        ]
    )  # fmt: skip


def best_temperatures(inputs: AttentionInputs, activation: ActivationSpec) -> Tensor:
    """Per head, the grid temperature whose ``phi(t S) v`` is nearest to ``softmax(S) v``; fp64 ``(H,)``."""
    return TEMPERATURES[temperature_errors(inputs, activation).argmin(dim=0)]


def calibrate(
    model: nn.Module,
    layers: Sequence[Layer],
    projections: Sequence[Projections],
    activation: ActivationSpec,
    samples: Sequence[Batch],
    edits: Edits,
) -> list[Tensor]:
    """Fit every layer's temperatures on ``samples`` and put them on its queries as ``edits`` (folded by the
    caller); returns them, one fp64 ``(H,)`` per layer. Every refusal is raised before a weight changes."""
    for found in projections:
        if found.temperature_refusal is not None:
            raise ConfigError(f"convert: {found.temperature_refusal}, so a per-head temperature cannot be folded")
    errors: list[Tensor | None] = [None] * len(layers)

    def add(index: int, inputs: AttentionInputs) -> None:
        grid = temperature_errors(inputs, activation)
        errors[index] = grid if errors[index] is None else errors[index] + grid

    with quiet(model):
        for batch in samples:
            record(model, layers, batch, capture=add)
    missing = [layer.name for layer, e in zip(layers, errors) if e is None]
    if missing:
        raise ConfigError(f"calibrate: {', '.join(missing)} attended nothing in the samples' forwards")
    temperatures = [TEMPERATURES[e.argmin(dim=0)] for e in errors]
    for found, t in zip(projections, temperatures):
        scale_queries(edits, found, Factor(t, positive=True, trainable=False))
    return temperatures


__all__ = ["TEMPERATURES", "best_temperatures", "calibrate", "temperature_errors"]
