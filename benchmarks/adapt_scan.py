"""Retrieval of an adapted model at a chosen needle distance, through vLLM and the scanner.

Serves MODEL (a directory with `chunked_kv_serve.json`, e.g. what
`vllm-chunked-kv adapt` or `models fetch smollm2-135m --adapted` wrote) the
way it was adapted, or with the default backend (`--default-backend`), and
runs the scanner's needle probe with the shipped prose task. `--window`
is the raw window the needles are placed beyond: 128 (the demo's, ~440-token
prompts, each needle 200-400 tokens before its question) or longer (512:
~750-token prompts, needles 517-730 tokens back). Accuracy falls with
distance for an adapter trained on short rows, so a recipe is judged on
both.

    python benchmarks/adapt_scan.py $(vllm-chunked-kv models fetch smollm2-135m --adapted | tail -1) \\
        --window 512 --per-phase 128 --json results/adapt_scan.json

`--context N` uses the long prompts of `vllm-chunked-kv demo --context N`
instead (a hybrid model's facts beyond its sliding window too). A long scan
cut off goes on where it stopped with the same command and `--out DIR
--resume`.

Prints one JSON object (accuracy with its Wilson interval, accuracy by phase, phase gap,
where the needles were placed, how far back, the misses that were the
in-window distractor's code, the misses that were the right digits in
another order (a mean-pooled row holds its tokens without their order), and
the misses that swapped two neighbouring digits, by the phase of the first
of the two: a pair that no KV head's grid separates is the one read in the
wrong order) and writes it to `--json` when given.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
import time
from pathlib import Path

from vllm_chunked_kv.demo import real_model
from vllm_chunked_kv.scan.stats import clustered_wilson, wilson
from vllm_chunked_kv.core.serve_file import read_serve_settings


def task_lines() -> list[dict]:
    """The shipped task file's needle items, one per line (a probe's item is line i mod lines)."""
    return [json.loads(line) for line in real_model.TASK_FILE.read_text().splitlines() if line.strip()]


def line_of(record: dict, lines: list[dict]) -> dict:
    """The task line a scanner record asked about (user_task.needle_items: line i mod lines)."""
    return lines[int(record["probe_id"].rsplit(":", 1)[1]) % len(lines)]


def distractor_code(line: dict) -> str | None:
    """The code of the line's in-window distractor record, None if it has none."""
    found = re.search(r"access code is (\d+)\. Nobody", line["template"])
    return found.group(1) if found else None


def said(completion: str) -> str:
    """The code a completion gives: " 7313." -> "7313"."""
    return completion.strip().rstrip(".").strip()


def reordered(answer: str, completion: str) -> bool:
    """Whether `completion` gives the digits of `answer` in another order ("7331" for "7313")."""
    code = said(completion)
    return code != answer and sorted(code) == sorted(answer)


def adjacent_swap(answer: str, completion: str) -> int | None:
    """Index i if `completion` is `answer` with digits i and i+1 swapped ("7331" for "7313": 2), else None."""
    code = said(completion)
    diff = [i for i in range(len(answer)) if i >= len(code) or code[i] != answer[i]]
    if len(code) != len(answer) or len(diff) != 2 or diff[1] != diff[0] + 1:
        return None
    i = diff[0]
    return i if (code[i], code[i + 1]) == (answer[i + 1], answer[i]) else None


