"""The report's statistics against numbers worked out by hand and Student's t quantiles against tables and closed
forms (scipy is not a dependency: the quantile is computed by the project)."""

from __future__ import annotations

import math

import pytest

from polyattn_lightning.grids.stats import (
    incomplete_beta,
    mean,
    paired_difference,
    std,
    summarize,
    t_quantile,
)

#: t(0.975, df), the two-sided 95% quantiles (printed tables give 12.706, 4.303, 3.182, 2.776, 2.571...), here to
#: 14 digits from mpmath's incomplete beta at 30-digit precision.
T_975 = {
    1: 12.706204736175,
    2: 4.3026527297495,
    3: 3.1824463052837,
    4: 2.7764451051978,
    5: 2.5705818356363,
    9: 2.2621571627982,
    10: 2.2281388519863,
    29: 2.0452296421327,
    30: 2.0422724563012,
    100: 1.9839715185236,
}


@pytest.mark.parametrize("df", sorted(T_975))
def test_t_quantile_matches_the_table(df):
    assert t_quantile(0.975, df) == pytest.approx(T_975[df], rel=1e-10)


def test_other_levels_and_the_symmetry():
    assert t_quantile(0.95, 5) == pytest.approx(2.015048373333, rel=1e-10)
    assert t_quantile(0.995, 4) == pytest.approx(4.60409487135, rel=1e-10)
    assert t_quantile(0.025, 3) == pytest.approx(-T_975[3], rel=1e-10)
    assert t_quantile(0.5, 7) == 0.0


@pytest.mark.parametrize("p", [0.55, 0.7, 0.9, 0.975, 0.999, 0.3, 0.01])
def test_t_quantile_against_closed_forms(p):
    """df 1 is Cauchy: tan(pi (p - 1/2)); df 2: (2p - 1) / sqrt(2 p (1 - p)); df 4's distribution function is
    1/2 + t (t^2 + 6) / (2 (t^2 + 4)^(3/2))."""
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-11)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) / math.sqrt(2 * p * (1 - p)), rel=1e-11)
    t = t_quantile(p, 4)
    assert 0.5 + t * (t * t + 6) / (2 * (t * t + 4) ** 1.5) == pytest.approx(p, abs=1e-14)


def test_incomplete_beta_against_closed_forms():
    for x in (0.001, 0.2, 0.5, 0.77, 0.999):
        assert incomplete_beta(2.5, 1.0, x) == pytest.approx(x**2.5, rel=1e-13)
        assert incomplete_beta(1.0, 3.0, x) == pytest.approx(1 - (1 - x) ** 3, rel=1e-13)
        assert incomplete_beta(0.5, 0.5, x) == pytest.approx(2 / math.pi * math.asin(math.sqrt(x)), rel=1e-13)
        assert incomplete_beta(4.0, 7.5, x) + incomplete_beta(7.5, 4.0, 1 - x) == pytest.approx(1.0, abs=1e-14)


def test_bad_quantile_arguments_are_refused():
    with pytest.raises(ValueError, match="0 < p < 1 and df > 0"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="0 < p < 1 and df > 0"):
        t_quantile(0.975, 0)


def test_three_seeds_by_hand():
    """0.90, 0.93, 0.96: mean 0.93, deviations -0.03, 0, 0.03, s = sqrt(0.0018 / 2) = 0.03, and the 95% interval
    0.93 ± 4.303 * 0.03 / sqrt(3) = 0.93 ± 0.07453."""
    summary = summarize([0.90, 0.93, 0.96])
    assert summary.n == 3
    assert summary.mean == pytest.approx(0.93, abs=1e-15)
    assert summary.std == pytest.approx(0.03, abs=1e-15)
    assert summary.t == pytest.approx(4.303, abs=5e-4)
    assert summary.low == pytest.approx(0.93 - 0.07453, abs=1e-4)
    assert summary.high == pytest.approx(0.93 + 0.07453, abs=1e-4)
    assert summary.half_width == pytest.approx(summary.t * 0.03 / math.sqrt(3), rel=1e-12)


def test_one_seed_has_no_spread_and_no_interval():
    summary = summarize([0.91])
    assert (summary.n, summary.mean) == (1, 0.91)
    assert summary.std is None and summary.low is None and summary.high is None and summary.t is None
    assert summary.half_width is None
    with pytest.raises(ValueError, match="2 values or more"):
        std([0.91])
    with pytest.raises(ValueError, match="no values"):
        mean([])


def test_paired_difference_by_hand():
    """Differences 0.02, 0.01, 0.03: mean 0.02, s 0.01, interval 0.02 ± 4.303 * 0.01 / sqrt(3) = 0.02 ± 0.02484,
    much narrower than the unpaired groups' intervals (the seeds move both groups alike)."""
    group = {"seed1": 0.95, "seed2": 0.91, "seed3": 0.97}
    baseline = {"seed1": 0.93, "seed2": 0.90, "seed3": 0.94}
    paired = paired_difference(group, baseline)
    assert paired.seeds == ("seed1", "seed2", "seed3")
    assert paired.differences == pytest.approx((0.02, 0.01, 0.03), abs=1e-15)
    assert paired.summary.mean == pytest.approx(0.02, abs=1e-15)
    assert paired.summary.std == pytest.approx(0.01, abs=1e-15)
    assert (paired.summary.low, paired.summary.high) == pytest.approx((0.02 - 0.02484, 0.02 + 0.02484), abs=1e-5)
    assert paired.summary.half_width < summarize(list(group.values())).half_width / 2


def test_paired_difference_uses_only_the_seeds_both_finished():
    paired = paired_difference({"seed1": 0.95, "seed3": 0.97}, {"seed1": 0.93, "seed2": 0.90, "seed3": 0.94})
    assert paired.seeds == ("seed1", "seed3")
    assert paired.differences == pytest.approx((0.02, 0.03), abs=1e-15)
    assert paired.only_group == () and paired.only_baseline == ("seed2",)
    assert paired.summary.t == pytest.approx(T_975[1], rel=1e-10)  # two pairs: one degree of freedom
    none = paired_difference({"seed1": 0.9}, {"seed2": 0.8})
    assert none.summary is None and none.only_group == ("seed1",) and none.only_baseline == ("seed2",)
