"""From records to the scan's summary: one JSON-ready block per axis (docs/design.md §7).

Each axis has its own curve, its own period search (`period.py`) and its
own fold by phase (gap, chi-square test, worst and best phase):

- `offset`: accuracy per offset (filler in front); the prompts of one offset
  share target position and length, so both phases move with the offset.
  Folded by the target's phase.
- `needle`: accuracy per phase of the target's position, prompt length
  fixed, with the mean and spread of the positions per group (they should
  match). Period searched over `position mod 2·hop`.
- `length`: accuracy per extra filler unit after the record (target fixed),
  folded by `prompt length mod hop`, the phase a length-keyed weakness
  (vLLM issue #55927) depends on.

With the server's geometry (`placement.py`), each axis also reports
accuracy outside and inside the raw window (`window`). The text form is in
`report_text.py`.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from vllm_chunked_kv.scan.period import dominant_period
from vllm_chunked_kv.scan.placement import Geometry
from vllm_chunked_kv.scan.records import Record
from vllm_chunked_kv.scan.stats import Comparison, compare_groups, wilson

AXES = ("offset", "needle", "length")


def axis_phase(kind: str, record: Record, hop: int) -> int:
    """The phase an axis groups a record by: the prompt length's for `length`, the target's otherwise."""
    return record.length_phase(hop) if kind == "length" else record.phase


def group_by(records: list[Record], key) -> dict[int, list[Record]]:
    groups: dict[int, list[Record]] = defaultdict(list)
    for record in records:
        groups[key(record)].append(record)
    return dict(sorted(groups.items()))


def _compare(groups: dict[int, list[Record]], seed: int) -> Comparison:
    labels = list(groups)
    return compare_groups(
        labels, [sum(r.correct for r in rs) for rs in groups.values()], [len(rs) for rs in groups.values()], seed=seed
    )


def _rows(comparison: Comparison, name: str) -> list[dict]:
    return [
        {name: g.label, "n": g.n, "correct": g.correct, "accuracy": g.accuracy, "ci": [g.ci_low, g.ci_high]}
        for g in comparison.groups
    ]


def _headline(records: list[Record], phases: Comparison) -> dict:
    gap = phases.gap
    return {
        "probes": len(records),
        "accuracy": sum(r.correct for r in records) / len(records),
        "by_phase": _rows(phases, "phase"),
        "gap": {"value": gap.value, "ci": [gap.ci_low, gap.ci_high], "method": gap.method, "null_p95": gap.null_p95},
        "chi2": {"statistic": phases.chi2.statistic, "dof": phases.chi2.dof, "p_value": phases.chi2.p_value},
        "best_phase": gap.best,
        "worst_phase": gap.worst,
    }


def _curve(by_step: dict[int, list[Record]], name: str, hop: int, seed: int) -> tuple[list[dict], dict, Comparison]:
    """Rows of a 0..N-1 curve (each with its most common target and length phase), its period, the comparison."""
    steps = _compare(by_step, seed)
    rows = _rows(steps, name)
    for row, rs in zip(rows, by_step.values()):
        row["phase"] = Counter(r.phase for r in rs).most_common(1)[0][0]
        row["length_phase"] = Counter(r.length_phase(hop) for r in rs).most_common(1)[0][0]
    if list(by_step) != list(range(len(by_step))):
        return rows, {"period": None, "reason": f"{name}s missing"}, steps
    period = dominant_period([g.correct for g in steps.groups], [g.n for g in steps.groups], seed=seed)
    return rows, period.to_dict(), steps


def summarize_offset(records: list[Record], hop: int, seed: int = 0) -> dict:
    rows, period, offsets = _curve(group_by(records, lambda r: r.offset), "offset", hop, seed)
    gap = offsets.gap
    return {
        **_headline(records, _compare(group_by(records, lambda r: r.phase), seed)),
        "by_offset": rows,
        "offset_gap": {"value": gap.value, "ci": [gap.ci_low, gap.ci_high], "best_offset": gap.best,
                       "worst_offset": gap.worst},
        "period": period,
    }


def summarize_length(records: list[Record], hop: int, seed: int = 0) -> dict:
    rows, period, _ = _curve(group_by(records, lambda r: r.extra), "extra", hop, seed)
    summary = _headline(records, _compare(group_by(records, lambda r: r.length_phase(hop)), seed))
    for row, rs in zip(summary["by_phase"], group_by(records, lambda r: r.length_phase(hop)).values()):
        row["target_phases"] = dict(sorted(Counter(r.phase for r in rs).items()))  # balanced by design
    return {**summary, "by_extra": rows, "period": period}


def summarize_needle(records: list[Record], hop: int, seed: int = 0) -> dict:
    by_phase = group_by(records, lambda r: r.phase)
    summary = _headline(records, _compare(by_phase, seed))
    for row, rs in zip(summary["by_phase"], by_phase.values()):
        positions = [r.position for r in rs]
        row["position_mean"] = statistics.fmean(positions)
        row["position_sd"] = statistics.pstdev(positions)
    folded = _compare(group_by(records, lambda r: r.position % (2 * hop)), seed)
    complete = len(folded.groups) == 2 * hop
    period = dominant_period([g.correct for g in folded.groups], [g.n for g in folded.groups], seed=seed)
    summary["period"] = period.to_dict() if complete else {"period": None, "reason": f"positions mod {2 * hop} missing"}
    summary["off_plan"] = sum(r.phase != r.planned_phase for r in records)  # tokenizer did not match the plan
    return summary


def _share(records: list[Record]) -> dict:
    correct = sum(r.correct for r in records)
    n = len(records)
    return {"n": n, "correct": correct, "accuracy": correct / n if n else None, "ci": list(wilson(correct, n)) if n else None}


def summarize_window(records: list[Record], geometry: Geometry) -> dict:
    """Accuracy of the targets the server reads compressed (outside) and exactly (inside)."""
    known = [r for r in records if r.distance is not None]
    outside = [r for r in known if geometry.outside(r.position, r.distance)]
    inside = [r for r in known if not geometry.outside(r.position, r.distance)]
    return {**geometry.to_dict(), "outside": _share(outside), "inside": _share(inside),
            "distance_min": min((r.distance for r in known), default=None)}


SUMMARIZERS = {"offset": summarize_offset, "needle": summarize_needle, "length": summarize_length}


def summarize(records: list[Record], *, hop: int, seed: int = 0, geometry: Geometry | None = None) -> dict:
    out = {}
    for kind in AXES:
        mine = [r for r in records if r.probe == kind]
        if mine:
            out[kind] = SUMMARIZERS[kind](mine, hop, seed)
            if geometry is not None:
                out[kind]["window"] = summarize_window(mine, geometry)
    return out
