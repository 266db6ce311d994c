"""Serving throughput under load at a fixed KV budget, as a vLLM user measures it:
vLLM's default backend against CHUNKED_KV, the same flags, one server after the other,
each driven by vLLM's own client, `vllm bench serve` (random dataset, `--ignore-eos`,
a fixed seed).

    python benchmarks/serve_load.py --model DIR --rows all --json benchmarks/results/serve_load_smollm2.json

`DIR` is served as it is: a directory that carries `chunked_kv_serve.json` (the
adapted SmolLM2 from `vllm-chunked-kv models fetch smollm2-135m --adapted`) is
served with its own settings by `--attention-backend chunked_kv`; `--chunked-kv
JSON` gives the settings explicitly. A row is a workload and a KV budget
(`ROWS`: the four of the capacity-to-throughput issue, or `--input-len ...` for
one of your own). For each row and server it reports what `vllm bench serve`
measured (output tokens/s, TTFT and TPOT p50/p99) and what the engine's own
periodic log line says (the most requests running at once, the mean prompt and
generation tokens/s while busy), the preemptions vLLM counted and the KV budget.
The results name the CPU (model, AMX / AVX-512 flags) and the path vLLM's default
CPU attention takes on it for the model's head size (`amx` or `vec`), since the
default's speed, and so every ratio, depends on it.

`--kv-cache-dtypes auto,fp8` serves each row four times: both backends with pages in
the model's dtype and in FP8, and adds each FP8 chunked server's ratios to the chunked
server on the model's dtype and to the default backend on FP8 pages.

`--scaling` adds, per row, a third run: the default backend with a KV budget that
does not bind (`--scaling-budget`) and its concurrency capped at what the chunked
server reached, i.e. what the default backend's own batch scaling allows at that
concurrency, the ceiling a compressed cache can hope to reach at that batch.
Ratios are chunked over default (output tokens/s: higher is better; TTFT, TPOT:
lower is better). A benchmark measures: nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from cpu_kernel import vllm_isa  # benchmarks/: run as a script

from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.runner.server import VllmServer, vllm_executable

MiB = 1 << 20
# name -> (input tokens, output tokens, prompts, KV budget, max-num-seqs, max-concurrency or None: = prompts)
ROWS = {
    "6000x512": (6000, 512, 16, 600 * MiB, 16, None),
    "2000x256": (2000, 256, 32, 200 * MiB, 32, None),
    "512x512": (512, 512, 32, 100 * MiB, 32, None),
    "512x512-capped13": (512, 512, 26, 400 * MiB, 13, None),
}
ENGINE_LINE = re.compile(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                         r"Running: (\d+) reqs, Waiting: (\d+) reqs")


def engine_stats(log: str) -> dict:
    """From the engine's periodic log lines: the most requests running at once and the
    mean prompt / generation tokens/s over the lines with work in them."""
    lines = [tuple(float(x) for x in m.groups()) for m in ENGINE_LINE.finditer(log)]
    busy = [line for line in lines if line[2] > 0 or line[3] > 0]
    mean = lambda values: round(sum(values) / len(values), 1) if values else None  # noqa: E731
    return {"max_running": int(max((line[2] for line in lines), default=0)),
            "prompt_tokens_per_s": mean([line[0] for line in busy]),
            "generation_tokens_per_s": mean([line[1] for line in busy]), "log_lines": len(lines)}


def counter(metrics: str, name: str) -> float:
    return sum(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


def bench_serve(base_url: str, model: str, tokenizer: str, row: tuple, seed: int, out_dir: Path,
                timeout: float) -> dict:
    """`vllm bench serve` once; its saved JSON."""
    input_len, output_len, prompts, _, _, concurrency = row
    name = f"bench_{int(time.time() * 1000)}.json"
    command = [vllm_executable(), "bench", "serve", "--backend", "vllm", "--base-url", base_url, "--model", model,
               "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(input_len),
               "--random-output-len", str(output_len), "--num-prompts", str(prompts),
               "--max-concurrency", str(concurrency or prompts), "--ignore-eos", "--seed", str(seed),
               "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
               "--save-result", "--result-dir", str(out_dir), "--result-filename", name]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    return json.loads((out_dir / name).read_text())


def serve_and_load(opts: argparse.Namespace, server_args: list[str], row: tuple, label: str) -> dict:
    """One server, one `vllm bench serve` run against it: the client's figures and the engine's."""
    input_len, output_len, _, budget, max_seqs, _ = row
    args = ["--enforce-eager", "--dtype", opts.dtype, "--max-model-len", str(input_len + output_len + 16),
            "--kv-cache-memory-bytes", str(budget), "--max-num-seqs", str(max_seqs), *server_args]
    with (tempfile.TemporaryDirectory() as tmp,
          VllmServer(opts.model, args, defaults=[], timeout=opts.start_timeout) as server):
        served = server.openai_client().models.list().data[0].id
        result = bench_serve(server.base_url, served, opts.model, row, opts.seed, Path(tmp), opts.timeout)
        metrics = urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30).read().decode()
        log = server.log()
    if opts.logs:
        opts.logs.mkdir(parents=True, exist_ok=True)
        (opts.logs / f"{label}.log").write_text(log)
    keys = ("output_throughput", "request_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
            "p99_tpot_ms", "completed", "duration")
    return {**{k: result.get(k) for k in keys}, **engine_stats(log),
            "preemptions": counter(metrics, "vllm:num_preemptions_total"), "kv_budget_mib": budget // MiB,
            "max_num_seqs": max_seqs, "chunked_kv_running": "Using CHUNKED_KV attention backend" in log}


def ratios(chunked: dict, default: dict) -> dict:
    def over(key):
        return round(chunked[key] / default[key], 2) if chunked.get(key) and default.get(key) else None

    return {"output_tok_s": over("output_throughput"), "ttft_p50": over("median_ttft_ms"),
            "tpot_p50": over("median_tpot_ms")}


def run_row(opts: argparse.Namespace, name: str, row: tuple) -> dict:
    chunked_args = ["--attention-backend", "chunked_kv"]
    if opts.chunked_kv:
        chunked_args += ["--additional-config", json.dumps({"chunked_kv": json.loads(opts.chunked_kv)})]
    out = {"row": name, "input_len": row[0], "output_len": row[1], "prompts": row[2]}
    caches = [c.strip() for c in opts.kv_cache_dtypes.split(",") if c.strip()]
    for cache in caches:  # the first cache dtype's pair is the row's default / chunked / ratio
        pages = [] if cache == "auto" else ["--kv-cache-dtype", cache]
        tag = "" if cache == "auto" else f"-{cache}"
        pair = {"default": serve_and_load(opts, pages, row, f"{name}-default{tag}")}
        print(json.dumps({name: {cache: {"default": pair["default"]}}}), flush=True)
        pair["chunked"] = serve_and_load(opts, chunked_args + pages, row, f"{name}-chunked{tag}")
        print(json.dumps({name: {cache: {"chunked": pair["chunked"]}}}), flush=True)
        pair["ratio"] = ratios(pair["chunked"], pair["default"])
        if cache == caches[0]:
            out.update(pair)
        if len(caches) > 1:
            out.setdefault("caches", {})[cache] = pair
    if "caches" in out and "auto" in out["caches"]:  # each FP8 cache against the model dtype's pages
        for cache, pair in out["caches"].items():
            if cache != "auto":
                out[f"{cache}_ratio"] = {
                    "chunked_over_chunked_auto": ratios(pair["chunked"], out["caches"]["auto"]["chunked"]),
                    "chunked_over_default": pair["ratio"]}
    if opts.scaling:
        reached = max(1, out["chunked"]["max_running"])
        scaled = (row[0], row[1], row[2], opts.scaling_budget * MiB, reached, reached)
        out["default_at_chunked_concurrency"] = serve_and_load(opts, [], scaled, f"{name}-default-scaling")
        ceiling = out["default_at_chunked_concurrency"]["output_throughput"]
        out["ratio"]["of_default_scaling"] = round(out["chunked"]["output_throughput"] / ceiling, 2) if ceiling else None
    print(json.dumps({name: {"ratio": out["ratio"]}}), flush=True)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="model directory (served as it is)")
    p.add_argument("--rows", default="all", help=f"comma-separated of {', '.join(ROWS)}, or all")
    p.add_argument("--input-len", type=int, help="a row of your own: input tokens (with the four below)")
    p.add_argument("--output-len", type=int)
    p.add_argument("--prompts", type=int)
    p.add_argument("--kv-mib", type=int)
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--chunked-kv", help="chunked_kv settings as JSON (default: the model's serve file, or defaults)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-dtypes", default="auto",
                   help="comma-separated --kv-cache-dtype values, each served by both backends (auto,fp8: the four "
                   "combinations of default / chunked and model-dtype / FP8 pages)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scaling", action="store_true", help="add the default backend at the chunked concurrency")
    p.add_argument("--scaling-budget", type=int, default=2048, help="MiB of KV for the --scaling run")
    p.add_argument("--timeout", type=float, default=3600, help="seconds for one vllm bench serve run")
    p.add_argument("--start-timeout", type=float, default=600, help="seconds for a server to start")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--logs", type=Path, help="keep each server's log in this folder")
    return p.parse_args(argv)


def default_isa(model_dir: str, dtype: str) -> str | None:
    """The path vLLM's default CPU attention takes for this model (its head size,
    the CPU platform's 128-token pages) on this CPU."""
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    config = config.get("text_config", config)
    head_size = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return vllm_isa(getattr(torch, dtype), head_size)


