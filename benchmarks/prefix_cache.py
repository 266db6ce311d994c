"""Prefix caching with CHUNKED_KV against vLLM's default CPU backend, from one run.

Two measurements, each backend in a fresh in-process engine (its own
interpreter) with prefix caching on:

- **hits**: a 600-token prompt, the same prompt again, its first 400 tokens
  plus 3 new ones, the 600 plus 2 new ones, then its first 300 tokens twice
  with different continuations (a shared system prompt: the first of them
  marks the junction, the second hits it); vLLM's `num_cached_tokens` for
  each (the default backend, then `chunked_kv` with and without sinks);
- **chat**: a conversation of `--turns` turns, each adding `--turn-tokens`
  tokens and resending everything before (2k, 4k, 6k, 8k tokens by
  default); the time to first token of each turn (wall time of a
  `max_tokens=1` call) and its cached tokens. Turn 1 is a cold prefill;
  later turns reuse what the previous turns cached.

    python benchmarks/prefix_cache.py --json results/prefix_cache.json

`--retention N` passes vLLM's `--prefix-cache-retention-interval` to the
chunked engines (default 0: raw tails kept only at the end of each step; a
multiple of vLLM's scheduler block size; see docs/prefix-caching.md).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

from vllm_chunked_kv.runner.engine import run_json_script, worker_or_main

from bench_model import build_bench_model


def worker(spec: dict) -> dict:
    """Runs in a fresh interpreter: send the rounds in order, one request at a time."""
    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"])
    params = SamplingParams(temperature=0.0, max_tokens=1)
    llm.generate([{"prompt_token_ids": [2] * 8}], params, use_tqdm=False)  # warm-up: first-call overheads
    rows = []
    for ids in spec["rounds"]:
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
        rows.append({"tokens": len(ids), "cached": int(out.num_cached_tokens or 0),
                     "seconds": time.perf_counter() - start})
    return {"rows": rows}


def measure(model: Path, engine: dict, rounds: list[list[int]], threads: int) -> list[dict]:
    spec = {"model": str(model), "engine": engine, "rounds": rounds}
    env = {"OMP_NUM_THREADS": str(threads)}
    return run_json_script([sys.executable, __file__, "--worker"], spec, None, env=env, marker='{"rows"')["rows"]


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [2] + [rng.randrange(10, 250) for _ in range(n - 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the benchmark Llama, built in a temp dir)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--turn-tokens", type=int, default=2048)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--retention", type=int, default=0, help="vLLM's --prefix-cache-retention-interval")
    parser.add_argument("--threads", type=int, default=1, help="OMP threads of each engine")
    parser.add_argument("--chunked-kv", default='{"chunk_size": 4, "window": 128, "sink_tokens": 4}')
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = json.loads(args.chunked_kv)
    prompt = tokens(0, 600)
    hit_rounds = [prompt, prompt, prompt[:400] + [5, 6, 7], prompt + [8, 9],
                  prompt[:300] + tokens(2, 300)[1:], prompt[:300] + tokens(3, 50)[1:]]
    conversation = tokens(1, args.turns * args.turn_tokens)
    chat_rounds = [conversation[: (t + 1) * args.turn_tokens] for t in range(args.turns)]
    engine = dict(enforce_eager=True, dtype=args.dtype, max_model_len=args.turns * args.turn_tokens + 16,
                  max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=True,
                  kv_cache_memory_bytes=1 << 30, seed=0)
    chunked = {"attention_backend": "chunked_kv", "prefix_cache_retention_interval": args.retention}
    backends = {  # vLLM refuses a retention interval for a model without sliding-window groups
        "default": {},
        "chunked_kv": {**chunked, "additional_config": {"chunked_kv": settings}},
        "chunked_kv, no sinks": {**chunked, "additional_config": {"chunked_kv": {**settings, "sink_tokens": 0}}},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_bench_model(Path(tmp) / "bench-llama")
        hits = {name: measure(model, {**engine, **extra}, hit_rounds, args.threads) for name, extra in backends.items()}
        chat = {name: measure(model, {**engine, **backends[name]}, chat_rounds, args.threads)
                for name in ("default", "chunked_kv")}

    print(f"model={args.model or 'benchmark Llama'} chunked_kv={json.dumps(settings)} retention={args.retention} "
          f"max_num_batched_tokens={args.max_num_batched_tokens} threads={args.threads}")
    labels = ["600 tokens, first", "the same 600 again", "first 400 + 3 new", "the 600 + 2 new",
              "first 300 + 299 new", "first 300 + 49 other new"]
    print("| request | " + " | ".join(f"{name}: cached tokens" for name in hits) + " |")
    for i, label in enumerate(labels):
        print(f"| {label} | " + " | ".join(str(rows[i]["cached"]) for rows in hits.values()) + " |")
    print("\n| turn | tokens | default: TTFT s (cached) | chunked_kv: TTFT s (cached) | ratio |")
    for t, (d, c) in enumerate(zip(chat["default"], chat["chunked_kv"]), start=1):
        print(f"| {t} | {d['tokens']} | {d['seconds']:.2f} ({d['cached']}) | {c['seconds']:.2f} ({c['cached']}) "
              f"| {c['seconds'] / d['seconds']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "hits": hits,
                                         "chat": chat}, indent=2))


if __name__ == "__main__":
    worker_or_main(worker, main)
