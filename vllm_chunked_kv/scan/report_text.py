"""The scan summary (`report.py`) as text: one block per axis, the same numbers as the JSON."""

from __future__ import annotations

from vllm_chunked_kv.scan.report import AXES

TITLES = {
    "offset": "offset probe (filler in front: target and prompt end move together)",
    "needle": "needle probe (target phase varies, prompt length fixed)",
    "length": "length probe (prompt length varies, target fixed)",
}


def pct(x: float) -> str:
    return f"{100 * x:5.1f}"


def _interval(row: dict) -> str:
    return f"{pct(row['accuracy'])}% [{pct(row['ci'][0])}, {pct(row['ci'][1])}]  n={row['n']}"


def _period_line(period: dict, what: str) -> str:
    found = f"period {period['period']}" if period.get("period") else "no period"
    return f"  dominant period of accuracy vs {what}: {found} ({period['reason']}; p={period.get('p_value', 1):.3g})"


def _curve_lines(s: dict, kind: str) -> list[str]:
    if kind == "offset":
        lines = [f"  offset {row['offset']:3d} (phase {row['phase']}): {_interval(row)}" for row in s["by_offset"]]
        return lines + [_period_line(s["period"], "offset")]
    if kind == "length":
        lines = [
            f"  extra {row['extra']:3d} (length phase {row['length_phase']}): {_interval(row)}" for row in s["by_extra"]
        ]
        return lines + [_period_line(s["period"], "extra units after the record")]
    return []


def _phase_lines(s: dict, kind: str, hop: int) -> list[str]:
    name = "length phase" if kind == "length" else "phase"
    lines = []
    for row in s["by_phase"]:
        extra = f"  positions {row['position_mean']:.1f}±{row['position_sd']:.1f}" if "position_mean" in row else ""
        lines.append(f"  {name} {row['phase']} (mod {hop}): {_interval(row)}{extra}")
    if kind == "needle":
        lines.append(_period_line(s["period"], f"position mod {2 * hop}"))
    gap = s["gap"]
    lines.append(
        f"  gap best-worst: {pct(gap['value']).strip()} points [{pct(gap['ci'][0]).strip()}, "
        f"{pct(gap['ci'][1]).strip()}] (no-effect 95th pct {pct(gap['null_p95']).strip()}); "
        f"worst {name} {s['worst_phase']}, best {name} {s['best_phase']}; "
        f"chi-square p={s['chi2']['p_value']:.3g}"
    )
    return lines


def format_text(summary: dict, hop: int) -> str:
    lines = []
    for kind in AXES:
        if kind not in summary:
            continue
        s = summary[kind]
        lines.append(f"{TITLES[kind]}: {s['probes']} probes, accuracy {pct(s['accuracy']).strip()}%")
        lines += _curve_lines(s, kind) + _phase_lines(s, kind, hop)
        if "window" in s:
            lines += _window_lines(s["window"])
    return "\n".join(lines)


def _window_lines(w: dict) -> list[str]:
    def share(part: dict) -> str:
        if not part["n"]:
            return "n=0"
        return f"{pct(part['accuracy']).strip()}% [{pct(part['ci'][0]).strip()}, {pct(part['ci'][1]).strip()}] n={part['n']}"

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
