"""`vllm-chunked-kv demo --model smollm2-135m`: the real-model rows, through `vllm serve` and the scanner.

For each mode a real `vllm serve` process (bf16, 127.0.0.1, its own process
group) serves the model, and `vllm-chunked-kv scan` runs its needle probe
with the shipped prose task (`tasks/data/prose_codes.jsonl`: a person's code
in everyday prose, asked for after 200 more tokens, so every needle lies
before the 128-token raw window). The table has the mean accuracy with its
Wilson interval, the worst and best phase, and the best - worst gap with its
95% interval, per mode.

Modes: the default backend and every mitigation at chunk 4 (window 128,
4 sinks), plus `key_norm` pooling. When the adapted model is in the cache
(`models fetch smollm2-135m --adapted`, or `--adapted-model DIR`), its rows
follow: the default backend, the settings it was adapted for
(`chunked_kv_serve.json`) and `none`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from vllm_chunked_kv.demo.modes import MITIGATION_MODES, rows_per_token
from vllm_chunked_kv.tasks.prose_codes import TASK_FILE

CHUNKED = {"chunk_size": 4, "window": 128, "sink_tokens": 4}
MODES: dict[str, dict | None] = {"default backend": None, **MITIGATION_MODES, "key_norm": {"pooling": "key_norm"}}
ADAPTED = "adapted"  # prefix of the adapted model's rows
NEEDLE_RANGE = "16:216"  # needle positions; every prompt is ~440 tokens, the needle >= 200 from its end
# Long prompts (`--context N`): needles anywhere from position 16 to LONG_WINDOW + 32 tokens before the
# end, placed for a window of LONG_WINDOW so they lie beyond a 512-token model sliding window (Gemma 3)
# as well as the 128-token raw window: only compressed rows of the global layers can read them.
LONG_WINDOW = 640
SERVE_DEFAULTS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
                  "--kv-cache-memory-bytes", str(512 << 20), "--max-num-seqs", "16"]


def mode_args(settings: dict | None) -> list[str]:
    if settings is None:
        return []
    return ["--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": settings})]


def modes_for(adapted_dir: Path | None) -> list[tuple[str, Path | None, dict | None]]:
    """(row name, model directory or None for the base model, settings) for every row."""
    rows = [(name, None, None if base is None else {**CHUNKED, **base}) for name, base in MODES.items()]
    if adapted_dir is not None:
        from vllm_chunked_kv.core.serve_file import read_serve_settings

        served = read_serve_settings(adapted_dir)
        rows += [
            (f"{ADAPTED}: default backend", adapted_dir, None),
            (f"{ADAPTED}: as adapted ({served.get('stagger', 'none')} grids)", adapted_dir, served),
            (f"{ADAPTED}: none", adapted_dir, {**CHUNKED, "mitigation": "none"}),
        ]
    return rows


def serve_defaults(dtype: str | None = None) -> list[str]:
    """SERVE_DEFAULTS, with `dtype` instead of its bfloat16 when given (float32 where the
    CPU has no native bf16: vLLM's emulated bf16 there answers a scan many times slower)."""
    defaults = list(SERVE_DEFAULTS)
    if dtype is not None:
        defaults[defaults.index("--dtype") + 1] = dtype
    return defaults


def placement(context: int | None) -> tuple[str, int]:
    """(needle range, window the needles are placed for) for prompts of about `context` tokens;
    None: the ~440-token prompts of the table."""
    if context is None:
        return NEEDLE_RANGE, CHUNKED["window"]
    hi = context - LONG_WINDOW - 32  # each prompt: hi + ~LONG_WINDOW + a few tokens
    if hi <= 216:
        raise ValueError(f"--context {context} is too short for needles beyond {LONG_WINDOW} tokens")
    return f"16:{hi}", LONG_WINDOW


def scan_mode(model: Path, settings: dict | None, per_phase: int, out: Path,
              window: int = CHUNKED["window"], dtype: str | None = None, context: int | None = None,
              kv_cache_dtype: str = "auto", fresh: bool = True) -> dict:
    """Serve `model` in `settings` and run the scanner's needle probe against it; its summary.

    The needles are placed for `window` (the table's, `CHUNKED`), not for
    what the server reports: every row, the default backend's included, then
    scans the same prompts (~440 tokens, each needle 200-400 tokens before
    the question), whatever the server answers on /v1/chunked_kv/config.
    A longer `window` pads every prompt so the needles sit further back
    (512: ~750-token prompts, needles 517-730 tokens before the question).
    With `context`, prompts are about that long instead (`placement`) and
    `window` is ignored. `kv_cache_dtype` is vLLM's `--kv-cache-dtype` (fp8: FP8 pages).
    `fresh=False` keeps the answers already in `out` (a scan cut off, same settings)
    and asks only the rest.
    """
    from vllm_chunked_kv.scan import cli as scan_cli
    from vllm_chunked_kv.scan.session import scan
    from vllm_chunked_kv.runner.server import VllmServer

    needles, window = placement(context) if context is not None else (NEEDLE_RANGE, window)
    defaults = serve_defaults(dtype)
    if context is not None:
        defaults[defaults.index("--max-model-len") + 1] = str(context + 256)
    defaults += ["--kv-cache-dtype", kv_cache_dtype]
    parser = argparse.ArgumentParser()
    scan_cli.add_arguments(parser)
    with VllmServer(model, mode_args(settings), defaults=defaults, timeout=600) as server:
        args = parser.parse_args([
            "--base-url", server.base_url, "--task", str(TASK_FILE), "--probe", "needle", "--hop", "4",
            "--per-phase", str(per_phase), "--needle-range", needles, "--window", str(window),
            "--max-tokens", "6",
            "--out", str(out), "--no-progress", "--concurrency", "16", "--timeout", "3600",
        ] + ["--fresh"] * fresh)
        return asyncio.run(scan(args))


def format_table(rows: list[dict]) -> str:
    lines = ["| mode | KV rows / 4 tokens | accuracy [95% CI] | worst phase | best phase | gap [95% CI] | n |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        needle = r["needle"]
        phases = {p["phase"]: p for p in needle["by_phase"]}
        gap = needle["gap"]
        worst, best = phases[needle["worst_phase"]], phases[needle["best_phase"]]
        lo, hi = r["accuracy_ci"]
        lines.append(
            f"| {r['mode']} | {r['rows_per_4']} | {100 * needle['accuracy']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}] "
            f"| {worst['phase']}: {100 * worst['accuracy']:.1f} | {best['phase']}: {100 * best['accuracy']:.1f} "
            f"| {100 * gap['value']:.1f} [{100 * gap['ci'][0]:.1f}, {100 * gap['ci'][1]:.1f}] | {needle['probes']} |"
        )
    return "\n".join(lines)


def rows_per_4(settings: dict | None) -> str:
    return f"{4 * rows_per_token(settings):g}"


def run(args: argparse.Namespace, model_dir: Path, adapted_dir: Path | None) -> int:
    from vllm_chunked_kv.scan.stats import wilson

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    wanted = None if args.modes is None else {m.strip() for m in args.modes.split(",")}
    plan = [m for m in modes_for(adapted_dir) if wanted is None or m[0] in wanted]
    rows, started = [], time.monotonic()
    for i, (mode, model, settings) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {mode}: {4 * args.per_phase} needles ... ", end="", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        slug = mode.replace(" ", "_").replace(",", "").replace(":", "").replace("(", "").replace(")", "")
        summary = scan_mode(model or model_dir, settings, args.per_phase, out / slug, context=args.context)
        needle = summary["results"]["needle"]
        correct = sum(p["correct"] for p in needle["by_phase"])
        lo, hi = wilson(correct, needle["probes"])
        rows.append({"mode": mode, "model": str(model or model_dir), "settings": settings,
                     "rows_per_4": rows_per_4(settings), "accuracy_ci": [lo, hi], "needle": needle})
        print(f"{100 * needle['accuracy']:.1f}% in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
        (out / "real_model.json").write_text(json.dumps(
            {"per_phase": args.per_phase, "context": args.context, "rows": rows}, indent=2))
    print(format_table(rows))
    print(f"\n{4 * args.per_phase} needles per mode, {time.monotonic() - started:.0f}s total; {out / 'real_model.json'}")
    return 0
