"""KV cache capacity of vLLM with CHUNKED_KV against its default backend.

Starts vLLM (an in-process engine, one fresh interpreter per configuration)
with the same ``--kv-cache-memory-bytes`` for the default CPU backend and for
each mitigation, and reads vLLM's own capacity from its log line
``KV cache size: N tokens`` (requests of ``max_model_len`` tokens that fit at
once, times ``max_model_len``). The theoretical ratio is what the memory of
one ``max_model_len`` request needs: ``max_model_len`` raw rows with the
default backend; ``max_model_len / tokens_per_state`` compressed rows plus the
raw window (``window + chunk_size - 1`` rows) plus the rows kept raw forever
(sinks, positions before staggered or per-request aligned grid origins),
and with dynamic boundaries the page of slots each request's units lag by,
with CHUNKED_KV. Each
mitigation is measured with prefix caching off and on (vLLM's default): with
it on, a step also keeps the raw rows later prefix hits need (one hit
alignment of rows and one shared-prefix junction's tail per step with the
default retention, more with an interval; docs/prefix-caching.md), and the
theory of those rows adds them (`kept_tail_rows`).

    python benchmarks/capacity.py --chunk-size 4 --window 128 --max-model-len 8192

`--as-served` measures a model directory as its `chunked_kv_serve.json`
serves it (`--attention-backend chunked_kv` alone, prefix caching on, as a
user starts it) instead of the mitigations, e.g. a shipped adapted model:

    python benchmarks/capacity.py --model $(vllm-chunked-kv models fetch gemma3-270m --adapted | tail -1) \
        --as-served --max-model-len 32768 --json results/capacity.json

Its theory is left out for a hybrid model (its sliding layers keep a window
per request on both backends; tests/models/test_gemma3_vllm.py has that
theory).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.core.serve_file import read_serve_config
from vllm_chunked_kv.backend.raw_cache import kept_tail_rows
from vllm_chunked_kv.runner.engine import generate

from bench_model import build_bench_model

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")


def mitigations(chunk_size: int, window: int) -> dict[str, dict]:
    return {
        "none": dict(mitigation="none", chunk_size=chunk_size, window=window),
        "boundary": dict(mitigation="boundary", chunk_size=chunk_size, window=window),
        "overlap": dict(mitigation="overlap", chunk_size=chunk_size, window=window),
        "stride2": dict(mitigation="stride2", window=window),
        "stagger": dict(mitigation="stagger", chunk_size=chunk_size, window=window),
        "none aligned": dict(mitigation="none", chunk_size=chunk_size, window=window, align="prompt_end"),
        "none dynamic": dict(mitigation="none", chunk_size=chunk_size, window=window, boundaries="dynamic",
                             min_chunk=chunk_size // 2),
    }


def capacity_tokens(model: Path, engine: dict) -> int:
    log = generate(model, engine, rounds=[])["log"]
    found = CAPACITY.findall(log)
    if not found:
        raise RuntimeError("vLLM did not log its KV cache size:\n" + log[-3000:])
    return int(found[-1].replace(",", ""))


def theoretical_ratio(cfg: ChunkedKVConfig, max_model_len: int, num_kv_heads: int, kept_rows: int = 0,
                      block_size: int = 0) -> float:
    lag_rows = layout.dynamic_lag_pages(cfg, block_size) * layout.states_per_block(cfg, block_size) if block_size else 0
    rows = (max_model_len / cfg.tokens_per_state + layout.raw_window(cfg) + layout.model_forever_raw(cfg, num_kv_heads)
            + kept_rows + lag_rows)
    return max_model_len / float(rows)


def as_served(model: Path, engine: dict, default: int) -> dict:
    """The row of `model` served by its own `chunked_kv_serve.json` (no --additional-config),
    against `default`, the default backend's capacity under the same `engine`."""
    cfg = read_serve_config(model)
    tokens = capacity_tokens(model, {**engine, "attention_backend": "chunked_kv"})
    config = json.loads((model / "config.json").read_text())
    hybrid = "sliding_attention" in (config.get("layer_types") or [])
    block_size = engine.get("block_size") or layout.default_block_size(cfg)
    kept = kept_tail_rows(cfg, block_size, engine["max_num_batched_tokens"], 0)  # prefix caching on, as served
    ideal = None if hybrid else theoretical_ratio(cfg, engine["max_model_len"], config["num_key_value_heads"], kept,
                                                  block_size)
    return dict(backend="as served", prefix_caching="on", tokens=tokens, ratio=tokens / default, theoretical=ideal,
                fraction=None if ideal is None else tokens / default / ideal, settings=cfg.describe())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the benchmark Llama, built in a temp dir)")
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=256 << 20)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, help="default: each backend's own choice")
    parser.add_argument("--chunk-size", type=int, default=4)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--retention", type=int, default=0,
                        help="vLLM's --prefix-cache-retention-interval for the runs with prefix caching on")
    parser.add_argument("--as-served", action="store_true",
                        help="measure --model as its chunked_kv_serve.json serves it, not the mitigations")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if args.as_served and not args.model:
        parser.error("--as-served needs --model (a directory with chunked_kv_serve.json)")

    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_bench_model(Path(tmp) / "bench-llama", layers=2)
        num_kv_heads = json.loads((Path(model) / "config.json").read_text())["num_key_value_heads"]
        engine = dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, max_model_len=args.max_model_len,
                      max_num_batched_tokens=args.max_num_batched_tokens)
        if args.block_size:
            engine["block_size"] = args.block_size
        default = capacity_tokens(model, engine)
        rows = [dict(backend="default", prefix_caching="any", tokens=default, ratio=1.0, theoretical=1.0, fraction=1.0)]
        presets = {} if args.as_served else mitigations(args.chunk_size, args.window)
        if args.as_served:
            rows.append(as_served(Path(model), engine, default))
        for name, settings in presets.items():
            cfg = ChunkedKVConfig(**settings)
            for caching in (False, True):
                tokens = capacity_tokens(model, {**engine, "attention_backend": "chunked_kv",
                                                 "enable_prefix_caching": caching,
                                                 "prefix_cache_retention_interval": args.retention if caching else 0,
                                                 "additional_config": {"chunked_kv": settings}})
                block_size = args.block_size or layout.default_block_size(cfg)
                kept = kept_tail_rows(cfg, block_size, args.max_num_batched_tokens, args.retention) if caching else 0
                ideal = theoretical_ratio(cfg, args.max_model_len, num_kv_heads, kept, block_size)
                ratio = tokens / default
                rows.append(dict(backend=name, prefix_caching="on" if caching else "off", tokens=tokens, ratio=ratio,
                                 theoretical=ideal, fraction=ratio / ideal))

    print(f"kv_cache_memory_bytes={args.kv_cache_memory_bytes} max_model_len={args.max_model_len} "
          f"max_num_batched_tokens={args.max_num_batched_tokens} block_size={args.block_size} retention={args.retention} "
          + (f"settings from {Path(args.model) / 'chunked_kv_serve.json'}" if args.as_served
             else f"chunk_size={args.chunk_size} window={args.window}"))
    print(f"{'backend':<12} {'prefix cache':>12} {'KV tokens':>12} {'ratio':>7} {'theory':>7} {'of theory':>9}")
    for row in rows:
        theory = (f"{row['theoretical']:>7.3f} {row['fraction']:>9.3f}" if row["theoretical"] is not None
                  else f"{'-':>7} {'-':>9}")
        print(f"{row['backend']:<12} {row['prefix_caching']:>12} {row['tokens']:>12,} {row['ratio']:>7.3f} {theory}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
