"""TRAINING.md beside a trained demo model: how it was made and how well it does.

Written by `demo.train` and `demo.finetune` from what they measured: the
command, the seed, the time per training phase, held-out accuracy with full
attention and the needle-phase sweep with full attention and under each
given compression, each with Wilson 95% intervals; a fine-tune's report also
sweeps the model it started from under the same compressions.
"""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo.evaluate import NEEDLE_RANGE, accuracy, format_percent, needle_sweep


def _sweep_row(name: str, result) -> str:
    cells = [format_percent(g.correct, g.n) for g in result.groups]
    gap = result.gap
    gap_cell = f"{100 * gap.value:.1f} [{100 * gap.ci_low:.1f}, {100 * gap.ci_high:.1f}]"
    return f"| {name} | " + " | ".join(cells) + f" | {gap_cell} |"


def _describe(cfg: ChunkedKVConfig) -> str:
    pooling = f"{cfg.pooling} pooling" + (f" (slot gains {cfg.slot_gains})" if cfg.pooling == "gated" else "")
    text = f"{pooling}, chunk_size {cfg.chunk_size}, window {cfg.window}, {cfg.sink_tokens} sinks"
    if cfg.stagger == "heads":
        text += f", staggered grids (KV head h starts at (h mod {cfg.stagger_groups}) * hop / {cfg.stagger_groups})"
    elif cfg.stagger == "layers":
        text += (f", staggered grids (KV head h of layer l starts at (l + (h mod {cfg.stagger_groups})"
                 f" * hop / {cfg.stagger_groups}) mod hop)")
    elif cfg.stagger != "none":
        text += f", staggered grids (origins per layer and KV head {cfg.stagger})"
    return text


def write_training_report(
    model, out_dir: Path, args, record, seconds: float, modes: dict[str, ChunkedKVConfig], *,
    program: str = "vllm_chunked_kv.demo.train", intro: str = "", baseline=None,
) -> None:
    """Evaluate `model` (full attention and each of `modes`) and write `out_dir / TRAINING.md`.

    `program`: the module named in the command line; `intro`: a paragraph
    under the title; `baseline`: (label, other model) whose sweeps under the
    same `modes` are added as rows named "<label>: <mode>" (e.g. the model a
    fine-tune started from)."""
    n = args.eval_prompts
    full = format_percent(*accuracy(model, n, seed=args.seed))
    rows = [_sweep_row("full", needle_sweep(model, None, per_phase=n, seed=args.seed))]
    rows += [_sweep_row(name, needle_sweep(model, cfg, per_phase=n, seed=args.seed)) for name, cfg in modes.items()]
    if baseline is not None:
        label, other = baseline
        rows += [
            _sweep_row(f"{label}: {name}", needle_sweep(other, cfg, per_phase=n, seed=args.seed))
            for name, cfg in modes.items()
        ]
    command = f"python -m {program} " + " ".join(sys.argv[1:])
    phases = "\n".join(f"| {name} | {steps} | {secs:.0f} |" for name, steps, secs in record)
    described = "\n".join(f"- {name}: {_describe(cfg)}" for name, cfg in modes.items())
    rows_text = "\n".join(rows)
    intro = f"\n{intro.strip()}\n" if intro.strip() else ""
    text = f"""# Demo model: how it was trained
{intro}
Command: `{command}`

Seed {args.seed}, steps scale {args.steps_scale}, {args.threads} torch thread(s),
torch {torch.__version__}, {platform.machine()}.
Total training time: {seconds / 60:.1f} minutes (wall clock, all phases below).

| phase | steps | seconds |
| --- | --- | --- |
{phases}

## Accuracy (transformers, greedy, Wilson 95% intervals)

Held-out prompts at the demo context length (243 tokens, 48 records), full
attention: {full} ({n} prompts).

Needle-phase sweep: target positions in [{NEEDLE_RANGE[0]}, {NEEDLE_RANGE[1]}], grouped by
position mod 4, position-matched, {n} prompts per phase.

{described}

| attention | phase 0 | phase 1 | phase 2 | phase 3 | gap (best - worst) |
| --- | --- | --- | --- | --- | --- |
{rows_text}
"""
    (out_dir / "TRAINING.md").write_text(text)
