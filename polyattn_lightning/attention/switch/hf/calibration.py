"""Calibrate a pretrained softmax HF model for its new activation: one temperature per head, in the query weights.

Why: a model pretrained with softmax has scores far from 0 (all-MiniLM-L6-v2: ``|S|`` up to ~45 in its first
layer), which softmax tolerates (it is shift-invariant and bounded) but ``S^3 / sqrt(N)`` does not: the first
layers' outputs grow by orders of magnitude, the pretrained features are lost at the switch and the fine-tune
does not learn (configs/README.md). ``phi(t S)`` is the same activation on scores ``t`` times smaller, so a
temperature ``t`` per head can make each switched layer start close to what softmax computed.

How (:func:`fold_temperatures`): from what every layer attended in one softmax forward of a probe batch
(recorded by :func:`polyattn_lightning.attention.switch.hf.set_attention`), each head's ``t`` is the value on
:data:`TEMPERATURES` (a log grid, ``1`` included) whose output ``phi(t S) v`` is nearest, in least squares over
the probe's tokens, to the softmax output ``softmax(S) v``; ``t`` at the grid's low end means the activation
does no better there than dropping the head's attention. ``t`` is then folded into the head's rows of the query
projection (weight and bias: ``q -> t q``, so ``S -> t S``), so checkpoints, ``save_pretrained`` and DDP carry
it with the weights and nothing else needs to know. Every layer is fitted on the softmax model's own inputs to
it (one forward, not layer after layer).

Run it once, on pretrained weights: the calibrated model switched back to softmax is softmax at the new
temperatures, not the pretrained model.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ....errors import ConfigError
from ...registry import ActivationSpec
from ..base import AttentionInputs, attention_map

#: The temperatures tried per head: 10^-3 .. 10 in steps of 10^0.05 (12% apart), 1 among them.
TEMPERATURES = torch.logspace(-3, 1, 81, dtype=torch.float64)
#: Attribute names of a separate query projection (BERT/RoBERTa/ViT, Llama/Mistral/Qwen2, DistilBERT).
QUERY_PROJECTIONS = ("query", "q_proj", "q_lin")
#: Normalisations between the projection and the scores, which would undo a scaled projection (Qwen3, OLMo...).
QUERY_NORMS = ("q_norm", "query_norm", "q_layernorm")


def fold_temperatures(
    modules: list[nn.Module], recorded: Mapping[int, AttentionInputs], activation: ActivationSpec
) -> list[Tensor]:
    """Scale each head's query rows of every module in ``modules`` by its best temperature; returns them, one
    fp64 ``(H,)`` per module. ``recorded``: what each module (by ``id``) attended with softmax.

    Raises :class:`ConfigError` before any weight changes when a module was not recorded or has no query
    projection to scale.
    """
    folds = []
    for module in modules:
        if id(module) not in recorded:
            raise ConfigError(f"calibrate: {type(module).__name__} was not called in the probe forward")
        inputs = recorded[id(module)]
        projection = _query_projection(module, heads=inputs.q.shape[1], head_dim=inputs.q.shape[-1])
        folds.append((projection, best_temperatures(inputs, activation)))
    with torch.no_grad():
        for projection, t in folds:
            heads = t.to(projection.weight)
            projection.weight.view(len(t), -1, projection.in_features).mul_(heads[:, None, None])
            if projection.bias is not None:
                projection.bias.view(len(t), -1).mul_(heads[:, None])
    return [t for _, t in folds]


def best_temperatures(inputs: AttentionInputs, activation: ActivationSpec) -> Tensor:
    """Per head, the grid temperature whose ``phi(t S) v`` is nearest to ``softmax(S) v``; fp64 ``(H,)``."""
    v = inputs.v.double()
    target = attention_map(inputs, "softmax").double() @ v
    errors = torch.stack(
        [
            (
                (
                    attention_map(inputs._replace(temperature=inputs.temperature * float(t)), activation).double() @ v
                    - target
                )
                ** 2
            ).sum(dim=(0, 2, 3))
            for t in TEMPERATURES
        ]
    )  # (temperatures, heads)
    return TEMPERATURES[errors.argmin(dim=0)]


def _query_projection(module: nn.Module, heads: int, head_dim: int) -> nn.Linear:
    """The module's own query projection (``heads * head_dim`` outputs), with no normalisation after it."""
    name = type(module).__name__
    norms = [norm for norm in QUERY_NORMS if getattr(module, norm, None) is not None]
    if norms:
        raise ConfigError(
            f"calibrate: {name} normalises its queries ({norms[0]}), which would undo temperatures "
            "folded into its query projection; switch it without calibrate"
        )
    for attribute in QUERY_PROJECTIONS:
        projection = getattr(module, attribute, None)
        if isinstance(projection, nn.Linear) and projection.out_features == heads * head_dim:
            return projection
    raise ConfigError(
        f"calibrate: {name} has no separate query projection (one of {', '.join(QUERY_PROJECTIONS)}: "
        f"an nn.Linear with {heads} x {head_dim} outputs) to fold temperatures into; switch it without "
        "calibrate"
    )


__all__ = ["QUERY_PROJECTIONS", "TEMPERATURES", "best_temperatures", "fold_temperatures"]
