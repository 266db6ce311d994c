"""Prefill time and decode speed of CHUNKED_KV against vLLM's default CPU
backend, at several context lengths and batch sizes, from one run.

For each context, batch and implementation a fresh in-process engine (its
own interpreter) runs `batch` requests of that many prompt tokens: when
prefill is timed (batch 1, or every batch with `--prefill-all-batches`) a
warm-up call and a ``max_tokens=1`` call on the same prompts (prefill time:
the second one's wall time), else a warm-up call on short prompts; then
``max_tokens=1+decode_tokens`` (decode tokens/s: `decode_tokens` per
request over the time between the first and the last generated token, from
vLLM's own request timestamps). Prefix caching is off at batch 1. At
larger batches it is on and the prompts are run once before the decode
run, whose prompts then hit the cache: all requests start decoding
together instead of each after the others' prefill, so the rate is that
of the whole batch decoding. The
implementations (`--impls`): ``default`` is vLLM's own backend, ``cpp`` and
``torch`` are CHUNKED_KV with ``CHUNKED_KV_IMPL`` set (the C++ kernels, the
PyTorch path). Ratios are each over default (prefill: time, lower is
better; decode: tokens/s, higher is better).

    python benchmarks/throughput.py --contexts 2048 8192 16384 32768 --batches 1 8

`--shape smollm2` builds a random model of SmolLM2-135M's shape (30 layers,
hidden 576, 9 query and 3 KV heads of 64) with 32k positions instead of the
4-layer benchmark Llama. `--model DIR` measures a real model directory
(`--dtype` as it is served, e.g. bfloat16); a context plus the decoded
tokens must fit the model's `max_position_embeddings`:

    python benchmarks/throughput.py --model /tmp/smollm2-135m --dtype bfloat16 \
        --contexts 1024 4096 8152 --chunked-kv '{"chunk_size": 4, "window": 128, "sink_tokens": 4}'

`--bandwidth` adds, for each batch at the largest context, the C++
attention's read rate against a memcpy of as many bytes on this machine
(`cpu_kernel.py`, the model's shape, the ops alone).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from vllm_chunked_kv.runner.engine import run_json_script, worker_or_main

from bench_model import build_bench_model

IMPLS = ("default", "torch", "cpp")
SHAPES = {  # build_bench_model arguments
    "bench": dict(layers=4, hidden=512, heads=8, kv_heads=2),
    "smollm2": dict(layers=30, hidden=576, heads=9, kv_heads=3),
}


def worker(spec: dict) -> dict:
    """Runs in a fresh interpreter: time prefill and decode of one setting."""
    import random

    from vllm import LLM, SamplingParams

    llm = LLM(spec["model"], **spec["engine"], disable_log_stats=False)
    rng = random.Random(0)

    def prompts(length: int):
        return [{"prompt_token_ids": [2] + [rng.randrange(10, 250) for _ in range(length - 1)]}
                for _ in range(spec["batch"])]

    def run(batch, max_tokens: int):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        outputs = llm.generate(batch, params, use_tqdm=False)
        return time.perf_counter() - start, outputs

    full = prompts(spec["context"])
    # Warm-up: first-call overheads, on the timed prompts when prefill is timed.
    run(full if spec["time_prefill"] else prompts(min(256, spec["context"])), 1)
    prefill = run(full, 1)[0] if spec["time_prefill"] else None
    if spec["batch"] > 1:  # prefix caching is on: the decode run's prompts hit, so all requests decode together
        run(full, 1)
    _, outputs = run(full, 1 + spec["decode_tokens"])
    # Engine timestamps of the first and last generated token: decode only.
    first = min(out.metrics.first_token_ts for out in outputs)
    last = max(out.metrics.last_token_ts for out in outputs)
    decode_tps = spec["batch"] * spec["decode_tokens"] / (last - first)
    return {"prefill_s": prefill, "decode_tok_s": decode_tps}


def measure(model: Path, engine: dict, impl: str, context: int, batch: int, args) -> dict:
    spec = {"model": str(model), "engine": engine, "context": context, "batch": batch,
            "decode_tokens": args.decode_tokens, "time_prefill": batch == 1 or args.prefill_all_batches}
    env = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    if impl != "default":
        env["CHUNKED_KV_IMPL"] = impl
    result = run_json_script([sys.executable, __file__, "--worker"], spec, None, env=env, marker='{"prefill_s"')
    if impl == "cpp":
        assert "chunked KV kernels on cpu: cpp" in result["log"], "the C++ kernels did not run"
    return {key: result[key] for key in ("prefill_s", "decode_tok_s")}


def max_positions(model: Path) -> int | None:
    """The model directory's `max_position_embeddings` (None if it does not say)."""
    config = Path(model) / "config.json"
    if not config.is_file():
        return None
    data = json.loads(config.read_text())
    return data.get("max_position_embeddings", data.get("text_config", {}).get("max_position_embeddings"))


def kv_bytes(model: Path, dtype: str, batch: int, context: int) -> int:
    """KV cache for the default backend's `batch` full-length requests, with room to spare (2 GiB at least)."""
    config = json.loads((Path(model) / "config.json").read_text())
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = config["num_hidden_layers"] * config["num_key_value_heads"] * 2 * head_size
    per_token *= 2 if dtype in ("bfloat16", "float16") else 4
    return max(2 << 30, int(1.3 * batch * (context + 64) * per_token))


def ratios(results: dict) -> dict:
    """Each chunked implementation over the default backend."""
    base = results["default"]
    out = {}
    for impl, res in results.items():
        if impl == "default":
            continue
        prefill = None if res["prefill_s"] is None or base["prefill_s"] is None else res["prefill_s"] / base["prefill_s"]
        out[impl] = {"prefill_time": prefill, "decode_speed": res["decode_tok_s"] / base["decode_tok_s"]}
    return out


