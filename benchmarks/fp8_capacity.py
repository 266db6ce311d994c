"""KV capacity of FP8 pages: vLLM's default backend and CHUNKED_KV, each in bf16 and in FP8.

For each request length, four in-process engines with the same
``--kv-cache-memory-bytes`` report vLLM's own capacity (its log line ``KV
cache size: N tokens``): default bf16, default fp8, chunked bf16, chunked
fp8. Theory: FP8 halves every row, so fp8 holds 2x the tokens of bf16 on
either backend; chunked over default is `capacity.theoretical_ratio` (pooled
rows, raw window, kept rows, prefix caching's kept tails).

    python benchmarks/fp8_capacity.py --model DIR --lengths 8192 32768 --json results/fp8_capacity_smollm2.json

`DIR` with a `chunked_kv_serve.json` (the adapted SmolLM2) is measured with
those settings; otherwise chunk 4, window 128, 4 sinks. Requests longer than
the model's own context are allowed for the count (``VLLM_ALLOW_LONG_MAX_MODEL_LEN``):
nothing is generated. Where one request does not fit in the budget (the
default backend at 32k), that engine is measured at 2, 4 or 8 times the
budget and its tokens divided by as much (the result file says which). A
benchmark measures: nothing here asserts a ratio.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from capacity import capacity_tokens, theoretical_ratio  # benchmarks/: run as a script

from vllm_chunked_kv.backend.raw_cache import kept_tail_rows
from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.core.serve_file import read_serve_settings, serve_file_of

DEFAULT_SETTINGS = {"chunk_size": 4, "window": 128, "sink_tokens": 4}


def settings_of(model: Path) -> dict:
    return DEFAULT_SETTINGS if serve_file_of(model) is None else read_serve_settings(model)


def budget_tokens(model: Path, engine: dict) -> tuple[float, int]:
    """(tokens per budget, k): vLLM's capacity at the budget, or, where one request
    of max_model_len does not fit in it (vLLM refuses to start), at k = 2, 4 or 8
    times the budget divided by k (capacity grows in proportion to the budget)."""
    for k in (1, 2, 4, 8):
        try:
            return capacity_tokens(model, {**engine, "kv_cache_memory_bytes": k * engine["kv_cache_memory_bytes"]}) / k, k
        except RuntimeError as exc:
            if "larger than the available KV cache memory" not in str(exc) or k == 8:
                raise
    raise AssertionError("unreachable")


def measure(model: Path, length: int, budget: int, settings: dict, batched: int) -> dict:
    engine = dict(kv_cache_memory_bytes=budget, max_model_len=length, max_num_batched_tokens=batched, dtype="bfloat16")
    chunked = {"attention_backend": "chunked_kv", "additional_config": {"chunked_kv": settings}}
    tokens, scaled = {}, {}
    for name, extra in (("default bf16", {}), ("default fp8", {"kv_cache_dtype": "fp8"}),
                        ("chunked bf16", chunked), ("chunked fp8", {**chunked, "kv_cache_dtype": "fp8"})):
        tokens[name], scaled[name] = budget_tokens(model, {**engine, **extra})
        note = f" (measured at {scaled[name]}x the budget, divided by {scaled[name]})" if scaled[name] > 1 else ""
        print(f"{length:>6} {name:<13} {tokens[name]:>12,.0f}{note}", flush=True)
    cfg = ChunkedKVConfig(**settings)
    num_kv_heads = json.loads((model / "config.json").read_text())["num_key_value_heads"]
    block_size = layout.default_block_size(cfg)
    kept = kept_tail_rows(cfg, block_size, batched, 0)  # prefix caching on (vLLM's default)
    chunked_theory = theoretical_ratio(cfg, length, num_kv_heads, kept, block_size)
    base = tokens["default bf16"]
    return {"max_model_len": length, "tokens": tokens, "budget_multiple": scaled,
            "ratios": {"chunked fp8 / chunked bf16": tokens["chunked fp8"] / tokens["chunked bf16"],
                       "chunked fp8 / default bf16": tokens["chunked fp8"] / base,
                       "chunked bf16 / default bf16": tokens["chunked bf16"] / base,
                       "default fp8 / default bf16": tokens["default fp8"] / base},
            "theory": {"chunked fp8 / chunked bf16": 2.0, "chunked fp8 / default bf16": 2 * chunked_theory,
                       "chunked bf16 / default bf16": chunked_theory, "default fp8 / default bf16": 2.0}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 32768], help="max_model_len of the requests")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    settings = settings_of(args.model)
    rows = [measure(args.model, n, args.kv_cache_memory_bytes, settings, args.max_num_batched_tokens)
            for n in args.lengths]
    for row in rows:
        for name, ratio in row["ratios"].items():
            theory = row["theory"][name]
            print(f"{row['max_model_len']:>6} {name:<28} {ratio:6.2f}x (theory {theory:.2f}x, {ratio / theory:.2f} of it)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"model": str(args.model), "settings": settings,
                                         "kv_cache_memory_bytes": args.kv_cache_memory_bytes, "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
