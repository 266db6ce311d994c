"""Prefill time and decode speed of CHUNKED_KV against vLLM's default CPU
backend, at several context lengths, from one run.

For each backend and context length a fresh in-process engine (its own
interpreter) runs `--batch` requests of that many prompt tokens: with
``max_tokens=1`` (prefill time: the wall time of that call, after one
warm-up call) and with ``max_tokens=1+decode_tokens`` (decode tokens/s:
`decode_tokens` per request over the time between the first and the last
generated token, from vLLM's own request timestamps). Prefix caching is
off. Ratios are CHUNKED_KV over default (prefill: time, lower is better;
decode: tokens/s, higher is better).

    python benchmarks/throughput.py --contexts 2048 8192 16384

`--model DIR` measures a real model directory instead of the built
benchmark Llama (`--dtype` as it is served, e.g. bfloat16); a context plus
the decoded tokens must fit the model's `max_position_embeddings`:

    python benchmarks/throughput.py --model /tmp/smollm2-135m --dtype bfloat16 \
        --contexts 1024 4096 8152 --chunked-kv '{"chunk_size": 4, "window": 128, "sink_tokens": 4}'
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from vllm_chunked_kv.testing.engine_run import run_json_script

from bench_model import build_bench_model


def worker(spec: dict) -> dict:
    """Runs in a fresh interpreter: time prefill and decode of one setting."""
    import random

    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"], disable_log_stats=False)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [2] + [rng.randrange(10, 250) for _ in range(spec["context"] - 1)]}
               for _ in range(spec["batch"])]

    def run(max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    run(1)  # warm-up: first-call overheads
    prefill, _ = run(1)
    _, outputs = run(1 + spec["decode_tokens"])
    # Engine timestamps of the first and last generated token: decode only.
    first = min(out.metrics.first_token_ts for out in outputs)
    last = max(out.metrics.last_token_ts for out in outputs)
    decode_tps = spec["batch"] * spec["decode_tokens"] / (last - first)
    return {"prefill_s": prefill, "decode_tok_s": decode_tps}


def measure(model: Path, engine: dict, context: int, batch: int, decode_tokens: int, threads: int | None) -> dict:
    spec = {"model": str(model), "engine": engine, "context": context, "batch": batch, "decode_tokens": decode_tokens}
    env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
    result = run_json_script([sys.executable, __file__, "--worker"], spec, None, env=env, marker='{"prefill_s"')
    return {key: result[key] for key in ("prefill_s", "decode_tok_s")}


def max_positions(model: Path) -> int | None:
    """The model directory's `max_position_embeddings` (None if it does not say)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings", data.get("text_config", {}).get("max_position_embeddings"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: the benchmark Llama, built in a temp dir)")
    parser.add_argument("--dtype", default="float32", help="dtype both backends serve the model in")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP threads of each engine, the same for both backends (0: vLLM's choice). On a "
                             "machine shared with other work, one thread avoids waiting for busy cores at "
                             "every parallel op")
    parser.add_argument("--chunked-kv", default='{"chunk_size": 4, "window": 128}',
                        help="the chunked_kv settings (JSON)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = json.loads(args.chunked_kv)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_bench_model(Path(tmp) / "bench-llama")
        limit = max_positions(model)
        for context in args.contexts:
            if limit is not None and context + args.decode_tokens + 8 > limit:
                parser.error(f"context {context} + {args.decode_tokens} decode tokens + 8 exceeds the model's "
                             f"{limit} positions (use at most {limit - args.decode_tokens - 8})")
        for context in args.contexts:
            engine = dict(enforce_eager=True, dtype=args.dtype, max_model_len=context + args.decode_tokens + 8,
                          max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False,
                          kv_cache_memory_bytes=2 << 30, seed=0)
            default = measure(model, engine, context, args.batch, args.decode_tokens, args.threads)
            chunked = measure(model, {**engine, "attention_backend": "chunked_kv",
                                      "additional_config": {"chunked_kv": settings}},
                              context, args.batch, args.decode_tokens, args.threads)
            rows.append(dict(context=context, default=default, chunked=chunked,
                             prefill_time_ratio=chunked["prefill_s"] / default["prefill_s"],
                             decode_speed_ratio=chunked["decode_tok_s"] / default["decode_tok_s"]))

    print(f"model={args.model or 'benchmark Llama'} dtype={args.dtype} "
          f"chunked_kv={json.dumps(settings)} batch={args.batch} decode_tokens={args.decode_tokens} "
          f"max_num_batched_tokens={args.max_num_batched_tokens} threads={args.threads}")
    print(f"{'context':>8} {'prefill s default':>18} {'chunked':>8} {'ratio':>6} "
          f"{'decode tok/s default':>21} {'chunked':>8} {'ratio':>6}")
    for row in rows:
        d, c = row["default"], row["chunked"]
        print(f"{row['context']:>8} {d['prefill_s']:>18.2f} {c['prefill_s']:>8.2f} {row['prefill_time_ratio']:>6.2f} "
              f"{d['decode_tok_s']:>21.1f} {c['decode_tok_s']:>8.1f} {row['decode_speed_ratio']:>6.2f}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2))


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        print(json.dumps(worker(json.loads(sys.stdin.read()))), flush=True)
    else:
        main()
