"""`vllm-chunked-kv demo`: the periodic weak spot and its mitigations, offline.

Runs vLLM on the shipped demo model with the default backend and with
`chunked_kv` under each mitigation, on the same position-matched needle
prompts (docs/design.md §7: only the target record's position changes; groups by
position mod 8 share mean and variance of the position), and prints a table
in the paper's shape: mode, KV rows per token, mean accuracy, worst and best
phase (position mod 4), the gap with its 95% interval, and the period found
in the accuracy-by-position-mod-8 curve. Writes `demo.json` and `demo.png`.

Every mode serves `--model` except those in MODE_MODELS: "stagger fine-tuned"
serves `--stagger-model` (the shipped model fine-tuned further with staggered
grids, `demo/model_stagger`), staggered as it was trained. Prompts are
tokenized once with `--model`'s tokenizer; the demo models share it.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from vllm_chunked_kv.demo import DEFAULT_MODEL_DIR, DEFAULT_STAGGER_MODEL_DIR
from vllm_chunked_kv.demo.modes import MITIGATION_MODES, rows_per_token

PHASES = 4  # the demo's chunk size: phase = position mod 4
OFFSETS = 8  # the period search looks at position mod 8 (periods 2..4 repeat at least twice)
MODES: dict[str, dict | None] = {
    "default backend": None,
    **MITIGATION_MODES,
    "none aligned": {"mitigation": "none", "align": "prompt_end"},  # per-request grid alignment, none's memory
    # Dynamic boundaries: none's chunks (one per 4 tokens on average), stored once per 2-token unit.
    "none dynamic": {"mitigation": "none", "boundaries": "dynamic", "min_chunk": 2},
    "stagger fine-tuned": {"mitigation": "stagger"},
}
# Modes served from another model directory: mode -> the argument naming it.
MODE_MODELS = {"stagger fine-tuned": "stagger_model"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                        help="model directory (default: the shipped demo model), or a known real model name "
                        "(smollm2-135m, gemma3-270m: fetched, served and scanned, see demo/real_model.py)")
    parser.add_argument("--adapted-model", help="with a real model: its adapted directory (default: the cached "
                        "'models fetch NAME --adapted' directory when there is one)")
    parser.add_argument("--stagger-model", default=str(DEFAULT_STAGGER_MODEL_DIR),
                        help="model directory of the 'stagger fine-tuned' mode (default: the shipped one)")
    parser.add_argument("--per-phase", type=int, default=256, help="prompts per position-mod-8 group (x8 per mode)")
    parser.add_argument("--quick", action="store_true", help="64 prompts per group: a fast look, wide intervals")
    parser.add_argument("--window", type=int, default=32, help="raw window of every chunked mode")
    parser.add_argument("--context", type=int, help="real models: prompts of about this many tokens, needles "
                        "anywhere beyond 640 tokens from the end (default: ~440-token prompts)")
    parser.add_argument("--sink-tokens", type=int, default=4, help="sink tokens of every chunked mode")
    parser.add_argument("--modes", default=None, help="comma-separated subset of: " + ", ".join(MODES)
                        + " (real models: see demo/real_model.py)")
    parser.add_argument("--out", default="runs/demo", help="directory for demo.json and demo.png")
    parser.add_argument("--seed", type=int, default=0)


def mode_settings(mode: str, args) -> dict | None:
    base = MODES[mode]
    if base is None:
        return None
    return {"chunk_size": 4, "window": args.window, "sink_tokens": args.sink_tokens, **base}


def mode_model(mode: str, args) -> Path:
    """The model directory `mode` serves."""
    return Path(getattr(args, MODE_MODELS.get(mode, "model")))


def build_prompts(per_group: int, seed: int):
    from vllm_chunked_kv.tasks.kv_retrieval import make_prompt, needle_positions_by_phase

    rng = random.Random(seed)
    groups = needle_positions_by_phase(OFFSETS, per_group, 8, 200, rng)
    return [make_prompt(rng, target_position=p) for offset in range(OFFSETS) for p in groups[offset]]


def run_mode(model: str, settings: dict | None, token_ids: list[list[int]]) -> list[int]:
    from vllm_chunked_kv.runner.engine import generate

    engine = {"max_model_len": 512, "max_num_seqs": 64}
    if settings is not None:
        engine.update(attention_backend="chunked_kv", additional_config={"chunked_kv": settings})
    result = generate(model, engine, [token_ids], max_tokens=1, timeout=3600)
    return [ids[0] for ids in result["outputs"][0]]


def summarise(mode: str, settings, prompts, correct: list[bool]) -> dict:
    from vllm_chunked_kv.scan.period import dominant_period
    from vllm_chunked_kv.scan.stats import compare_groups

    by_phase = [[c for p, c in zip(prompts, correct) if p.target_position % PHASES == ph] for ph in range(PHASES)]
    by_offset = [[c for p, c in zip(prompts, correct) if p.target_position % OFFSETS == o] for o in range(OFFSETS)]
    comparison = compare_groups(list(range(PHASES)), [sum(g) for g in by_phase], [len(g) for g in by_phase])
    period = dominant_period([sum(g) for g in by_offset], [len(g) for g in by_offset])
    return {
        "mode": mode, "settings": settings, "rows_per_token": rows_per_token(settings),
        "n": len(correct), "mean": sum(correct) / len(correct),
        "phases": [g.__dict__ for g in comparison.groups], "gap": comparison.gap.__dict__,
        "chi2_p": comparison.chi2.p_value,
        "period": period.period, "period_reason": period.reason,
        "by_offset": [sum(g) / len(g) for g in by_offset],
    }


def format_table(rows: list[dict]) -> str:
    lines = ["| mode | KV rows/token | mean | worst phase | best phase | gap [95% CI] | period |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        g = r["gap"]
        phases = {p["label"]: p for p in r["phases"]}
        worst, best = phases[g["worst"]], phases[g["best"]]
        lines.append(
            f"| {r['mode']} | {r['rows_per_token']:.2f} | {100 * r['mean']:.1f} "
            f"| {g['worst']}: {100 * worst['accuracy']:.1f} | {g['best']}: {100 * best['accuracy']:.1f} "
            f"| {100 * g['value']:.1f} [{100 * g['ci_low']:.1f}, {100 * g['ci_high']:.1f}] "
            f"| {r['period'] or '-'} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for r in rows:
        xs = [p["label"] for p in r["phases"]]
        ax.plot(xs, [100 * p["accuracy"] for p in r["phases"]], marker="o", label=r["mode"])
        ax.fill_between(xs, [100 * p["ci_low"] for p in r["phases"]], [100 * p["ci_high"] for p in r["phases"]], alpha=0.15)
    ax.set_xticks(range(PHASES))
    ax.set_xlabel("phase of the needle (position mod 4)")
    ax.set_ylabel("accuracy, % (95% Wilson band)")
    ax.set_title("Needle retrieval by phase, chunk size 4")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_real_model(args: argparse.Namespace) -> int:
    """The real-model rows: fetch the model (and find its adapted version), serve and scan each mode."""
    from vllm_chunked_kv.demo import real_model
    from vllm_chunked_kv.models import cache
    from vllm_chunked_kv.models.errors import ModelFetchError
    from vllm_chunked_kv.models.fetcher import fetch
    from vllm_chunked_kv.models.registry import lookup

    try:
        model_dir = fetch(args.model)
    except ModelFetchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    adapted = Path(args.adapted_model) if args.adapted_model else cache.model_dir(lookup(args.model).adapted_name)
    if not cache.is_complete(adapted):
        print(f"no adapted model at {adapted}: its rows are skipped "
              f"(vllm-chunked-kv models fetch {args.model} --adapted)", file=sys.stderr)
        adapted = None
    if args.out == "runs/demo":
        args.out = f"runs/demo-{args.model}" + (f"-{args.context}" if args.context else "")
    args.per_phase = 64 if args.quick else args.per_phase
    return real_model.run(args, model_dir, adapted)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    from vllm_chunked_kv.tasks.kv_retrieval import is_correct

    if not Path(args.model).exists() and "/" not in args.model:
        return run_real_model(args)
    modes = [m.strip() for m in (args.modes or ",".join(MODES)).split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        print(f"error: unknown mode(s) {', '.join(unknown)} (allowed: {', '.join(MODES)})", file=sys.stderr)
        return 2
    model = Path(args.model)
    for path in {model, *(mode_model(m, args) for m in modes)}:
        if not (path / "config.json").exists():
            print(f"error: no model at {path} (train one with python -m vllm_chunked_kv.demo.train, "
                  "or fine-tune one with python -m vllm_chunked_kv.demo.finetune)", file=sys.stderr)
            return 1
    per_group = 64 if args.quick else args.per_phase
    prompts = build_prompts(per_group, args.seed)
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    token_ids = [tokenizer(p.text)["input_ids"] for p in prompts]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    started = time.monotonic()
    for i, mode in enumerate(modes, 1):
        settings = mode_settings(mode, args)
        print(f"[{i}/{len(modes)}] {mode}: {len(prompts)} prompts ... ", end="", file=sys.stderr, flush=True)
        t0 = time.monotonic()
        answers = tokenizer.convert_ids_to_tokens(run_mode(str(mode_model(mode, args)), settings, token_ids))
        correct = [is_correct(a, p.answer) for a, p in zip(answers, prompts)]
        rows.append({**summarise(mode, settings, prompts, correct), "model": str(mode_model(mode, args))})
        print(f"{100 * rows[-1]['mean']:.1f}% in {time.monotonic() - t0:.0f}s", file=sys.stderr, flush=True)
    table = format_table(rows)
    print(table)
    print(f"\n{len(prompts)} prompts per mode ({per_group} per position mod 8), {time.monotonic() - started:.0f}s total")
    (out / "demo.json").write_text(json.dumps({"per_group": per_group, "rows": rows}, indent=2, default=str))
    plot(rows, out / "demo.png")
    print(f"wrote {out / 'demo.json'} and {out / 'demo.png'}", file=sys.stderr)
    return 0
