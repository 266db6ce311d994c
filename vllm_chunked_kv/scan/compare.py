"""A/B scans: the same probes sent to two endpoints, paired by probe id (`scan --compare-url`).

Per axis (`report.AXES`) and per phase of that axis (`report.axis_phase`):
how many probes each endpoint got right, the probes whose outcome flips
(`a_only`: right on A, wrong on B; `b_only`: the reverse), McNemar's test
on those discordant pairs (`stats.mcnemar`), and next to it the unpaired
view: A's accuracy minus B's with Newcombe's interval, as if the two runs
had used different prompts. Pairing removes the prompt-to-prompt variance
both runs share, so McNemar sees differences the unpaired interval cannot.
"""

from __future__ import annotations

from vllm_chunked_kv.scan.records import Record
from vllm_chunked_kv.scan.report import AXES, axis_phase, group_by
from vllm_chunked_kv.scan.stats import mcnemar, newcombe_difference

Pair = tuple[Record, Record]  # (A's record, B's record) of one probe


def _paired(pairs: list[Pair]) -> dict:
    n = len(pairs)
    correct_a = sum(a.correct for a, _ in pairs)
    correct_b = sum(b.correct for _, b in pairs)
    a_only = sum(a.correct and not b.correct for a, b in pairs)
    test = mcnemar(a_only, sum(b.correct and not a.correct for a, b in pairs))
    difference, lo, hi = newcombe_difference(correct_a, n, correct_b, n)
    return {
        "n": n,
        "accuracy_a": correct_a / n,
        "accuracy_b": correct_b / n,
        "a_only": test.a_only,
        "b_only": test.b_only,
        "completion_changed": sum(" ".join(a.completion.split()) != " ".join(b.completion.split()) for a, b in pairs),
        "mcnemar": {"statistic": test.statistic, "p_value": test.p_value, "method": test.method},
        "unpaired_difference": {"value": difference, "ci": [lo, hi], "method": "Newcombe hybrid score (A - B)"},
    }


def compare_axis(kind: str, pairs: list[Pair], hop: int) -> dict:
    phases = group_by(pairs, lambda pair: axis_phase(kind, pair[0], hop))
    flips = [
        {"probe_id": a.probe_id, "phase": axis_phase(kind, a, hop), "correct_a": a.correct, "correct_b": b.correct,
         "completion_a": a.completion, "completion_b": b.completion}
        for a, b in pairs
        if a.correct != b.correct
    ]
    return {
        **_paired(pairs),
        "phase_of": "prompt length mod hop" if kind == "length" else "target position mod hop",
        "by_phase": [{"phase": phase, **_paired(group)} for phase, group in phases.items()],
        "flips": flips,
    }


def compare_records(records_a: list[Record], records_b: list[Record], hop: int) -> dict:
    """Every axis both runs answered, paired by probe id; probes only one side answered are counted."""
    by_id = {r.probe_id: r for r in records_b}
    out: dict = {"unpaired_probes": len({r.probe_id for r in records_a} ^ set(by_id))}
    for kind in AXES:
        pairs = [(a, by_id[a.probe_id]) for a in records_a if a.probe == kind and a.probe_id in by_id]
        if pairs:
            out[kind] = compare_axis(kind, pairs, hop)
    return out


def _line(label: str, row: dict) -> str:
    test, diff = row["mcnemar"], row["unpaired_difference"]
    return (
        f"  {label}: A {100 * row['accuracy_a']:5.1f}%  B {100 * row['accuracy_b']:5.1f}%  n={row['n']}  "
        f"flips A-only {row['a_only']}, B-only {row['b_only']}; McNemar p={test['p_value']:.3g} ({test['method']}); "
        f"unpaired A-B {100 * diff['value']:+.1f} [{100 * diff['ci'][0]:+.1f}, {100 * diff['ci'][1]:+.1f}] points"
    )


def format_compare(comparison: dict, hop: int, names: tuple[str, str], examples: int = 3) -> str:
    """The paired report as text: per axis, all probes then each phase, and a few flipped probes."""
    lines = [f"A/B: A = {names[0]}, B = {names[1]}; flips = probes right on one endpoint and wrong on the other"]
    for kind in AXES:
        if kind not in comparison:
            continue
        c = comparison[kind]
        lines.append(f"{kind} probe, paired ({c['phase_of']}):")
        lines.append(_line("all    ", c))
        lines += [_line(f"phase {row['phase']}", row) for row in c["by_phase"]]
        for flip in c["flips"][:examples]:
            lines.append(
                f"    e.g. {flip['probe_id']} (phase {flip['phase']}): A {flip['completion_a']!r}"
                f"{' ok' if flip['correct_a'] else ''}, B {flip['completion_b']!r}{' ok' if flip['correct_b'] else ''}"
            )
    if comparison.get("unpaired_probes"):
        lines.append(f"  ({comparison['unpaired_probes']} probes were answered by one endpoint only)")
    return "\n".join(lines)
