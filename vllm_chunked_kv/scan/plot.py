"""The scan's PNG: accuracy per offset and per phase, with 95% Wilson bands."""

from __future__ import annotations

from pathlib import Path


def _panel(ax, rows: list[dict], key: str, color: str) -> None:
    xs = [row[key] for row in rows]
    acc = [100 * row["accuracy"] for row in rows]
    lo = [100 * row["ci"][0] for row in rows]
    hi = [100 * row["ci"][1] for row in rows]
    ax.fill_between(xs, lo, hi, color=color, alpha=0.25, linewidth=0, label="95% Wilson interval")
    ax.plot(xs, acc, "o-", color=color, label="accuracy")
    ax.set_xticks(xs)
    ax.set_ylim(0, 102)
    ax.set_ylabel("accuracy (%)")
    ax.grid(alpha=0.3)


def plot_summary(summary: dict, path: str | Path, *, hop: int, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [kind for kind in ("offset", "needle") if kind in summary]
    fig, axes = plt.subplots(1, max(1, len(kinds)), figsize=(5.5 * max(1, len(kinds)), 4), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        s = summary[kind]
        gap = s["gap"]
        gap_text = f"gap {100 * gap['value']:.1f} [{100 * gap['ci'][0]:.1f}, {100 * gap['ci'][1]:.1f}] pts"
        if kind == "offset":
            _panel(ax, s["by_offset"], "offset", "tab:blue")
            ax.set_xticklabels([f"{row['offset']}\n({row['phase']})" for row in s["by_offset"]])
            ax.set_xlabel("filler units prepended (target phase)")
            period = s["period"].get("period")
            found = f"period {period}" if period else "no period"
            ax.set_title(f"offset probe: {found}; phase {gap_text}", fontsize=9)
        else:
            _panel(ax, s["by_phase"], "phase", "tab:red")
            ax.set_xlabel(f"target phase (position mod {hop})")
            ax.set_title(f"needle probe: worst phase {s['worst_phase']}; {gap_text}", fontsize=9)
        ax.legend(loc="lower left", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
