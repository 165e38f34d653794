"""A numerical check of "Attention is a smoothed cubic spline" (Lai, Lim, Liu, 2024).

With ``phi = relu``, an attention layer ``x -> proj(relu(q k^T t) v)`` (q, k, v
linear in x; no LayerNorm, which is not polynomial) is a cubic spline of its
input: on each region where the sign pattern of the scores is fixed, ``S`` is
quadratic in ``x``, ``relu(S)`` equals ``S`` or 0, and times ``v`` (linear) the
output is a polynomial of degree at most 3. With ``phi = S^p`` it is one
polynomial of degree ``2p + 1``; with softmax it is no polynomial at all.

:func:`polynomial_degree` tests this along random lines ``x0 + s u`` through
input space, in float64: on windows of ``m + 1`` equally spaced points that lie
inside one piece (the relu pattern of the scores does not change anywhere in
the window, checked on a finer grid), the relative ``m``-th finite difference
``|sum_j (-1)^(m-j) C(m,j) f(s_j)| / sum_j C(m,j) |f(s_j)|`` vanishes (to
rounding) exactly when ``f`` is a polynomial of degree below ``m`` there.
The degree is the smallest ``m - 1`` whose differences are all below ``tol``.
"""

from __future__ import annotations

import copy
import math
from typing import NamedTuple

import torch
from torch import Tensor, nn

from ..attention.switch.base import SwitchedAttention

#: Window spacings tried, largest first: a window shrinks until it fits inside one relu piece.
STEPS = (0.25, 0.1, 0.04, 0.016)
#: Points per window interval at which the relu pattern is checked.
PATTERN_CHECKS = 16


class SplineReport(NamedTuple):
    """What :func:`polynomial_degree` found."""

    degree: int | None  # smallest degree consistent with every window; None: none up to max_order - 1
    relative_differences: dict[int, float]  # order m -> largest relative m-th difference over the windows
    windows: int  # windows used per order
    skipped: int  # window starts where no spacing fit inside one relu piece


def _check_polynomial_parts(module: nn.Module) -> None:
    """Refuse modules with a LayerNorm-like part (q/k norm, output norm): they are not polynomial."""
    for name, part in module.named_modules():
        if isinstance(part, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or (
            name.split(".")[-1] in ("q_norm", "k_norm", "norm") and not isinstance(part, nn.Identity)
        ):
            raise ValueError(
                f"{type(module).__name__}.{name} is a {type(part).__name__}: normalisation is not "
                "polynomial, so the spline check needs an attention module without it"
            )


def _difference(values: Tensor, order: int) -> float:
    """Relative ``order``-th forward difference of the rows of ``values`` ``(order + 1, outputs)``."""
    coeffs = torch.tensor([(-1) ** (order - j) * math.comb(order, j) for j in range(order + 1)], dtype=values.dtype)
    scale = (coeffs.abs()[:, None] * values.abs()).sum()
    return float((coeffs[:, None] * values).sum(0).abs().max() / scale.clamp(min=torch.finfo(values.dtype).tiny))


def polynomial_degree(
    module: nn.Module,
    tokens: int = 4,
    lines: int = 4,
    starts: int = 12,
    max_order: int = 9,
    tol: float = 1e-8,
    input_scale: float = 3.0,
    seed: int = 0,
) -> SplineReport:
    """The polynomial degree of a switched attention module (ViT-style ``(B, N, C)`` in and out) on its pieces.

    Args:
        module: an attention module with the ``capture`` hook (e.g. ``timm.layers.Attention`` switched with
            ``set_attention``); it is copied and run in float64 and eval mode.
        tokens: sequence length of the random inputs.
        lines: random lines ``x0 + s u`` (``x0``, ``u`` standard normal times ``input_scale``).
        starts: window starts per line, ``s0`` in [-1, 1).
        max_order: highest finite-difference order tried.
        tol: a relative difference below it counts as zero.
    """
    if not isinstance(module, SwitchedAttention):
        raise TypeError(f"{type(module).__name__} is not a switched attention module (set_attention switches timm's)")
    _check_polynomial_parts(module)
    module = copy.deepcopy(module).double().eval()
    dim = next(m for m in module.modules() if isinstance(m, nn.Linear)).in_features
    kinks = module.activation.name == "relu"  # the registry's only activation with breakpoints
    scores: list[Tensor] = []

    def keep_pattern(_: nn.Module, inputs) -> None:
        s = inputs.q @ inputs.k.transpose(-2, -1) * inputs.temperature
        scores.append(s if inputs.attn_bias is None else s + inputs.attn_bias)

    module.capture = keep_pattern
    generator = torch.Generator().manual_seed(seed)
    worst = {order: 0.0 for order in range(1, max_order + 1)}
    windows = skipped = 0

    @torch.no_grad()
    def evaluate(x0: Tensor, u: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
        """Outputs ``(len(s), outputs)`` and relu patterns ``(len(s), scores)`` at the points ``x0 + s u``."""
        scores.clear()
        out = module(x0 + s[:, None, None] * u)
        return out.flatten(1), torch.cat(scores).flatten(1) > 0

    for _ in range(lines):
        x0, u = (input_scale * torch.randn(1, tokens, dim, generator=generator, dtype=torch.float64) for _ in range(2))
        for s0 in torch.linspace(-1, 1, starts + 1, dtype=torch.float64)[:-1]:
            for order in range(1, max_order + 1):
                for step in STEPS:
                    fine = s0 + step * torch.linspace(0, order, order * PATTERN_CHECKS + 1, dtype=torch.float64)
                    values, pattern = evaluate(x0, u, fine)
                    if not kinks or bool((pattern == pattern[0]).all()):
                        worst[order] = max(worst[order], _difference(values[::PATTERN_CHECKS], order))
                        windows += order == 1
                        break
                else:
                    skipped += order == 1
    degree = next((order - 1 for order in range(1, max_order + 1) if worst[order] < tol), None)
    return SplineReport(degree, worst, windows, skipped)