def bandwidth_rows(model: Path, args, settings: dict) -> list[dict]:
    """The C++ attention's read rate against a memcpy, per batch at the largest context."""
    import torch

    from vllm_chunked_kv.core.config import ChunkedKVConfig

    from cpu_kernel import memcpy_bandwidth, paged_step, time_ops

    config = json.loads((model / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_size = config.get("head_dim") or config["hidden_size"] // heads
    dtype = getattr(torch, args.dtype)
    cfg, context = ChunkedKVConfig(**settings), max(args.contexts)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    rows = []
    for batch in args.batches:
        caches, paged = paged_step(cfg, context, batch, 1, block_size=32, layers=config["num_hidden_layers"],
                                   num_kv_heads=kv_heads, head_size=head_size, dtype=dtype)
        timed = time_ops("cpp", cfg, caches, paged, heads=heads, head_size=head_size, dtype=dtype, repeat=5)
        rate = timed["bytes"] / timed["step_s"]
        copy = memcpy_bandwidth(timed["bytes"], 5)
        rows.append(dict(context=context, batch=batch, read_bytes=timed["bytes"], read_gb_s=rate / 1e9,
                         memcpy_gb_s=copy / 1e9, fraction=rate / copy))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="model directory (default: a random model of --shape, built in a temp dir)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench", help="the random model's shape")
    parser.add_argument("--dtype", default="float32", help="dtype every implementation serves the model in")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 8192, 16384])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS),
                        help="default (vLLM's backend; always measured) and CHUNKED_KV implementations")
    parser.add_argument("--prefill-all-batches", action="store_true",
                        help="also time prefill at batch sizes above 1 (a whole extra prefill of the batch)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1,
                        help="OMP threads of each engine, the same for every backend (0: vLLM's choice). On a "
                             "machine shared with other work, one thread avoids waiting for busy cores at "
                             "every parallel op")
    parser.add_argument("--chunked-kv", default='{"chunk_size": 4, "window": 128}',
                        help="the chunked_kv settings (JSON)")
    parser.add_argument("--bandwidth", action="store_true", help="also measure the C++ attention's read rate")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    settings = json.loads(args.chunked_kv)
    impls = ["default"] + [impl for impl in args.impls if impl != "default"]

    rows, bandwidth = [], []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(args.model) if args.model else build_bench_model(Path(tmp) / f"{args.shape}-llama",
                                                                       **SHAPES[args.shape])
        limit = max_positions(model)
        for context in args.contexts:
            if limit is not None and context + args.decode_tokens + 8 > limit:
                parser.error(f"context {context} + {args.decode_tokens} decode tokens + 8 exceeds the model's "
                             f"{limit} positions (use at most {limit - args.decode_tokens - 8})")
        for batch in args.batches:
            for context in args.contexts:
                engine = dict(enforce_eager=True, dtype=args.dtype, max_model_len=context + args.decode_tokens + 8,
                              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=batch > 1,
                              kv_cache_memory_bytes=kv_bytes(model, args.dtype, batch, context), seed=0)
                chunked = {**engine, "attention_backend": "chunked_kv", "additional_config": {"chunked_kv": settings}}
                results = {impl: measure(model, engine if impl == "default" else chunked, impl, context, batch, args)
                           for impl in impls}
                rows.append(dict(context=context, batch=batch, results=results, ratios=ratios(results)))
                print_row(rows[-1], impls, header=len(rows) == 1)
        if args.bandwidth:
            bandwidth = bandwidth_rows(model, args, settings)

    print(f"model={args.model or args.shape} dtype={args.dtype} chunked_kv={json.dumps(settings)} "
          f"decode_tokens={args.decode_tokens} max_num_batched_tokens={args.max_num_batched_tokens} "
          f"threads={args.threads}")
    for i, row in enumerate(rows):
        print_row(row, impls, header=i == 0)
    for row in bandwidth:
        print(f"C++ attention, decode batch {row['batch']} at {row['context']}: reads {row['read_gb_s']:.2f} GB/s, "
              f"memcpy {row['memcpy_gb_s']:.2f} GB/s: {row['fraction']:.2f} of it")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows,
                                         "bandwidth": bandwidth}, indent=2))


def print_row(row: dict, impls: list[str], header: bool) -> None:
    """One line per (batch, context): prefill seconds and decode tokens/s of
    each implementation, with each chunked one's ratio to default."""
    chunked = impls[1:]
    if header:
        print(f"{'batch':>5} {'context':>7} | prefill s: {'default':>8} " + " ".join(f"{i:>8} {'ratio':>5}" for i in chunked)
              + f" | decode tok/s: {'default':>8} " + " ".join(f"{i:>8} {'ratio':>5}" for i in chunked), flush=True)
    res, rat = row["results"], row["ratios"]
    fmt = lambda x, spec: "-" if x is None else format(x, spec)  # noqa: E731
    prefill = " ".join(f"{fmt(res[i]['prefill_s'], '8.2f'):>8} {fmt(rat[i]['prefill_time'], '5.2f'):>5}" for i in chunked)
    decode = " ".join(f"{res[i]['decode_tok_s']:>8.1f} {rat[i]['decode_speed']:>5.2f}" for i in chunked)
    print(f"{row['batch']:>5} {row['context']:>7} | prefill s: {fmt(res['default']['prefill_s'], '8.2f'):>8} {prefill}"
          f" | decode tok/s: {res['default']['decode_tok_s']:>8.1f} {decode}", flush=True)


if __name__ == "__main__":
    worker_or_main(worker, main)
