"""Contract of the three scan axes against endpoints whose weakness is keyed one way.

- An endpoint whose accuracy depends only on the prompt length mod 4 is
  found by the `length` axis (period 4, chi-square rejects, the planted
  worst length phase named) and not reported by the `needle` axis (which
  holds every prompt's length fixed): no period, no significant chi-square.
- The equal-length `offset` probe finds both kinds (period 4): a
  needle-keyed and a length-keyed endpoint, also with a user task whose
  lines have different lengths (every length residue mod 4), where
  offsets over unequal prompts would spread every offset over all length
  phases and average the effect out.
- Every length-axis target sits beyond the raw window the placement asks
  for, whatever the extra filler.
"""

from __future__ import annotations

import json

import pytest

from .conftest import summary_of
from .fake_server import FakeEndpoint

WEAK = (0.95, 0.95, 0.95, 0.45)  # accuracy by phase: phase 3 is the weak one
SIZES = ["--prompts", "48", "--per-phase", "96"]


def _user_task(tmp_path) -> str:
    """48 distinct lines (the fake answers a prompt the same every time) whose records differ in
    length by 0..3 words: records aligned at one position and padded to one distance from the
    end (placement) would still end their prompts at every length phase."""
    lines = []
    for i in range(48):
        record = " ".join([f"k{i}", f"v{i}"] + [f"w{j}" for j in range(i % 4)])
        lines.append({"template": f"h{i} {{record}} t0 ? k{i}", "record": record, "answer": f"v{i}"})
    path = tmp_path / "lengths.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_length_keyed_endpoint_is_seen_by_length_not_needle(scan):
    with FakeEndpoint(WEAK, keyed="length") as fake:
        code, out, err = scan("--base-url", fake.base_url, *SIZES)
    assert code == 0, err
    results = summary_of(out)["results"]
    length, needle = results["length"], results["needle"]
    assert length["period"]["period"] == 4
    assert length["chi2"]["p_value"] < 1e-3 and length["worst_phase"] == 3
    assert needle["period"]["period"] is None and needle["chi2"]["p_value"] > 1e-3
    assert {row["n"] for row in length["by_phase"]} == {2 * 48}  # every length phase at two extras
    window = length["window"]
    assert window["inside"]["n"] == 0 and window["distance_min"] >= window["min_distance"]


@pytest.mark.parametrize("keyed", ["needle", "length"])
@pytest.mark.parametrize("task", ["kv", "user"])
def test_equal_length_offset_probe_finds_both_kinds(scan, tmp_path, keyed, task):
    task_arg = "kv" if task == "kv" else _user_task(tmp_path)
    with FakeEndpoint(WEAK, keyed=keyed) as fake:
        code, out, err = scan("--base-url", fake.base_url, "--task", task_arg, "--probe", "offset", *SIZES)
    assert code == 0, err
    offset = summary_of(out)["results"]["offset"]
    assert offset["period"]["period"] == 4
    assert offset["chi2"]["p_value"] < 1e-3
    rows = offset["by_offset"]
    # One target phase and one length phase per offset, both moving one step per offset.
    assert [row["phase"] for row in rows] == [(rows[0]["phase"] + k) % 4 for k in range(8)]
    assert [row["length_phase"] for row in rows] == [(rows[0]["length_phase"] + k) % 4 for k in range(8)]
    # The fake judges the value token: the kv target itself, one token after a user record's start (its key).
    value_phase = [(row["phase"] + (task == "user")) % 4 for row in rows]
    keyed_phase = value_phase if keyed == "needle" else [row["length_phase"] for row in rows]
    weak = [row["offset"] for row, phase in zip(rows, keyed_phase) if phase == 3]
    worst_two = sorted(rows, key=lambda row: row["accuracy"])[:2]
    assert sorted(row["offset"] for row in worst_two) == weak
