"""Accuracy per group with its uncertainty (docs/design.md §7).

- `wilson`: two-sided Wilson score interval of one proportion.
- `clustered_wilson`: the Wilson interval of a pooled proportion whose
  trials come in correlated clusters (the same needle asked at every
  phase), on the effective sample size of the clusters.
- `newcombe_difference`: interval of a difference of two independent
  proportions by Newcombe's hybrid score method (method 10 of Newcombe 1998),
  built from the two Wilson intervals.
- `chi2_independence`: Pearson's chi-square test of "accuracy does not depend
  on the group" on the groups x {correct, incorrect} table.
- `compare_groups`: all of the above for a set of groups, with the gap
  (best - worst accuracy), its Newcombe interval, and the no-effect reference
  of the gap: because best and worst are picked after looking, the gap is
  positive even when nothing depends on the group; `gap_null_p95` is the 95th
  percentile of best - worst when the outcomes are shuffled across groups
  (exactly: drawn from the multivariate hypergeometric of the pooled counts).
- `mcnemar`: McNemar's test of paired outcomes (the same probe sent to two
  endpoints): exact two-sided binomial test on the discordant pairs when
  they are few, the continuity-corrected chi-square otherwise.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

Z95 = 1.959963984540054  # two-sided 95% normal quantile


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for k successes out of n; (0, 1) when n == 0."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    z2 = z * z
    denom = 1.0 + z2 / n
    centre = (p + z2 / (2 * n)) / denom
    half = z / denom * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def clustered_wilson(correct: list[int], total: list[int], z: float = Z95) -> tuple[float, float, float]:
    """(effective n, low, high): Wilson's interval for sum(correct) / sum(total) when
    the trials of one cluster are not independent (a needle right at one phase
    tends to be right at all). n is shrunk by the design effect: the
    cluster-robust variance of the pooled proportion (a ratio estimator,
    Kish), ``K / (K - 1) * sum((c_i - p * n_i)^2) / n^2`` over the K clusters,
    against the binomial ``p (1 - p) / n``. Never wider than clusters of one
    outcome each could make it, never narrower than independent trials."""
    if len(correct) != len(total):
        raise ValueError("correct and total must have the same length")
    k, n, clusters = sum(correct), sum(total), len(total)
    if n <= 0:
        return 0.0, 0.0, 1.0
    p = k / n
    if clusters < 2 or p in (0.0, 1.0):
        return float(n), *wilson(k, n, z)
    variance = clusters / (clusters - 1) * sum((c - p * m) ** 2 for c, m in zip(correct, total)) / n**2
    n_eff = n if variance <= 0 else min(float(n), p * (1 - p) / variance)
    low, high = wilson(p * n_eff, n_eff, z)  # Wilson's formula takes a fractional count
    return n_eff, low, high


def newcombe_difference(k1: int, n1: int, k2: int, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """p1 - p2 and its hybrid score interval (Newcombe's method 10)."""
    p1, p2 = k1 / n1, k2 / n2
    l1, u1 = wilson(k1, n1, z)
    l2, u2 = wilson(k2, n2, z)
    d = p1 - p2
    lo = d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return d, max(-1.0, lo), min(1.0, hi)


@dataclass(frozen=True)
class ChiSquare:
    statistic: float
    dof: int
    p_value: float


def chi2_independence(correct: list[int], total: list[int]) -> ChiSquare:
    """Pearson chi-square test that accuracy is the same in every group.

    Groups with no trials are left out; a table where every outcome is the
    same (or a single group) carries no evidence: statistic 0, p-value 1.
    """
    from scipy.stats import chi2_contingency

    rows = [(k, n - k) for k, n in zip(correct, total) if n > 0]
    table = np.array(rows, dtype=float)  # [groups, 2]: correct, incorrect
    if len(rows) < 2 or (table.sum(axis=0) == 0).any():
        return ChiSquare(0.0, max(0, len(rows) - 1), 1.0)
    result = chi2_contingency(table, correction=False)
    return ChiSquare(float(result.statistic), int(result.dof), float(result.pvalue))


@dataclass(frozen=True)
class Group:
    label: int
    n: int
    correct: int
    accuracy: float
    ci_low: float
    ci_high: float


@dataclass(frozen=True)
class Gap:
    value: float
    ci_low: float
    ci_high: float
    best: int  # label of the best group
    worst: int  # label of the worst group
    null_p95: float  # 95th percentile of best - worst with no group effect
    method: str = "Newcombe hybrid score interval (method 10) for best - worst"


@dataclass(frozen=True)
class Comparison:
    groups: list[Group]
    gap: Gap
    chi2: ChiSquare

    def to_dict(self) -> dict:
        return asdict(self)


def gap_null_quantile(
    total: list[int], num_correct: int, q: float = 0.95, draws: int = 4000, seed: int = 0
) -> float:
    """Quantile q of (max - min group accuracy) when `num_correct` successes fall on groups at random."""
    sizes = np.asarray([n for n in total if n > 0], dtype=np.int64)
    if len(sizes) < 2:
        return 0.0
    rng = np.random.default_rng(seed)
    hits = rng.multivariate_hypergeometric(sizes, num_correct, size=draws)  # [draws, groups]
    acc = hits / sizes  # [draws, groups]
    return float(np.quantile(acc.max(axis=1) - acc.min(axis=1), q))


def compare_groups(labels: list[int], correct: list[int], total: list[int], *, seed: int = 0) -> Comparison:
    """Wilson intervals per group, the best - worst gap with its interval, and the chi-square test.

    Groups with no trials are reported but take no part in the gap.
    """
    if not (len(labels) == len(correct) == len(total)):
        raise ValueError("labels, correct and total must have the same length")
    groups = []
    for label, k, n in zip(labels, correct, total):
        lo, hi = wilson(k, n)
        groups.append(Group(label, n, k, k / n if n else float("nan"), lo, hi))
    filled = [g for g in groups if g.n > 0]
    if not filled:
        raise ValueError("no group has any trial")
    # Ties resolve to the first group in label order.
    best = max(filled, key=lambda g: (g.accuracy, -labels.index(g.label)))
    worst = min(filled, key=lambda g: (g.accuracy, labels.index(g.label)))
    d, lo, hi = newcombe_difference(best.correct, best.n, worst.correct, worst.n)
    null = gap_null_quantile(total, sum(correct), seed=seed)
    return Comparison(
        groups=groups,
        gap=Gap(d, lo, hi, best.label, worst.label, null),
        chi2=chi2_independence(correct, total),
    )


EXACT_BELOW = 25  # discordant pairs under which McNemar's test is the exact binomial one


@dataclass(frozen=True)
class McNemar:
    a_only: int  # pairs where only A was correct
    b_only: int  # pairs where only B was correct
    statistic: float | None  # chi-square statistic; None for the exact test
    p_value: float
    method: str


def mcnemar(a_only: int, b_only: int) -> McNemar:
    """Two-sided McNemar test that A and B are correct equally often on the same probes."""
    from scipy.stats import binom, chi2

    discordant = a_only + b_only
    if discordant == 0:
        return McNemar(a_only, b_only, None, 1.0, "no discordant pairs")
    if discordant < EXACT_BELOW:
        p = min(1.0, 2.0 * float(binom.cdf(min(a_only, b_only), discordant, 0.5)))
        return McNemar(a_only, b_only, None, p, "exact binomial")
    statistic = (abs(a_only - b_only) - 1) ** 2 / discordant
    return McNemar(a_only, b_only, statistic, float(chi2.sf(statistic, 1)), "chi-square, continuity corrected")