def main(argv=None) -> int:
    opts = parse_args(argv)
    if opts.input_len:
        rows = {"custom": (opts.input_len, opts.output_len, opts.prompts, opts.kv_mib * MiB, opts.max_num_seqs, None)}
    else:
        names = list(ROWS) if opts.rows == "all" else opts.rows.split(",")
        rows = {name: ROWS[name] for name in names}
    results = {"model": opts.model, "dtype": opts.dtype, "seed": opts.seed, "cpu": dispatch.cpu_description(),
               "default_isa": default_isa(opts.model, opts.dtype),
               "command": " ".join(["python", "benchmarks/serve_load.py", *(sys.argv[1:] if argv is None else argv)]),
               "rows": [run_row(opts, name, row) for name, row in rows.items()]}
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps(results, indent=2) + "\n")
    print(f"cpu={results['cpu']['model']!r} flags={','.join(results['cpu']['flags'])} "
          f"default isa={results['default_isa']}")
    for r in results["rows"]:
        for cache, pair in r.get("caches", {"": r}).items():
            d, c, ratio = pair["default"], pair["chunked"], pair["ratio"]
            print(f"{r['row']:>18} {cache:>8}: running {d['max_running']} -> {c['max_running']}, output tok/s "
                  f"{d['output_throughput']:.1f} -> {c['output_throughput']:.1f} ({ratio['output_tok_s']}x), "
                  f"TTFT p50 {ratio['ttft_p50']}x, TPOT p50 {ratio['tpot_p50']}x")
        for key in (k for k in r if k.endswith("_ratio")):
            print(f"{r['row']:>18} {key}: {json.dumps(r[key])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
