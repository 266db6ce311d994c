"""The scan's PNG: one panel per axis with 95% Wilson bands (and the compared endpoint's curve)."""

from __future__ import annotations

from pathlib import Path

# axis -> (rows key, x key, x label, colour)
PANELS = {
    "offset": ("by_offset", "offset", "filler units in front (target phase)", "tab:blue"),
    "needle": ("by_phase", "phase", "target phase (position mod {hop})", "tab:red"),
    "length": ("by_extra", "extra", "filler units after the record (length phase)", "tab:green"),
}


def _panel(ax, rows: list[dict], key: str, color: str, label: str, dashed: bool = False) -> None:
    xs = [row[key] for row in rows]
    acc = [100 * row["accuracy"] for row in rows]
    lo = [100 * row["ci"][0] for row in rows]
    hi = [100 * row["ci"][1] for row in rows]
    ax.fill_between(xs, lo, hi, color=color, alpha=0.12 if dashed else 0.25, linewidth=0)
    ax.plot(xs, acc, "s--" if dashed else "o-", color=color, label=label)
    ax.set_xticks(xs)
    ax.set_ylim(0, 102)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)


def _findings(s: dict) -> str:
    gap = s["gap"]
    gap_text = f"gap {100 * gap['value']:.1f} [{100 * gap['ci'][0]:.1f}, {100 * gap['ci'][1]:.1f}] pts"
    period = s.get("period", {}).get("period")
    found = f"period {period}" if period else "no period"
    return f"{found}; {gap_text}, chi-square p={s['chi2']['p_value']:.2g}"


def plot_summary(
    summary: dict, path: str | Path, *, hop: int, title: str = "", other: dict | None = None, names=("A", "B")
) -> Path:
    """`other`: the compared endpoint's summary, drawn dashed on the same panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [kind for kind in PANELS if kind in summary]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(5.5 * max(1, len(kinds)), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        rows_key, x_key, xlabel, color = PANELS[kind]
        rows = summary[kind][rows_key]
        _panel(ax, rows, x_key, color, names[0] if other else "accuracy (95% Wilson band)")
        if other and kind in other:
            _panel(ax, other[kind][rows_key], x_key, "tab:gray", names[1], dashed=True)
        if kind != "needle":
            phase = "phase" if kind == "offset" else "length_phase"
            ax.set_xticklabels([f"{row[x_key]}\n({row[phase]})" for row in rows])
        ax.set_xlabel(xlabel.format(hop=hop))
        if other and kind in other:
            ax.set_title(f"{kind} probe\nA: {_findings(summary[kind])}\nB: {_findings(other[kind])}", fontsize=8)
        else:
            ax.set_title(f"{kind} probe: {_findings(summary[kind])}", fontsize=8)
        ax.legend(loc="lower left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