def swaps_by_pair_phase(records: list[dict], lines: list[dict], model: Path, hop: int) -> dict[str, int]:
    """Adjacent-swap misses counted by the phase (token position mod hop) of the first swapped digit.

    `lines` are `task_lines()`. A record's `position` is its first token's; the code's digits follow at
    the offset where they sit in the record's own tokens (one token a digit;
    a record whose tokenizer merges digits is skipped)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    counts = {str(p): 0 for p in range(hop)}
    for r in records:
        i = None if r["correct"] else adjacent_swap(r["answer"], r["completion"])
        if i is None:
            continue
        line = line_of(r, lines)
        pieces = [tokenizer.decode([t]) for t in tokenizer.encode(line["record"], add_special_tokens=False)]
        n = len(r["answer"])
        first = next((j for j in range(len(pieces) - n + 1) if pieces[j : j + n] == list(r["answer"])), None)
        if first is not None:
            counts[str((r["position"] + first + i) % hop)] += 1
    return counts


def hits_by_needle(records: list[dict], lines: list[dict]) -> dict[str, list[bool]]:
    """Each needle's (task record's) outcomes, one per probe: a needle is asked at every phase."""
    hits: dict[str, list[bool]] = {}
    for r in records:
        hits.setdefault(line_of(r, lines)["record"], []).append(bool(r["correct"]))
    return hits


def by_needle_ci(hits: dict[str, list[bool]]) -> dict:
    """The accuracy interval with the probes of one needle (its phases) as one
    cluster (`stats.clustered_wilson`): misses cluster by needle."""
    n_eff, low, high = clustered_wilson([sum(h) for h in hits.values()], [len(h) for h in hits.values()])
    return {"n_eff": round(n_eff, 1), "ci": [low, high]}


def served_dtype(dtype: str | None) -> str:
    """The dtype the server is started with (`real_model.serve_defaults`)."""
    defaults = real_model.serve_defaults(dtype)
    return defaults[defaults.index("--dtype") + 1]


def measure(model: Path, window: int, per_phase: int, default_backend: bool, out: Path, dtype: str | None = None,
            context: int | None = None, kv_cache_dtype: str = "auto", resume: bool = False) -> dict:
    settings = None if default_backend else read_serve_settings(model)
    started = time.monotonic()
    summary = real_model.scan_mode(model, settings, per_phase, out, window=window, dtype=dtype, context=context,
                                   kv_cache_dtype=kv_cache_dtype, fresh=not resume)
    records = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    needle = summary["results"]["needle"]
    correct = sum(r["correct"] for r in records)
    lines = task_lines()
    misses = [r for r in records if not r["correct"]]
    hits = hits_by_needle(records, lines)
    return {
        "model": str(model), "served": settings or "default backend", "dtype": served_dtype(dtype),
        "kv_cache_dtype": kv_cache_dtype, "window": window,
        "context": context,
        "server_window": needle["window"]["window"] if needle["window"]["source"] == "server" else None,
        "probes": len(records), "correct": correct, "accuracy": correct / len(records),
        "accuracy_ci": list(wilson(correct, len(records))), "accuracy_ci_by_needle": by_needle_ci(hits),
        "gap": needle["gap"],
        "by_phase": {str(g["phase"]): {"n": g["n"], "correct": g["correct"], "accuracy": g["accuracy"]} for g in needle["by_phase"]},
        "distance": [min(r["distance"] for r in records), max(r["distance"] for r in records)],
        "prompt_tokens": [min(r["prompt_units"] for r in records), max(r["prompt_units"] for r in records)],
        # a miss that is the prompt's own in-window distractor code
        "misses_distractor": sum(said(r["completion"]) == distractor_code(line_of(r, lines)) for r in misses),
        "needles": len(hits),  # distinct facts: each is asked at every phase
        "misses_reordered": sum(reordered(r["answer"], r["completion"]) for r in misses),
        "swaps_by_pair_phase": swaps_by_pair_phase(records, lines, model, len(needle["by_phase"])),  # one group a phase
        "seconds": round(time.monotonic() - started),  # of this run; a resumed one's earlier answers not counted
        "resumed": summary["resumed"], "sent": summary["sent"],  # answers kept from --out, and asked now
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--window", type=int, default=real_model.CHUNKED["window"],
                        help="place needles beyond this raw window (default: the demo's 128)")
    parser.add_argument("--context", type=int,
                        help="prompts of about this many tokens, needles far back (`demo --context`: at 4,096 "
                        "1,100-2,800 tokens back, at 16,384 900-11,000); replaces --window")
    parser.add_argument("--per-phase", type=int, default=256)
    parser.add_argument("--default-backend", action="store_true", help="serve without chunked_kv")
    parser.add_argument("--out", type=Path, help="scan output directory (default: a temporary one)")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="serving dtype (default: real_model.SERVE_DEFAULTS's bfloat16; float32 on a CPU without native bf16)")
    parser.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (fp8: FP8 pages)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the answers already in --out (a scan cut off, same settings) and ask only the rest")
    args = parser.parse_args()
    if args.resume and not args.out:
        parser.error("--resume needs --out (the directory of the scan to go on with)")
    out = args.out or Path(tempfile.mkdtemp(prefix="adapt-scan-"))
    result = measure(args.model, args.window, args.per_phase, args.default_backend, out, args.dtype, args.context,
                     args.kv_cache_dtype, args.resume)
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
