"""Contract of A/B scans (`scan --compare-url`) and McNemar's test.

- Every probe goes to both endpoints (B's records under OUT/compare); the
  paired report lists exactly the probes whose outcome differs between the
  two record files, counts them per phase of each axis, and McNemar's test
  flags the phase where B is weak (B wrong where A is right) and no other.
- The plot is written with both endpoints on it.
- The same server compared with itself: no flip, McNemar p = 1 everywhere.
- Two endpoints that tokenize differently: one-line error before any completion.
- `mcnemar`: the exact branch equals scipy's two-sided binomial test on the
  discordant pairs; the large-sample branch is the continuity-corrected
  chi-square.
"""

from __future__ import annotations

import json

import pytest
from scipy.stats import binomtest, chi2

from vllm_chunked_kv.scan.stats import mcnemar

from .conftest import summary_of
from .fake_server import FakeEndpoint

SIZES = ["--prompts", "16", "--per-phase", "64"]


def _records(path) -> dict[str, dict]:
    return {r["probe_id"]: r for r in map(json.loads, path.read_text().splitlines())}


def test_flips_are_the_probes_that_differ(scan, tmp_path):
    with FakeEndpoint((1.0,) * 4) as a, FakeEndpoint((1.0, 1.0, 1.0, 0.3), share_vocab=a) as b:
        code, out, err = scan("--base-url", a.base_url, "--compare-url", b.base_url, *SIZES)
        assert code == 0, err
        assert a.completions_served == b.completions_served == 2 * 8 * 16 + 4 * 64
    summary = summary_of(out)
    paired = summary["compare"]["paired"]
    records_a = _records(tmp_path / "scan" / "records.jsonl")
    records_b = _records(tmp_path / "scan" / "compare" / "records.jsonl")
    assert records_a.keys() == records_b.keys()
    differing = {pid for pid in records_a if records_a[pid]["correct"] != records_b[pid]["correct"]}
    assert {f["probe_id"] for kind in ("offset", "needle", "length") for f in paired[kind]["flips"]} == differing
    needle = paired["needle"]
    assert needle["b_only"] == 0 and needle["a_only"] == sum(pid.startswith("needle") for pid in differing)
    for row in needle["by_phase"]:
        if row["phase"] == 3:
            assert row["a_only"] > 20 and row["mcnemar"]["p_value"] < 1e-6
        else:
            assert row["a_only"] == row["b_only"] == 0 and row["mcnemar"]["p_value"] == 1.0
    assert summary["compare"]["results"]["needle"]["worst_phase"] == 3  # B's own scan
    assert summary["results"]["needle"]["gap"]["value"] == 0.0  # A's own scan
    assert open(summary["files"]["plot"], "rb").read(8) == b"\x89PNG\r\n\x1a\n"  # both drawn


def test_text_report(scan):
    with FakeEndpoint((1.0,) * 4) as a, FakeEndpoint((1.0, 1.0, 1.0, 0.3), share_vocab=a) as b:
        urls = a.base_url, b.base_url
        code, out, err = scan("--base-url", urls[0], "--compare-url", urls[1], *SIZES, json_output=False)
    assert code == 0, err
    assert f"A/B: A = {urls[0]}, B = {urls[1]}" in out
    assert "needle probe, paired (target position mod hop):" in out
    assert "length probe, paired (prompt length mod hop):" in out
    assert "McNemar p=" in out and "unpaired A-B" in out and "e.g. needle:3:" in out


def test_same_server_twice_has_no_flips(scan):
    with FakeEndpoint() as a, FakeEndpoint(share_vocab=a) as b:
        code, out, err = scan("--base-url", a.base_url, "--compare-url", b.base_url, "--prompts", "8",
                              "--per-phase", "16")
    assert code == 0, err
    paired = summary_of(out)["compare"]["paired"]
    for kind in ("offset", "needle", "length"):
        assert paired[kind]["flips"] == [] and paired[kind]["mcnemar"]["p_value"] == 1.0
        assert all(row["a_only"] == row["b_only"] == 0 for row in paired[kind]["by_phase"])


def test_different_tokenizers_are_refused(scan):
    with FakeEndpoint() as a, FakeEndpoint() as b:
        b.ids("zz yy xx", False)  # b has seen other words first: other ids for the same text
        code, _, err = scan("--base-url", a.base_url, "--compare-url", b.base_url)
        assert a.completion_requests == b.completion_requests == 0
    assert code == 1 and err.count("\n") == 1 and "tokenize differently" in err


@pytest.mark.parametrize("a_only, b_only", [(0, 0), (0, 6), (7, 2), (12, 12), (3, 21)])
def test_mcnemar_exact_matches_binomial_test(a_only, b_only):
    test = mcnemar(a_only, b_only)
    expected = binomtest(a_only, a_only + b_only, 0.5).pvalue if a_only + b_only else 1.0
    assert test.p_value == pytest.approx(expected, rel=1e-9)


def test_mcnemar_large_counts_use_corrected_chi_square():
    test = mcnemar(40, 15)
    assert test.statistic == pytest.approx((25 - 1) ** 2 / 55)
    assert test.p_value == pytest.approx(chi2.sf((25 - 1) ** 2 / 55, 1))
