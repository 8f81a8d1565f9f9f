"""The statistics of the in-run search (:mod:`agent.search.tune`).

Blocks of measured steps, the warm-up cut by MSER, and the paired t-interval that
judges a candidate."""

from __future__ import annotations

import math
from statistics import NormalDist



#: Pairs of sub-blocks (best, candidate) after which a candidate may be called slower /
#: faster (or not worth it), and after which it is reverted as not faster beyond noise.
MIN_PAIRS_SLOWER = 2
MIN_PAIRS_FASTER = 3
MAX_PAIRS = 12
#: A gain below this (a fraction of throughput) is not worth more of the run's steps.
WORTHWHILE_GAIN = 0.05
#: Pairs from which a candidate that could not be shown faster even in :data:`MAX_PAIRS`
#: pairs at its mean and spread so far is reverted (:func:`could_be_shown_faster`).
FUTILE_FROM_PAIRS = 6
#: Two-sided confidence of the paired interval of a candidate's gain.
CONFIDENCE = 0.95


def t_quantile(p: float, df: float) -> float:
    """Student's t quantile at probability ``p`` with ``df`` degrees of freedom.

    By the Cornish-Fisher expansion of Abramowitz & Stegun 26.7.5 around the normal
    quantile; within 1% of the exact value for ``df >= 2``; ``df`` below 1 counts as
    1."""
    z = NormalDist().inv_cdf(p)
    v = max(float(df), 1.0)
    z2 = z * z
    return z * (1 + (z2 + 1) / (4 * v) + (5 * z2 * z2 + 16 * z2 + 3) / (96 * v * v)
                + (3 * z2 ** 3 + 19 * z2 * z2 + 17 * z2 - 15) / (384 * v ** 3)
                + (79 * z2 ** 4 + 776 * z2 ** 3 + 1482 * z2 * z2 - 1920 * z2 - 945)
                / (92160 * v ** 4))


class Block:
    """Measured steps of one configuration.

    Their count, the mean and sample variance of seconds per unit, and the units and
    seconds in all."""

    __slots__ = ("n", "mean", "variance", "units", "seconds")

    def __init__(self, n: int = 0, mean: float = 0.0, variance: float = 0.0,
                 units: float = 0.0, seconds: float = 0.0) -> None:
        self.n, self.mean, self.variance, self.units, self.seconds = (n, mean, variance,
                                                                       units, seconds)

    def rate(self) -> tuple[float, float]:
        """Throughput (units/s) and its 95% half-width, from the mean time per unit."""
        if not self.n or self.mean <= 0:
            return 0.0, 0.0
        rate = 1.0 / self.mean
        if self.n < 2:
            return rate, rate
        half = t_quantile(0.975, self.n - 1) * math.sqrt(self.variance / self.n)
        return rate, rate * half / self.mean


def paired_gain(pairs: list[tuple[Block, Block]], confidence: float = CONFIDENCE
                ) -> tuple[float, float, float]:
    """A candidate's throughput gain over the best configuration's, with its interval.

    From ``(best's sub-block, candidate's sub-block)`` pairs measured next to each
    other: ``(gain, low, high)``, fractions, with the two-sided ``confidence`` interval
    of a paired t-test on the pairs' log ratios (so the machine's load moving between
    pairs counts as noise, and within a pair cancels). The interval is infinite below
    two pairs."""
    ratios = [math.log(best.mean / candidate.mean) for best, candidate in pairs
              if best.mean > 0 and candidate.mean > 0]
    if not ratios:
        return 0.0, -math.inf, math.inf
    k = len(ratios)
    mean = sum(ratios) / k
    if k < 2:
        return math.expm1(mean), -math.inf, math.inf
    sd = math.sqrt(sum((r - mean) ** 2 for r in ratios) / (k - 1))
    margin = t_quantile(0.5 + confidence / 2, k - 1) * sd / math.sqrt(k)
    return math.expm1(mean), math.expm1(mean - margin), math.expm1(mean + margin)


def could_be_shown_faster(gain: float, high: float, pairs: int) -> bool:
    """Whether :data:`MAX_PAIRS` pairs could show a candidate faster beyond noise.

    That is, if its mean gain and the spread of its pairs stayed as they are after
    ``pairs`` pairs (``gain`` and ``high`` as :func:`paired_gain` gives them): the
    interval at :data:`MAX_PAIRS` pairs, ``t(MAX_PAIRS - 1) * sd / sqrt(MAX_PAIRS)``
    each side of the mean, would be above zero. A futility check of sequential testing:
    a candidate that could not be shown faster even then is not worth its further
    pairs."""
    if pairs < 2 or not math.isfinite(high):
        return True  # no spread yet: it could be anything
    mean = math.log1p(gain)  # the pairs' mean log ratio (gain > -1: rates are positive)
    sd = (math.log1p(high) - mean) * math.sqrt(pairs) / t_quantile(
        0.5 + CONFIDENCE / 2, pairs - 1)
    return mean > t_quantile(0.5 + CONFIDENCE / 2, MAX_PAIRS - 1) * sd / math.sqrt(MAX_PAIRS)


class Series:
    """The steps since a change in one configuration, and the block they measure.

    The block is measured once the warm-up is cut off.

    The warm-up is found by MSER, the marginal standard error rule of simulation
    output analysis (White, 1997): of the first half of the steps, cut the prefix that
    minimises the standard error of the mean of what is left,
    ``sum((x - mean)^2) / m^2`` over the ``m`` steps kept. Worker start-up, allocator
    growth and the first batches after a rebuild are such a prefix; steady noise is
    not, as cutting it does not lower that error. After a change the first step (the
    one the change applied in) is always cut.

    Args:
        after_change: the first step is the one a change applied in (always cut); False
            for steps that go on in the same configuration (nothing cut but warm-up).

    Cost: :meth:`add` O(1) (prefix sums); :meth:`block` O(steps).
    """

    def __init__(self, *, after_change: bool = True) -> None:
        self.after_change = after_change
        self._sums: list[tuple[float, float, float, float]] = [(0.0, 0.0, 0.0, 0.0)]

    def __len__(self) -> int:
        return len(self._sums) - 1

    def add(self, step_time_s: float, units: int) -> None:
        """One step of ``step_time_s`` seconds that did ``units`` samples or tokens."""
        x = step_time_s / units
        s1, s2, seconds, count = self._sums[-1]
        self._sums.append((s1 + x, s2 + x * x, seconds + step_time_s, count + units))

    def block(self) -> Block:
        """The steps after the warm-up (see the class notes)."""
        sums, n = self._sums, len(self)
        end = sums[-1]
        first = 1 if self.after_change else 0
        best, cut = math.inf, first
        for d in range(first, n // 2 + 1) if n - first >= 2 else ():
            m = n - d
            s1, s2 = end[0] - sums[d][0], end[1] - sums[d][1]
            error = (s2 - s1 * s1 / m) / (m * m)
            if error < best:
                best, cut = error, d
        m = n - cut
        if m <= 0:
            return Block()
        s1, s2 = end[0] - sums[cut][0], end[1] - sums[cut][1]
        mean = s1 / m
        variance = max(0.0, (s2 - s1 * mean) / (m - 1)) if m > 1 else 0.0
        return Block(m, mean, variance, end[3] - sums[cut][3], end[2] - sums[cut][2])
