"""Statistics over seeds for ``meqmuon sweep`` / ``meqmuon compare --seeds N`` (pure Python, float64).

A run's final validation loss depends on its seed (initial weights, data order), so a comparison of
optimizers reports, per optimizer, the mean over ``n`` seeds and a 95 % confidence interval of that
mean, and the *paired* difference against a reference optimizer on the same seeds.

Formulas (``x_1 .. x_n`` the values, ``t = t_{0.975, n-1}`` the Student-t quantile):

* mean ``m = (1/n) sum x_i``; sample standard deviation ``s = sqrt(sum (x_i - m)^2 / (n - 1))``;
* 95 % interval of the mean: ``m +- t * s / sqrt(n)``. Student-t with ``n - 1`` degrees of freedom
  because ``s`` is estimated from the same few seeds: the normal 1.96 would be far too narrow at
  n = 2-5 (``t_{0.975,1} = 12.706``, ``t_{0.975,2} = 4.303``, ``t_{0.975,4} = 2.776``). This assumes
  the seed-to-seed values are roughly normal; with n = 1 there is no estimate of the spread and no
  interval (``None``, shown as "-").
* paired difference against a reference ``r`` on the seeds both have: ``d_i = x_i - r_i`` per seed,
  then the mean and 95 % interval of the ``d_i`` as above (``n`` = number of shared seeds). Pairing
  is right here because seed ``i`` gives both optimizers the same initial weights and the same
  batches, so the part of the loss that comes from the seed cancels in ``d_i``; the paired interval
  is then narrower than what two unpaired intervals would suggest, and it is the one that says
  whether the difference is resolved (an interval that excludes 0).

The t quantiles are *computed*, not tabulated, and scipy is not needed: for an integer number of
degrees of freedom ``nu`` the Student-t distribution function has the closed form of Abramowitz &
Stegun 26.7.3-26.7.4 (a finite sum in ``theta = atan(t / sqrt(nu))``), and the quantile is found by
bisection on it to ~1e-12. ``tests/test_stats.py`` checks it against the printed table values.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Interval", "PairedDifference", "t_cdf_two_sided", "t_critical", "mean_interval", "paired_difference"]


def t_cdf_two_sided(t: float, df: int) -> float:
    """``A(t | df) = P(|T| <= t)`` for Student's ``T`` with integer ``df >= 1`` and ``t >= 0``.

    Abramowitz & Stegun 26.7.3 (odd ``df``) and 26.7.4 (even ``df``), with
    ``theta = atan(t / sqrt(df))``, ``c = cos^2 theta``:

    * odd: ``A = (2/pi) (theta + sin theta cos theta (1 + (2/3) c + (2*4)/(3*5) c^2 + ...
      + (2*4*...*(df-3))/(3*5*...*(df-2)) c^((df-3)/2)))``, only ``(2/pi) theta`` for ``df = 1``;
    * even: ``A = sin theta (1 + (1/2) c + (1*3)/(2*4) c^2 + ... + (1*3*...*(df-3))/(2*4*...*(df-2))
      c^((df-2)/2))``.
    """
    if not isinstance(df, int) or df < 1:
        raise ValueError(f"degrees of freedom must be a positive integer, got {df!r}")
    if not t >= 0:
        raise ValueError(f"t must be >= 0, got {t!r}")
    if math.isinf(t):
        return 1.0
    theta = math.atan(t / math.sqrt(df))
    c = math.cos(theta) ** 2
    if df % 2 == 1:
        total, term = 0.0, 1.0
        if df > 1:
            total = 1.0
            for k in range(1, (df - 3) // 2 + 1):  # term k: (2*4*..*2k)/(3*5*..*(2k+1)) c^k
                term *= c * (2 * k) / (2 * k + 1)
                total += term
        return (2.0 / math.pi) * (theta + math.sin(theta) * math.cos(theta) * total)
    total, term = 1.0, 1.0
    for k in range(1, (df - 2) // 2 + 1):  # term k: (1*3*..*(2k-1))/(2*4*..*2k) c^k
        term *= c * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


def t_critical(df: int, confidence: float = 0.95) -> float:
    """Two-sided critical value ``t_{(1+confidence)/2, df}`` (e.g. 12.706 for ``df=1``, 2.776 for ``df=4``).

    Bisection on :func:`t_cdf_two_sided` (monotone in ``t``) until the bracket is below 1e-12 relative.
    """
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    lo, hi = 0.0, 1.0
    while t_cdf_two_sided(hi, df) < confidence:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf_two_sided(mid, df) < confidence:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-12 * hi:
            break
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class Interval:
    """Mean of ``n`` values and its two-sided t interval (``low``/``high``/``half_width``/``sd`` None for n = 1)."""

    mean: float
    n: int
    sd: float | None
    half_width: float | None
    low: float | None
    high: float | None
    confidence: float = 0.95

    def as_dict(self) -> dict[str, float | int | None]:
        return {"mean": self.mean, "n": self.n, "sd": self.sd, "half_width": self.half_width, "low": self.low,
                "high": self.high, "confidence": self.confidence}


def mean_interval(values: Sequence[float], confidence: float = 0.95) -> Interval:
    """Mean and ``confidence`` t interval of the mean: ``m +- t_{(1+c)/2, n-1} s / sqrt(n)`` (see the module doc).

    Raises ``ValueError`` for no values. Non-finite values are not dropped: they make the mean and the
    interval NaN/inf, which the tables print as such (a diverged run must not vanish from a summary).
    """
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        raise ValueError("no values to summarise")
    m = math.fsum(xs) / n
    if n == 1:
        return Interval(mean=m, n=1, sd=None, half_width=None, low=None, high=None, confidence=confidence)
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_critical(n - 1, confidence) * sd / math.sqrt(n)
    return Interval(mean=m, n=n, sd=sd, half_width=half, low=m - half, high=m + half, confidence=confidence)


@dataclass(frozen=True)
class PairedDifference:
    """``x - reference`` per shared seed (``seeds``, sorted), summarised by :class:`Interval`."""

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    interval: Interval

    def as_dict(self) -> dict[str, object]:
        return {"seeds": list(self.seeds), "differences": list(self.differences), **self.interval.as_dict()}


def paired_difference(values: Mapping[int, float], reference: Mapping[int, float],
                      confidence: float = 0.95) -> PairedDifference:
    """Paired difference ``values[s] - reference[s]`` over the seeds ``s`` both have (module doc: why paired).

    Seeds present in only one of the two are left out (they have no partner). Raises ``ValueError``
    when no seed is shared.
    """
    shared = sorted(set(values) & set(reference))
    if not shared:
        raise ValueError(f"no shared seeds: {sorted(values)} vs reference {sorted(reference)}")
    diffs = tuple(float(values[s]) - float(reference[s]) for s in shared)
    return PairedDifference(seeds=tuple(shared), differences=diffs, interval=mean_interval(diffs, confidence))
