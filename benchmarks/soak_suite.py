"""Ten-minute soaks, one server after another: vLLM's default backend and
every mitigation, the same load, the memory curve of each, and a verdict.

    taskset -c 1 python benchmarks/soak_suite.py --model-dir DIR --duration 600 \
        --json benchmarks/results/soak_smollm2_10min.json --plot benchmarks/soak_rss.png

Each server is a real `vllm serve` (started on 127.0.0.1 in its own process
group, stopped by PID) that runs `benchmarks/soak.py`'s load for
`--duration` seconds. Pin the whole run to one core (`taskset`) so the
servers share nothing with other work; the ratios are then side by side.

Memory verdict per server: the resident memory (API server plus engine
process) after the warm-up (`--warmup` seconds of load) and its growth over
the last five minutes; `grows` is true when that growth is 5% or more. The
API-server and engine parts are kept apart so a growth can be traced to the
process that owns it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

from vllm_chunked_kv.runner.server import VllmServer

CHUNKED = {"chunk_size": 4, "window": 128, "sink_tokens": 4}
SERVERS = {
    "default backend": None,
    "none": {**CHUNKED, "mitigation": "none"},
    "boundary": {**CHUNKED, "mitigation": "boundary"},
    "overlap": {**CHUNKED, "mitigation": "overlap"},
    "stride2": {**CHUNKED, "mitigation": "stride2", "chunk_size": 2},
    "stagger": {**CHUNKED, "mitigation": "stagger"},
}
SERVE_ARGS = ["--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "2048",
              "--kv-cache-memory-bytes", str(512 << 20), "--max-num-seqs", "16"]


def load_soak():
    spec = importlib.util.spec_from_file_location("soak", Path(__file__).with_name("soak.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def at(samples: list, t: float):
    """The first sample taken at or after `t` seconds (the last one if none)."""
    return next((s for s in samples if s[0] >= t), samples[-1])


def memory_verdict(report: dict, warmup: float, tail: float = 300.0) -> dict:
    """RSS after warm-up, at the start of the last `tail` seconds, at the end;
    the growth over that tail, in percent, overall and per process."""
    rss, parts = report["rss_mb"], report["rss_api_engine_mb"]
    end_t = rss[-1][0]
    tail_start = max(warmup, end_t - tail)
    first, last = at(rss, tail_start), rss[-1]
    growth = 100.0 * (last[1] - first[1]) / first[1]
    p_first, p_last = at(parts, tail_start)[1], parts[-1][1]
    return {
        "after_warmup_mb": at(rss, warmup)[1], "tail_start_s": first[0], "tail_start_mb": first[1],
        "end_mb": last[1], "tail_growth_pct": round(growth, 2), "grows": growth >= 5.0,
        "tail_growth_api_mb": round(p_last[0] - p_first[0], 1),
        "tail_growth_engine_mb": round(p_last[1] - p_first[1], 1),
    }


def run_one(soak, model_dir: str, settings: dict | None, args) -> dict:
    extra = [] if settings is None else [
        "--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": settings})]
    with VllmServer(model_dir, extra, defaults=SERVE_ARGS, timeout=600) as server:
        options = soak.parse_args([
            "--base-url", server.base_url, "--duration", str(args.duration), "--concurrency",
            str(args.concurrency), "--abort", "0.3", "--lengths", args.lengths, "--max-tokens", "64",
            "--pid", str(server.proc.pid), "--sample-every", "10", "--timeout", "600"])
        report = asyncio.run(soak.soak(options))
    report["memory"] = memory_verdict(report, args.warmup)
    report["settings"] = settings
    return report


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, report in results.items():
        ts, mbs = zip(*report["rss_mb"])
        ax.plot(ts, mbs, label=name)
    ax.set_xlabel("seconds of load")
    ax.set_ylabel("server RSS, MB (API server + engine)")
    ax.set_title("Resident memory under load, one server at a time")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(results: dict) -> str:
    """The soak table of benchmarks/README.md, from the suite's JSON."""
    base = results.get("default backend", {}).get("tokens_per_s")
    head = ("| server | completed | aborted | errors | streamed tokens/s (vs default) | TTFT p99 | inter-token p99 "
            "| RSS after warm-up -> end | last 5 min: growth (API / engine) | preemptions | KV usage idle "
            "| probes same |\n" + "| --- " * 12 + "|")
    rows = []
    for name, r in results.items():
        mem = r["memory"]
        ratio = f" ({r['tokens_per_s'] / base:.2f}x)" if base else ""
        rows.append(
            f"| {'`' + name + '`' if r['settings'] else name} | {r['requests']} | {r['aborted']} "
            f"| {sum(r['errors'].values())} | {r['tokens_per_s']:.1f}{ratio} | {r['ttft_p99_s']:.1f} s "
            f"| {r['itl_p99_s']:.2f} s | {mem['after_warmup_mb']:,.0f} -> {mem['end_mb']:,.0f} MB "
            f"| {mem['tail_growth_pct']:+.1f}% ({mem['tail_growth_api_mb']:+.0f} / {mem['tail_growth_engine_mb']:+.0f} MB) "
            f"| {r['preemptions']:.0f} | {r['kv_usage_idle']:g} | {'yes' if r['probes_equal'] else 'no'} |")
    return "\n".join([head, *rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--servers", default=",".join(SERVERS), help="comma-separated subset of: " + ", ".join(SERVERS))
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--lengths", default="64,512,1500")
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--render", action="store_true", help="only print the table (and plot) of --json")
    args = parser.parse_args()
    results = json.loads(args.json.read_text()) if args.json.exists() else {}
    soak = load_soak()
    for name in [] if args.render else args.servers.split(","):
        results[name] = run_one(soak, args.model_dir, SERVERS[name], args)
        args.json.write_text(json.dumps(results, indent=2))  # every finished server is kept
        summary = {k: results[name][k] for k in ("requests", "aborted", "errors", "tokens_per_s", "memory")}
        print(name, json.dumps(summary), flush=True)
    if args.plot:
        plot(results, args.plot)
    print(table(results))


if __name__ == "__main__":
    main()
