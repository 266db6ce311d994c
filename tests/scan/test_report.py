"""Contract of the summary, its text form and the plot.

- Offset results: one row per offset with the target's phase, the period
  search, and the phase-folded gap; needle results: one row per phase with
  position mean and spread; both name the worst and best phase.
- The text form names the period and the worst phase; the plot is a PNG.
"""

from __future__ import annotations

from vllm_chunked_kv.scan.plot import plot_summary
from vllm_chunked_kv.scan.records import Record
from vllm_chunked_kv.scan.report import format_text, summarize

ACCURACY = {0: 0.9, 1: 0.9, 2: 0.9, 3: 0.3}  # by phase


def _records() -> list[Record]:
    records = []
    for offset in range(8):
        for i in range(20):
            phase = (10 + offset) % 4
            correct = i < 20 * ACCURACY[phase]
            records.append(Record(f"offset:{offset}:{i}", "offset", offset, None, 10 + offset, phase, 50 + offset,
                                  "tokens", "v1", "v1" if correct else "v2", correct, f"c{offset}-{i}", 1, 0.0))
    for phase in range(4):
        for i in range(40):
            position = 20 + 4 * (i % 10) + phase
            correct = i < 40 * ACCURACY[phase]
            records.append(Record(f"needle:{phase}:{i}", "needle", None, phase, position, phase, 80,
                                  "tokens", "v1", "", correct, f"n{phase}-{i}", 1, 0.0))
    return records


def test_summary_shape():
    summary = summarize(_records())
    offset, needle = summary["offset"], summary["needle"]
    assert [row["offset"] for row in offset["by_offset"]] == list(range(8))
    assert [row["phase"] for row in offset["by_offset"]] == [(10 + k) % 4 for k in range(8)]
    assert offset["period"]["period"] == 4
    assert offset["worst_phase"] == needle["worst_phase"] == 3
    assert offset["best_phase"] == needle["best_phase"] == 0
    assert abs(needle["gap"]["value"] - 0.6) < 1e-9
    assert all(row["n"] == 40 for row in needle["by_phase"])
    assert needle["off_plan"] == 0


def test_text_and_plot(tmp_path):
    summary = summarize(_records())
    text = format_text(summary, hop=4)
    assert "dominant period: period 4" in text and "worst phase 3" in text
    path = plot_summary(summary, tmp_path / "scan.png", hop=4, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
