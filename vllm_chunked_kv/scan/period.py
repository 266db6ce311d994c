"""The dominant period of an accuracy-per-offset curve, with a null test.

Input: for offsets 0 .. N-1, how many probes were correct out of how many.
For every candidate period P in 2 .. N the curve is folded (offset mod P) and
the binomial likelihood-ratio statistic G_P of "accuracy depends on offset
mod P" against "accuracy is constant" is computed: that is the periodogram
(`power` = G_P / G_N, the share of all offset dependence the fold explains).

The dominant period maximises the BIC improvement over the constant model,
`G_P - (P - 1) * ln(n)`: folding at the true period explains the curve with
the fewest parameters, so multiples of it (and P = N, which fits anything)
lose on the penalty and divisors lose on the fit. A period is reported only if

- the improvement is positive (the fold beats a constant),
- a permutation test says the improvement is not chance: outcomes are
  shuffled across offsets (the number correct per offset then follows the
  multivariate hypergeometric of the pooled counts, drawn exactly) and the
  best improvement over all candidates is recomputed, p < alpha,
- the period repeats at least twice inside the window (P <= N / 2);
  otherwise accuracy depends on the offset but not periodically.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.special import xlogy


@dataclass(frozen=True)
class PeriodFit:
    period: int
    g_statistic: float  # likelihood ratio vs constant accuracy, dof = period - 1
    power: float  # g_statistic / g of the full per-offset model, in [0, 1]
    bic_gain: float  # g_statistic - (period - 1) * ln(n); > 0 beats the constant model


@dataclass(frozen=True)
class PeriodResult:
    period: int | None
    p_value: float  # permutation p-value of the best bic_gain
    reason: str
    periodogram: list[PeriodFit] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _loglik(hits: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Binomial log-likelihood at the group-wise MLE; hits [..., groups], sizes [groups]."""
    misses = sizes - hits
    p = np.divide(hits, sizes, out=np.zeros(hits.shape), where=sizes > 0)
    return (xlogy(hits, p) + xlogy(misses, 1.0 - p)).sum(axis=-1)


def _fold(hits: np.ndarray, sizes: np.ndarray, period: int) -> tuple[np.ndarray, np.ndarray]:
    """Sum offsets with the same offset mod period; hits [..., N] -> [..., period]."""
    index = np.arange(sizes.shape[-1]) % period
    folded_hits = np.stack([hits[..., index == r].sum(axis=-1) for r in range(period)], axis=-1)
    folded_sizes = np.array([sizes[index == r].sum() for r in range(period)])
    return folded_hits, folded_sizes


def _g_statistics(hits: np.ndarray, sizes: np.ndarray, periods: list[int]) -> np.ndarray:
    """G_P for each period; hits [..., N] -> [..., len(periods)]."""
    total = sizes.sum()
    pooled = hits.sum(axis=-1, keepdims=True)  # [..., 1]
    base = _loglik(pooled, np.array([total]))  # [...]
    columns = []
    for period in periods:
        folded_hits, folded_sizes = _fold(hits, sizes, period)
        columns.append(2.0 * (_loglik(folded_hits, folded_sizes) - base))
    return np.stack(columns, axis=-1)


def dominant_period(
    correct: list[int],
    total: list[int],
    *,
    alpha: float = 0.05,
    permutations: int = 999,
    seed: int = 0,
) -> PeriodResult:
    """Periodogram over periods 2 .. N of the per-offset counts and the dominant period (or None)."""
    sizes = np.asarray(total, dtype=np.int64)
    hits = np.asarray(correct, dtype=np.int64)
    num_offsets = len(sizes)
    if num_offsets < 4 or (sizes == 0).any():
        return PeriodResult(None, 1.0, "need at least 4 offsets, each with probes")
    periods = list(range(2, num_offsets + 1))
    n = int(sizes.sum())
    penalty = np.array([(p - 1) * math.log(n) for p in periods])
    g = _g_statistics(hits.astype(float), sizes, periods)  # [len(periods)]
    gain = g - penalty
    full = g[-1]
    fits = [
        PeriodFit(p, float(gi), float(gi / full) if full > 0 else 0.0, float(bi))
        for p, gi, bi in zip(periods, g, gain)
    ]
    best = int(np.argmax(gain))
    observed = float(gain[best])
    rng = np.random.default_rng(seed)
    null_hits = rng.multivariate_hypergeometric(sizes, int(hits.sum()), size=permutations)  # [R, N]
    null_best = (_g_statistics(null_hits.astype(float), sizes, periods) - penalty).max(axis=-1)  # [R]
    p_value = float((1 + (null_best >= observed - 1e-9).sum()) / (1 + permutations))
    period = periods[best]
    if observed <= 0:
        return PeriodResult(None, p_value, "no fold explains the curve better than a constant accuracy (BIC)", fits)
    if p_value >= alpha:
        return PeriodResult(None, p_value, f"best fold (period {period}) is not significant", fits)
    if period > num_offsets // 2:
        return PeriodResult(
            None, p_value, f"accuracy depends on the offset but does not repeat within {num_offsets} offsets", fits
        )
    return PeriodResult(period, p_value, f"period {period} explains {fits[best].power:.0%} of the variation", fits)
