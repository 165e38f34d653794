"""The statistics of a grid's report: mean, standard deviation and a t-based interval over seeds, paired differences.

A group of cells that differ only in their seed is a small sample (3 seeds, often), so its interval is Student's t
interval, ``mean ± t(1 - alpha/2, n - 1) · s / sqrt(n)`` with the sample standard deviation ``s`` (ddof = 1); with one
value there is no spread to measure and no interval, and the summary says so rather than printing a zero width.

Two groups that ran the same seeds are compared seed by seed: the differences ``group - baseline`` of the seeds both
finished are one sample, summarised the same way. Pairing removes what a seed does to both runs alike (the
initialisation, the data order), so its interval is usually much narrower than the two groups' intervals suggest.

The t quantile is computed here (scipy is not a dependency): Student's distribution function is a regularized
incomplete beta function, evaluated by its continued fraction, and the quantile is found by bisection on it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

#: The interval's confidence level.
LEVEL = 0.95


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of the incomplete beta function (modified Lentz), converging for x < (a+1)/(a+b+2)."""
    tiny, eps = 1e-300, 1e-15
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    fraction = d
    for m in range(1, 100_000):
        for numerator in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            fraction *= c * d
        if abs(c * d - 1.0) < eps:
            return fraction
    raise ArithmeticError(f"incomplete beta continued fraction did not converge for a={a}, b={b}, x={x}")


def incomplete_beta(a: float, b: float, x: float, complement: float | None = None) -> float:
    """The regularized incomplete beta function ``I_x(a, b)`` for ``a, b > 0`` and ``0 <= x <= 1``.

    ``complement`` is ``1 - x`` where the caller knows it more precisely than the subtraction gives it (x near 1).
    """
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"incomplete_beta: x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    y = 1.0 - x if complement is None else complement
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, y) / b


def t_upper_tail(t: float, df: float) -> float:
    """``P(T > t)`` for Student's t with ``df`` degrees of freedom, ``t >= 0``: ``I_{df/(df+t^2)}(df/2, 1/2) / 2``."""
    return 0.5 * incomplete_beta(df / 2.0, 0.5, df / (df + t * t), complement=t * t / (df + t * t))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t with ``df > 0`` degrees of freedom (``t_quantile(0.975, 2)`` = 4.3027...)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile: need 0 < p < 1 and df > 0, got p={p}, df={df}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    tail = 1.0 - p
    low, high = 0.0, 1.0
    while t_upper_tail(high, df) > tail:  # the tail falls as t grows: find a bracket, then halve it
        low, high = high, 2.0 * high
    while high - low > 1e-15 * high:
        middle = 0.5 * (low + high)
        if t_upper_tail(middle, df) > tail:
            low = middle
        else:
            high = middle
    return 0.5 * (low + high)


@dataclass(frozen=True)
class Summary:
    """A sample's mean, sample standard deviation and t interval; ``std``/``low``/``high``/``t`` are None for n = 1."""

    n: int
    mean: float
    std: float | None
    low: float | None
    high: float | None
    t: float | None
    level: float = LEVEL

    @property
    def half_width(self) -> float | None:
        return None if self.t is None else self.high - self.mean


def mean(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("mean of no values")
    return math.fsum(values) / len(values)


def std(values: Sequence[float]) -> float:
    """The sample standard deviation (divisor n - 1); it needs two values or more."""
    if len(values) < 2:
        raise ValueError(f"a sample standard deviation needs 2 values or more, got {len(values)}")
    centre = mean(values)
    return math.sqrt(math.fsum((v - centre) ** 2 for v in values) / (len(values) - 1))


def summarize(values: Sequence[float], level: float = LEVEL) -> Summary:
    """Mean, standard deviation and the ``level`` t interval of ``values`` (no spread and no interval for one value)."""
    values = [float(v) for v in values]
    centre = mean(values)
    n = len(values)
    if n == 1:
        return Summary(1, centre, None, None, None, None, level)
    spread = std(values)
    t = t_quantile(0.5 + level / 2.0, n - 1)
    half = t * spread / math.sqrt(n)
    return Summary(n, centre, spread, centre - half, centre + half, t, level)


@dataclass(frozen=True)
class Paired:
    """``group - baseline`` seed by seed: the seeds both have, their differences' summary (None if none in common),
    and the seeds only one side has."""

    seeds: tuple[str, ...]
    differences: tuple[float, ...]
    summary: Summary | None
    only_group: tuple[str, ...]
    only_baseline: tuple[str, ...]


def paired_difference(group: Mapping[str, float], baseline: Mapping[str, float], level: float = LEVEL) -> Paired:
    """The differences ``group[seed] - baseline[seed]`` over the seeds both have (in ``group``'s order)."""
    seeds = tuple(seed for seed in group if seed in baseline)
    differences = tuple(float(group[seed]) - float(baseline[seed]) for seed in seeds)
    return Paired(
        seeds,
        differences,
        summarize(differences, level) if differences else None,
        tuple(seed for seed in group if seed not in baseline),
        tuple(seed for seed in baseline if seed not in group),
    )
