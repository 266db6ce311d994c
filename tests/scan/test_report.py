"""Contract of the summary, its text form and the plot.

- Offset results: one row per offset with the target's phase, the period
  search, and the phase-folded gap; needle results: one row per phase with
  position mean and spread; both name the worst and best phase.
- Length results: rows per extra filler unit and per prompt length mod hop;
  the phase is the prompt length's, not the target's.
- The text form names the period and the worst phase of each axis; the plot is a PNG.
"""

from __future__ import annotations

from vllm_chunked_kv.scan.plot import plot_summary
from vllm_chunked_kv.scan.records import Record
from vllm_chunked_kv.scan.report import summarize
from vllm_chunked_kv.scan.report_text import format_text

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
    for extra in range(8):
        for i in range(20):
            length = 61 + extra  # the target stays at 30 + i % 4; only the prompt length moves
            correct = i < 20 * ACCURACY[length % 4]
            records.append(Record(f"length:{extra}:{i}", "length", None, None, 30 + i % 4, (30 + i % 4) % 4, length,
                                  "tokens", "v1", "", correct, f"l{extra}-{i}", 1, 0.0, extra=extra))
    return records


def test_summary_shape():
    summary = summarize(_records(), hop=4)
    offset, needle = summary["offset"], summary["needle"]
    assert [row["offset"] for row in offset["by_offset"]] == list(range(8))
    assert [row["phase"] for row in offset["by_offset"]] == [(10 + k) % 4 for k in range(8)]
    assert offset["period"]["period"] == 4
    assert offset["worst_phase"] == needle["worst_phase"] == 3
    assert offset["best_phase"] == needle["best_phase"] == 0
    assert abs(needle["gap"]["value"] - 0.6) < 1e-9
    assert all(row["n"] == 40 for row in needle["by_phase"])
    assert needle["off_plan"] == 0
    length = summary["length"]
    assert [row["extra"] for row in length["by_extra"]] == list(range(8))
    assert [row["length_phase"] for row in length["by_extra"]] == [(61 + k) % 4 for k in range(8)]
    assert length["period"]["period"] == 4
    assert length["worst_phase"] == 3 and length["best_phase"] == 0  # prompt length mod 4
    assert all(row["target_phases"] == {0: 10, 1: 10, 2: 10, 3: 10} for row in length["by_phase"])


def test_text_and_plot(tmp_path):
    summary = summarize(_records(), hop=4)
    text = format_text(summary, hop=4)
    assert "dominant period of accuracy vs offset: period 4" in text and "worst phase 3" in text
    assert "dominant period of accuracy vs extra units after the record: period 4" in text
    assert "worst length phase 3" in text
    path = plot_summary(summary, tmp_path / "scan.png", hop=4, title="t")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
