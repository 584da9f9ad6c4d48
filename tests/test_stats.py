"""``meqmuon.train.stats``: t quantiles, mean intervals and paired differences, in float64, by hand.

The expected numbers are written from the formulas, not from the code: the printed Student-t table
(t_{0.975,1} = 12.706, t_{0.975,2} = 4.303, t_{0.975,4} = 2.776, ...), the closed forms of the
quantile for 1 and 2 degrees of freedom (``tan(0.95 pi / 2)`` and ``sqrt(2 A^2 / (1 - A^2))``,
A = 0.95), and means / standard deviations of three-value examples worked out on paper.
"""

from __future__ import annotations

import math

import pytest

from meqmuon.train.stats import mean_interval, paired_difference, t_cdf_two_sided, t_critical

# Two-sided 95 % (0.975 quantile) and 99 % (0.995) values of the printed t table, 3 decimals.
T_TABLE_95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 9: 2.262, 10: 2.228, 29: 2.045, 30: 2.042,
              120: 1.980}
T_TABLE_99 = {1: 63.657, 2: 9.925, 4: 4.604, 10: 3.169}


@pytest.mark.parametrize(("df", "want"), sorted(T_TABLE_95.items()))
def test_t_critical_95_matches_the_printed_table(df, want):
    assert t_critical(df) == pytest.approx(want, abs=5e-4)


@pytest.mark.parametrize(("df", "want"), sorted(T_TABLE_99.items()))
def test_t_critical_99_matches_the_printed_table(df, want):
    assert t_critical(df, 0.99) == pytest.approx(want, abs=5e-4)


def test_t_critical_closed_forms_and_large_df_limit():
    # df = 1 is the Cauchy distribution: P(|T| <= t) = (2/pi) atan(t), so t = tan(0.95 pi / 2).
    assert t_critical(1) == pytest.approx(12.706204736174696, rel=1e-10)
    # df = 2: P(|T| <= t) = t / sqrt(t^2 + 2), so t = sqrt(2 A^2 / (1 - A^2)) with A = 0.95.
    assert t_critical(2) == pytest.approx(math.sqrt(2 * 0.95**2 / (1 - 0.95**2)), rel=1e-10)
    # Large df tends to the normal 1.959964 from above.
    assert 1.959964 < t_critical(5000) < 1.9610
    assert t_cdf_two_sided(0.0, 3) == 0.0 and t_cdf_two_sided(math.inf, 3) == 1.0


def test_t_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="positive integer"):
        t_critical(0)
    with pytest.raises(ValueError, match="positive integer"):
        t_cdf_two_sided(1.0, 2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="confidence"):
        t_critical(3, 1.0)


def test_mean_interval_by_hand():
    # 4.80, 4.90, 5.00: mean 4.9, deviations -0.1, 0, 0.1, s = sqrt(0.02 / 2) = 0.1,
    # half width = t_{0.975,2} * 0.1 / sqrt(3) = 4.302653 * 0.057735 = 0.248414.
    iv = mean_interval([4.80, 4.90, 5.00])
    assert iv.n == 3 and iv.mean == pytest.approx(4.9, abs=1e-12) and iv.sd == pytest.approx(0.1, rel=1e-10)
    assert iv.half_width == pytest.approx(4.302652729749464 * 0.1 / math.sqrt(3), rel=1e-9)
    assert iv.half_width == pytest.approx(0.248414, abs=1e-6)
    assert iv.low == pytest.approx(4.9 - 0.248414, abs=1e-6) and iv.high == pytest.approx(4.9 + 0.248414, abs=1e-6)
    # Two values 1 and 3: mean 2, s = sqrt(2), half = 12.706205 * sqrt(2) / sqrt(2) = 12.706205.
    two = mean_interval([1.0, 3.0])
    assert two.mean == 2.0 and two.half_width == pytest.approx(12.706204736, rel=1e-9)
    # Five values: df = 4, t = 2.776445; 1..5 has mean 3, s = sqrt(10 / 4), half = 2.776445 * sqrt(2.5/5).
    five = mean_interval([5.0, 1.0, 4.0, 2.0, 3.0])
    assert five.half_width == pytest.approx(2.776445105 * math.sqrt(0.5), rel=1e-8)


def test_mean_interval_one_value_has_no_interval_and_empty_is_an_error():
    one = mean_interval([4.25])
    assert (one.mean, one.n, one.sd, one.half_width, one.low, one.high) == (4.25, 1, None, None, None, None)
    with pytest.raises(ValueError, match="no values"):
        mean_interval([])
    # A non-finite value is not dropped: it shows in the mean.
    assert math.isnan(mean_interval([1.0, float("nan")]).mean)


def test_paired_difference_uses_only_shared_seeds_by_hand():
    x = {0: 5.0, 1: 5.2, 2: 5.1}
    ref = {0: 4.9, 1: 5.0, 2: 5.05, 3: 9.0}  # seed 3 has no partner and must not count
    p = paired_difference(x, ref)
    assert p.seeds == (0, 1, 2)
    assert p.differences == pytest.approx((0.1, 0.2, 0.05), abs=1e-12)
    # d = 0.1, 0.2, 0.05: mean 0.116667; squared deviations 0.000278 + 0.006944 + 0.004444 = 0.011667,
    # s = sqrt(0.011667 / 2) = 0.076376; half = 4.302653 * 0.076376 / sqrt(3) = 0.189729.
    assert p.interval.mean == pytest.approx(0.116667, abs=1e-6)
    assert p.interval.sd == pytest.approx(0.076376, abs=1e-6)
    assert p.interval.half_width == pytest.approx(0.189729, abs=1e-6)
    # Unpaired, the same numbers would be judged from two wide intervals; paired, the shared seed
    # effect cancels: a constant offset per seed gives a zero-width interval.
    shifted = paired_difference({s: v + 0.3 for s, v in ref.items()}, ref)
    assert shifted.interval.mean == pytest.approx(0.3, abs=1e-12) and shifted.interval.half_width == pytest.approx(
        0.0, abs=1e-12)
    assert shifted.seeds == (0, 1, 2, 3)


def test_paired_difference_without_shared_seeds_is_an_error():
    with pytest.raises(ValueError, match="no shared seeds"):
        paired_difference({0: 1.0}, {1: 1.0})
