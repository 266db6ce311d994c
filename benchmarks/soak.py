"""A bounded load generator against an OpenAI-compatible server: does it hold up?

    python benchmarks/soak.py --base-url http://127.0.0.1:8000 --duration 600 \
        --concurrency 32 --abort 0.3 --lengths 64,512,2048 --pid SERVER_PID --json soak.json

`--concurrency` streams run for `--duration` seconds, each sending
completions with a prompt of a length drawn from `--lengths` (words of the
filler below, or `--words N`), streamed; a fraction `--abort` of them is cut off by the
client after its first tokens. Every request has its own connection (no
keep-alive), so a transport error is the server's. Reported: requests, errors
by kind (with the first few: message, tokens received, seconds), streamed
tokens/s, time to first token and inter-token latency (p50, p99), the
server's resident memory over time (its process tree, from `--pid`), and
from vLLM's `/metrics` the preemptions and the KV cache usage once idle.
Before and after the load a fixed set of greedy probes is sent one at a
time: `probes_equal` says whether the answers were the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import time
from collections import Counter
from pathlib import Path

import httpx

ENGLISH = "the quick brown fox jumps over the lazy dog while the river runs past the old mill".split()


def probes(words: list[str]) -> list[str]:
    """The fixed greedy probes sent before and after the load."""
    return [" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(40 + 30 * i)) for i in range(4)]


def rss_parts_mb(pid: int | None) -> tuple[float, float] | None:
    """Resident memory of `pid` itself (vLLM's API server) and of its
    children together (the engine core and its helpers), in MB."""
    if pid is None:
        return None
    import psutil

    try:
        root = psutil.Process(pid)
        children = [p for p in root.children(recursive=True) if p.is_running()]
        return root.memory_info().rss / 2**20, sum(p.memory_info().rss for p in children) / 2**20
    except psutil.Error:
        return None


def rss_mb(pid: int | None) -> float | None:
    """Resident memory of `pid` and its children, in MB."""
    parts = rss_parts_mb(pid)
    return None if parts is None else sum(parts)


def metric(text: str, name: str) -> float:
    """Sum of a Prometheus metric's samples over its label sets (0 when absent)."""
    pattern = re.compile(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.eE+-]+)$", re.M)
    return sum(float(v) for v in pattern.findall(text))


async def probe_answers(client: httpx.AsyncClient, model: str, words: list[str]) -> list[str]:
    out = []
    for prompt in probes(words):
        r = await client.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 8,
                                                        "temperature": 0})
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


async def stream_one(client, model, prompt, max_tokens, abort_after, stats) -> None:
    start = time.perf_counter()
    last, tokens = None, 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.8, "stream": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                stats["errors"][f"http {response.status_code}"] += 1
                await response.aread()
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                if last is None:
                    stats["ttft"].append(now - start)
                else:
                    stats["itl"].append(now - last)
                last, tokens = now, tokens + 1
                if abort_after is not None and tokens >= abort_after:
                    stats["aborted"] += 1
                    break
    except (httpx.HTTPError, asyncio.TimeoutError) as exc:
        stats["errors"][type(exc).__name__] += 1
        if len(stats["error_examples"]) < 5:  # where it broke: before the response, or mid-stream
            stats["error_examples"].append({"kind": type(exc).__name__, "message": repr(exc), "tokens": tokens,
                                            "after_s": round(time.perf_counter() - start, 3)})
        return
    stats["requests"] += 1
    stats["tokens"] += tokens


async def soak(args) -> dict:
    # One connection per request: with keep-alive, a pooled connection that the server closes (uvicorn's
    # 5 s keep-alive timeout) just as the client reuses it fails with ReadError, a known HTTP/1.1 race
    # that real clients retry. Without reuse, every transport error reported is the server's.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=args.timeout, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        words = [f"w{i}" for i in range(args.words)] if args.words else ENGLISH
        before = await probe_answers(client, model, words)
        metrics_before = (await client.get("/metrics")).text
        stats = {"requests": 0, "aborted": 0, "tokens": 0, "ttft": [], "itl": [], "errors": Counter(),
                 "error_examples": []}
        rss, parts = [(0.0, rss_mb(args.pid))], [(0.0, rss_parts_mb(args.pid))]
        lengths = [int(x) for x in args.lengths.split(",")]
        started = time.perf_counter()
        deadline = started + args.duration

        async def stream_loop(seed: int) -> None:
            rng = random.Random(seed)
            while time.perf_counter() < deadline:
                n = rng.choice(lengths)
                prompt = " ".join(rng.choice(words) for _ in range(n))
                abort_after = rng.randint(1, 8) if rng.random() < args.abort else None
                await stream_one(client, model, prompt, args.max_tokens, abort_after, stats)

        async def sample_rss() -> None:
            while time.perf_counter() < deadline:
                await asyncio.sleep(args.sample_every)
                now = round(time.perf_counter() - started, 1)
                rss.append((now, rss_mb(args.pid)))
                parts.append((now, rss_parts_mb(args.pid)))

        await asyncio.gather(sample_rss(), *(stream_loop(args.seed * 1000 + i) for i in range(args.concurrency)))
        elapsed = time.perf_counter() - started
        await asyncio.sleep(args.settle)  # aborted requests are freed by the server
        metrics_after = (await client.get("/metrics")).text
        after = await probe_answers(client, model, words)
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else None  # noqa: E731
    return {
        "model": model, "duration_s": round(elapsed, 1), "concurrency": args.concurrency, "abort": args.abort,
        "lengths": lengths, "requests": stats["requests"], "aborted": stats["aborted"],
        "errors": dict(stats["errors"]),
        "error_examples": stats["error_examples"], "tokens_per_s": stats["tokens"] / elapsed,
        "ttft_p50_s": pct(stats["ttft"], 50), "ttft_p99_s": pct(stats["ttft"], 99),
        "itl_p50_s": pct(stats["itl"], 50), "itl_p99_s": pct(stats["itl"], 99),
        "preemptions": metric(metrics_after, "vllm:num_preemptions_total") - metric(metrics_before,
                                                                                 "vllm:num_preemptions_total"),
        "kv_usage_idle": metric(metrics_after, "vllm:kv_cache_usage_perc"),
        "running_idle": metric(metrics_after, "vllm:num_requests_running"),
        "rss_mb": rss, "rss_api_engine_mb": parts, "probes_equal": before == after,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", help="served model name (default: the only one listed)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--abort", type=float, default=0.3, help="fraction of streams the client cuts off")
    parser.add_argument("--lengths", default="64,512,2048", help="prompt lengths in words, drawn uniformly")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--words", type=int, default=0,
                        help="draw prompts from the words w0..wN-1 (the project's test models) instead of English")
    parser.add_argument("--pid", type=int, help="server PID for resident memory (with its children)")
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to wait after the load")
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the report here")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    report = asyncio.run(soak(args))
    print(json.dumps({k: v for k, v in report.items() if k != "rss_mb"}, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
