"""Contract of the scanner's per-group statistics.

- Wilson intervals match published values and cover the true proportion
  about 95% of the time (exact binomial coverage, no simulation noise).
- The Newcombe difference interval reproduces Newcombe's (1998) worked example.
- The chi-square test agrees with the textbook formula and reports no evidence
  for degenerate tables.
- The gap is best minus worst with its interval; ties go to the first group;
  the no-effect 95th percentile grows with fewer trials and a real effect
  clears it.
"""

from __future__ import annotations

import math
import random

import pytest
from scipy.stats import binom

from vllm_chunked_kv.scan.stats import (
    chi2_independence, clustered_wilson, compare_groups, newcombe_difference, wilson,
)


def test_wilson_published_values():
    # Newcombe (1998), Table I, method 3: 0/10 -> (0, 0.2775), 81/263 -> (0.2553, 0.3662).
    lo, hi = wilson(0, 10)
    assert lo == 0.0 and hi == pytest.approx(0.2775, abs=1e-4)
    lo, hi = wilson(81, 263)
    assert (lo, hi) == (pytest.approx(0.2553, abs=1e-4), pytest.approx(0.3662, abs=1e-4))


@pytest.mark.parametrize("p, n", [(0.3, 100), (0.9, 256), (0.5, 40)])
def test_wilson_exact_coverage_is_near_95(p, n):
    coverage = sum(binom.pmf(k, n, p) for k in range(n + 1) if wilson(k, n)[0] <= p <= wilson(k, n)[1])
    assert 0.92 < coverage < 0.98


def test_wilson_no_trials_is_uninformative():
    assert wilson(0, 0) == (0.0, 1.0)


def test_newcombe_worked_example():
    # Newcombe (1998), second paper, example (a): 56/70 - 48/80, method 10 -> (0.0524, 0.3339).
    d, lo, hi = newcombe_difference(56, 70, 48, 80)
    assert d == pytest.approx(0.2)
    assert (lo, hi) == (pytest.approx(0.0524, abs=1e-4), pytest.approx(0.3339, abs=1e-4))


def test_chi2_matches_textbook_formula():
    correct, total = [30, 45, 20], [50, 60, 40]
    pooled = sum(correct) / sum(total)
    stat = 0.0
    for k, n in zip(correct, total):
        for observed, expected in ((k, n * pooled), (n - k, n * (1 - pooled))):
            stat += (observed - expected) ** 2 / expected
    result = chi2_independence(correct, total)
    assert result.statistic == pytest.approx(stat)
    assert result.dof == 2
    assert result.p_value == pytest.approx(math.exp(-stat / 2))  # chi-square sf with 2 dof


@pytest.mark.parametrize("correct, total", [([10, 10], [10, 10]), ([0, 0], [5, 7]), ([3], [9])])
def test_chi2_degenerate_tables_carry_no_evidence(correct, total):
    assert chi2_independence(correct, total).p_value == 1.0


def test_gap_is_best_minus_worst_with_interval():
    result = compare_groups([0, 1, 2, 3], [90, 80, 85, 50], [100, 100, 100, 100])
    gap = result.gap
    assert (gap.best, gap.worst) == (0, 3)
    assert gap.value == pytest.approx(0.40)
    assert gap.ci_low < gap.value < gap.ci_high
    assert gap.ci_low > gap.null_p95  # a 40-point gap at n=100 is far beyond chance
    assert [g.accuracy for g in result.groups] == [0.9, 0.8, 0.85, 0.5]


def test_gap_ties_go_to_the_first_group():
    gap = compare_groups([0, 1, 2], [5, 5, 5], [10, 10, 10]).gap
    assert (gap.best, gap.worst, gap.value) == (0, 0, 0.0)


def test_gap_null_shrinks_with_more_trials():
    small = compare_groups([0, 1, 2, 3], [8] * 4, [10] * 4).gap.null_p95
    large = compare_groups([0, 1, 2, 3], [800] * 4, [1000] * 4).gap.null_p95
    assert small > large > 0


def test_empty_groups_are_reported_but_not_compared():
    result = compare_groups([0, 1, 2], [9, 0, 3], [10, 0, 10])
    assert math.isnan(result.groups[1].accuracy)
    assert (result.gap.best, result.gap.worst) == (0, 2)


def test_clustered_wilson_counts_a_cluster_of_equal_outcomes_once():
    """Needles right at all 4 phases or at none: the probes of one needle tell
    no more than one, so the interval is Wilson's on the needles (K - 1 with
    the finite-cluster factor), far wider than on the probes."""
    correct, total = [4] * 150 + [0] * 50, [4] * 200
    n_eff, low, high = clustered_wilson(correct, total)
    assert n_eff == pytest.approx(199)
    assert (low, high) == pytest.approx(wilson(0.75 * 199, 199))
    plain = wilson(600, 800)
    assert high - low > 1.9 * (plain[1] - plain[0])


def test_clustered_wilson_is_wilson_for_independent_trials():
    """Outcomes spread evenly over clusters (no clustering) keep the plain interval;
    negatively correlated ones never make it narrower; n = 0 is uninformative."""
    even = [3] * 200  # every needle right at 3 of its 4 phases: less spread than binomial
    assert clustered_wilson(even, [4] * 200) == pytest.approx((800, *wilson(600, 800)))
    rng = random.Random(0)
    independent = [sum(rng.random() < 0.75 for _ in range(4)) for _ in range(2000)]
    n_eff, low, high = clustered_wilson(independent, [4] * 2000)
    assert 0.85 * 8000 < n_eff <= 8000
    assert clustered_wilson([], []) == (0.0, 0.0, 1.0)
    assert clustered_wilson([4, 4], [4, 4]) == pytest.approx((8, *wilson(8, 8)))
