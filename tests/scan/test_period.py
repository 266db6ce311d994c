"""Contract of the dominant-period search over an accuracy-per-offset curve.

- Noise-free curves: the fundamental period is found (not a multiple, not a
  divisor that fits worse); a flat curve has no period; a trend that does
  not repeat within the window has no period, with that reason.
- Binomial noise: a planted period-4 pattern is found in almost every seed;
  a flat endpoint reports a period in at most a few seeds (about alpha).
- The periodogram covers periods 2..N and its power is a share in [0, 1].
"""

from __future__ import annotations

import numpy as np
import pytest

from vllm_chunked_kv.scan.period import dominant_period


def _exact(pattern: list[float], n: int) -> tuple[list[int], list[int]]:
    return [round(n * p) for p in pattern], [n] * len(pattern)


@pytest.mark.parametrize(
    "pattern, period",
    [
        ([0.95, 0.95, 0.95, 0.55] * 2, 4),
        ([0.9, 0.6] * 4, 2),
        ([0.9, 0.5, 0.7] * 3, 3),
        ([0.79, 0.95, 0.85, 0.63] * 2, 4),  # docs/design.md §8's mean-pooling demo numbers
    ],
)
def test_noise_free_periods(pattern, period):
    result = dominant_period(*_exact(pattern, 200))
    assert result.period == period
    assert result.p_value < 0.05


def test_flat_curve_has_no_period():
    result = dominant_period(*_exact([0.8] * 8, 200))
    assert result.period is None
    assert "constant accuracy" in result.reason


def test_trend_is_not_a_period():
    result = dominant_period(*_exact(list(np.linspace(0.4, 0.95, 8)), 200))
    assert result.period is None
    assert "does not repeat" in result.reason


def test_periodogram_covers_all_candidates():
    result = dominant_period(*_exact([0.95, 0.95, 0.95, 0.55] * 2, 100))
    assert [fit.period for fit in result.periodogram] == list(range(2, 9))
    assert all(0.0 <= fit.power <= 1.0 + 1e-12 for fit in result.periodogram)
    assert result.periodogram[-1].power == pytest.approx(1.0)


def test_noisy_planted_period_is_recovered():
    pattern = np.array([0.95, 0.95, 0.95, 0.55] * 2)
    found = 0
    for seed in range(20):
        correct = np.random.default_rng(seed).binomial(64, pattern)
        found += dominant_period(correct.tolist(), [64] * 8, permutations=199).period == 4
    assert found >= 18


def test_noisy_flat_endpoint_rarely_reports_a_period():
    false_periods = 0
    for seed in range(40):
        correct = np.random.default_rng(seed).binomial(64, [0.8] * 8)
        false_periods += dominant_period(correct.tolist(), [64] * 8, permutations=199).period is not None
    assert false_periods <= 3


def test_too_few_offsets_is_no_period():
    assert dominant_period([5, 9, 5], [10, 10, 10]).period is None
