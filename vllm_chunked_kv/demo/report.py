"""TRAINING.md beside a trained demo model: how it was made and how well it does.

Written by `demo.train` from what it measured: the command, the seed, the
time per curriculum phase, held-out accuracy with full attention and the
needle-phase sweep under the fine-tuning compression, each with Wilson 95%
intervals.
"""

from __future__ import annotations

import platform
import sys

import torch

from vllm_chunked_kv.demo.evaluate import NEEDLE_RANGE, accuracy, format_percent, needle_sweep


def _sweep_row(name: str, result) -> str:
    cells = [format_percent(g.correct, g.n) for g in result.groups]
    gap = result.gap
    gap_cell = f"{100 * gap.value:.1f} [{100 * gap.ci_low:.1f}, {100 * gap.ci_high:.1f}]"
    return f"| {name} | " + " | ".join(cells) + f" | {gap_cell} |"


def write_training_report(model, args, record, seconds: float) -> None:
    """Evaluate `model` and write `args.out / TRAINING.md`."""
    from vllm_chunked_kv.demo.train import FINETUNE_COMPRESSION

    n = args.eval_prompts
    full = format_percent(*accuracy(model, n, seed=args.seed))
    full_sweep = needle_sweep(model, None, per_phase=n, seed=args.seed)
    chunked_sweep = needle_sweep(model, FINETUNE_COMPRESSION, per_phase=n, seed=args.seed)
    command = "python -m vllm_chunked_kv.demo.train " + " ".join(sys.argv[1:])
    phases = "\n".join(f"| {name} | {steps} | {secs:.0f} |" for name, steps, secs in record)
    cfg = FINETUNE_COMPRESSION
    text = f"""# Demo model: how it was trained

Command: `{command}`

Seed {args.seed}, steps scale {args.steps_scale}, {args.threads} torch thread(s),
torch {torch.__version__}, {platform.processor() or platform.machine()}.
Total training time: {seconds / 60:.1f} minutes.

| phase | steps | seconds |
| --- | --- | --- |
{phases}

## Accuracy (transformers, greedy, Wilson 95% intervals)

Held-out prompts at the demo context length (243 tokens, 48 records), full
attention: {full} ({n} prompts).

Needle-phase sweep (target positions in [{NEEDLE_RANGE[0]}, {NEEDLE_RANGE[1]}], grouped by
position mod 4, position-matched, {n} prompts per phase). Chunked: mean
pooling, chunk_size {cfg.chunk_size}, window {cfg.window}, {cfg.sink_tokens} sinks.

| attention | phase 0 | phase 1 | phase 2 | phase 3 | gap (best - worst) |
| --- | --- | --- | --- | --- | --- |
{_sweep_row("full", full_sweep)}
{_sweep_row("chunked mean-4", chunked_sweep)}
"""
    (args.out / "TRAINING.md").write_text(text)

