"""From records to the scan's summary (a JSON-ready dict) and its text form.

Per probe:

- `offset`: accuracy per offset, the dominant period of that curve
  (`period.py`), and the same outcomes folded by the target's phase
  (`position mod hop`): the headline gap, chi-square test and worst phase;
- `needle`: accuracy per phase of the target's position, with the mean and
  standard deviation of the positions in each group (they should match).

With the server's geometry (`placement.py`), each probe also reports
accuracy outside and inside the raw window separately (`window`): only the
targets outside are read through compressed rows.
"""

from __future__ import annotations

import statistics
from collections import Counter, defaultdict

from vllm_chunked_kv.scan.period import dominant_period
from vllm_chunked_kv.scan.placement import Geometry
from vllm_chunked_kv.scan.records import Record
from vllm_chunked_kv.scan.stats import Comparison, compare_groups, wilson


def _by(records: list[Record], key) -> dict[int, list[Record]]:
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


def _headline(comparison: Comparison) -> dict:
    gap = comparison.gap
    return {
        "gap": {
            "value": gap.value, "ci": [gap.ci_low, gap.ci_high], "method": gap.method, "null_p95": gap.null_p95,
        },
        "chi2": {"statistic": comparison.chi2.statistic, "dof": comparison.chi2.dof, "p_value": comparison.chi2.p_value},
        "best_phase": gap.best,
        "worst_phase": gap.worst,
    }


def summarize_offset(records: list[Record], seed: int = 0) -> dict:
    by_offset = _by(records, lambda r: r.offset)
    offsets = _compare(by_offset, seed)
    rows = _rows(offsets, "offset")
    for row, rs in zip(rows, by_offset.values()):
        row["phase"] = Counter(r.phase for r in rs).most_common(1)[0][0]
    complete = list(by_offset) == list(range(len(by_offset)))
    period = dominant_period([g.correct for g in offsets.groups], [g.n for g in offsets.groups], seed=seed)
    phases = _compare(_by(records, lambda r: r.phase), seed)
    return {
        "probes": len(records),
        "accuracy": sum(r.correct for r in records) / len(records),
        "by_offset": rows,
        "by_phase": _rows(phases, "phase"),
        **_headline(phases),
        "offset_gap": {"value": offsets.gap.value, "ci": [offsets.gap.ci_low, offsets.gap.ci_high],
                       "best_offset": offsets.gap.best, "worst_offset": offsets.gap.worst},
        "period": period.to_dict() if complete else {"period": None, "reason": "offsets missing"},
    }


def summarize_needle(records: list[Record], seed: int = 0) -> dict:
    by_phase = _by(records, lambda r: r.phase)
    phases = _compare(by_phase, seed)
    rows = _rows(phases, "phase")
    for row, rs in zip(rows, by_phase.values()):
        positions = [r.position for r in rs]
        row["position_mean"] = statistics.fmean(positions)
        row["position_sd"] = statistics.pstdev(positions)
    moved = sum(r.phase != r.planned_phase for r in records)
    return {
        "probes": len(records),
        "accuracy": sum(r.correct for r in records) / len(records),
        "by_phase": rows,
        **_headline(phases),
        "off_plan": moved,  # probes whose measured phase differs from the planned one (tokenizer mismatch)
    }


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


def summarize(records: list[Record], *, seed: int = 0, geometry: Geometry | None = None) -> dict:
    out = {}
    for kind, summarize_kind in (("offset", summarize_offset), ("needle", summarize_needle)):
        mine = [r for r in records if r.probe == kind]
        if mine:
            out[kind] = summarize_kind(mine, seed)
            if geometry is not None:
                out[kind]["window"] = summarize_window(mine, geometry)
    return out


def _pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def format_text(summary: dict, hop: int) -> str:
    lines = []
    for kind in ("offset", "needle"):
        if kind not in summary:
            continue
        s = summary[kind]
        lines.append(f"{kind} probe: {s['probes']} probes, accuracy {_pct(s['accuracy']).strip()}%")
        if kind == "offset":
            for row in s["by_offset"]:
                lines.append(
                    f"  offset {row['offset']:3d} (phase {row['phase']}): {_pct(row['accuracy'])}% "
                    f"[{_pct(row['ci'][0])}, {_pct(row['ci'][1])}]  n={row['n']}"
                )
            period = s["period"]
            found = f"period {period['period']}" if period.get("period") else "no period"
            lines.append(f"  dominant period: {found} ({period['reason']}; p={period.get('p_value', 1):.3g})")
        for row in s["by_phase"]:
            extra = f"  positions {row['position_mean']:.1f}±{row['position_sd']:.1f}" if "position_mean" in row else ""
            lines.append(
                f"  phase {row['phase']} (mod {hop}): {_pct(row['accuracy'])}% "
                f"[{_pct(row['ci'][0])}, {_pct(row['ci'][1])}]  n={row['n']}{extra}"
            )
        gap = s["gap"]
        lines.append(
            f"  gap best-worst: {_pct(gap['value']).strip()} points [{_pct(gap['ci'][0]).strip()}, "
            f"{_pct(gap['ci'][1]).strip()}] (no-effect 95th pct {_pct(gap['null_p95']).strip()}); "
            f"worst phase {s['worst_phase']}, best phase {s['best_phase']}; "
            f"chi-square p={s['chi2']['p_value']:.3g}"
        )
        if "window" in s:
            lines += _window_lines(s["window"])
    return "\n".join(lines)


def _window_lines(w: dict) -> list[str]:
    def share(part: dict) -> str:
        if not part["n"]:
            return "n=0"
        return f"{_pct(part['accuracy']).strip()}% [{_pct(part['ci'][0]).strip()}, {_pct(part['ci'][1]).strip()}] n={part['n']}"

    lines = [
        f"  outside the raw window (>= {w['min_distance']} units from the end, window {w['window']} "
        f"from {w['source']}): {share(w['outside'])}; inside: {share(w['inside'])}"
    ]
    if w["inside"]["n"]:
        lines.append(
            f"warning: {w['inside']['n']} targets fall inside the raw window or the sinks, where nothing is "
            "compressed: their accuracy says nothing about compression (see --needle-range, --window)"
        )
    return lines
