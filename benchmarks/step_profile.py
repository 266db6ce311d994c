"""Where a step's time goes, both backends, inside a real engine.

For each backend a fresh in-process engine (its own interpreter) serves
`--prompts` requests of `--input` tokens, `--output` tokens each, at most
`--batch` at once. Every model step is timed (`execute_model`), and inside
it the attention layers' forward; for CHUNKED_KV also its parts, summed over
the layers: the step plan (`plan_step`, made by the metadata builder once
per set of grid origins, before the layers run), `write_raw`, `write_chunks` and `attend`. Steps are split into
decode steps (every scheduled request computes one token) and mixed steps
(a prefill piece among them); each column is the median over those steps,
in ms. ``attn GB/s`` is the attention's KV bytes per decode step over its
time: the rows each backend reads (the default: every token of every
request; CHUNKED_KV: sinks, raw region and visible slots), keys and values,
every KV head and layer.

    python benchmarks/step_profile.py --model DIR --batch 14 --input 512 --output 64
    python benchmarks/step_profile.py --shape bench --batch 1 --input 32000 --output 64

`--shape bench` is the random 4-layer Llama of `throughput.py` (8 query and
2 KV heads of 64), served with ``{"chunk_size": 4, "window": 128,
"sink_tokens": 4}``; a model directory is served with its own
``chunked_kv_serve.json`` when it has one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from vllm_chunked_kv.runner.engine import run_json_script, worker_or_main

from bench_model import build_bench_model
from throughput import SHAPES

PARTS = ("plan", "write_raw", "write_chunks", "attend")


def _timed(table: dict, key: str, fn):
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            table[key] += time.perf_counter() - start
    return run


def worker(spec: dict) -> dict:
    """Runs in a fresh interpreter: serve the prompts, time every step."""
    import random

    from vllm import LLM, SamplingParams
    from vllm.v1.worker import gpu_model_runner

    current: dict = defaultdict(float)  # this step's seconds per part
    steps: list[tuple[bool, dict]] = []
    rows_per_layer: list[int] = []  # rows a decode step's attention reads in one layer
    execute = gpu_model_runner.GPUModelRunner.execute_model

    def execute_model(self, scheduler_output, *args, **kwargs):
        current.clear()
        start = time.perf_counter()
        result = execute(self, scheduler_output, *args, **kwargs)
        current["step"] = time.perf_counter() - start
        decode = scheduler_output.total_num_scheduled_tokens == len(scheduler_output.num_scheduled_tokens)
        steps.append((decode, dict(current)))
        return result

    gpu_model_runner.GPUModelRunner.execute_model = execute_model
    if spec["backend"] == "chunked":
        from vllm_chunked_kv.backend import attention
        from vllm_chunked_kv.ops import dispatch

        attention.ChunkedKVImpl.forward = _timed(current, "attention", attention.ChunkedKVImpl.forward)
        plan_step = attention.plan_step

        def counted_plan(*args, **kwargs):
            built = plan_step(*args, **kwargs)
            if kwargs.get("device_seq_lens") is not None:  # a decode step
                keys = built.key_sets[0]
                rows_per_layer.append(int(keys.num_raw.sum()) + int(keys.num_slots.sum()) + keys.query_index.numel())
            return built

        attention.plan_step = _timed(current, "plan", counted_plan)
        ops = dispatch.ops(dispatch.choose("cpu"))
        dispatch.ops = lambda impl: dispatch.Ops(ops.name, *(_timed(current, part, getattr(ops, part))
                                                               for part in PARTS[1:]), ops.native_plans)
    else:
        from vllm.v1.attention.backends import cpu_attn

        cpu_attn.CPUAttentionBackendImpl.forward = _timed(current, "attention", cpu_attn.CPUAttentionBackendImpl.forward)
    llm = LLM(spec["model"], **spec["engine"])
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10, 250) for _ in range(spec["input"])]}
               for _ in range(spec["prompts"])]
    llm.generate(prompts[:1], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    steps.clear()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=spec["output"], ignore_eos=True), use_tqdm=False)
    return {"steps": steps, "rows_per_layer": rows_per_layer}


def summarise(result: dict, layers: int, row_bytes: int, backend: str, batch: int, context: int) -> dict:
    """Median ms per part over decode steps and over mixed steps, and the decode attention's read rate."""
    out = {}
    for kind, decode in (("decode", True), ("mixed", False)):
        chosen = [parts for is_decode, parts in result["steps"] if is_decode == decode]
        keys = sorted({k for parts in chosen for k in parts})
        out[kind] = {"steps": len(chosen), **{k: statistics.median(p.get(k, 0.0) for p in chosen) * 1e3 for k in keys}}
    rows = (statistics.median(result["rows_per_layer"]) if backend == "chunked" and result["rows_per_layer"]
            else batch * context)  # the default reads every token of every request
    seconds = out["decode"].get("attend" if backend == "chunked" else "attention", 0.0) / 1e3
    out["attn_gb_s"] = rows * layers * row_bytes / seconds / 1e9 if seconds else None
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, help="model directory (default: a random model of --shape)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batch", type=int, default=14, help="--max-num-seqs")
    parser.add_argument("--prompts", type=int, help="requests (default: --batch)")
    parser.add_argument("--input", type=int, default=512)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = args.model or build_bench_model(Path(tempfile.gettempdir()) / f"chunked-kv-bench-{args.shape}",
                                            **SHAPES[args.shape])
    config = json.loads((Path(model) / "config.json").read_text())
    head = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    layers, kv_heads = config["num_hidden_layers"], config["num_key_value_heads"]
    row_bytes = kv_heads * 2 * head * (2 if args.dtype in ("bfloat16", "float16") else 4)
    engine = dict(enforce_eager=True, dtype=args.dtype, max_model_len=args.input + args.output + 16,
                  max_num_seqs=args.batch, kv_cache_memory_bytes=4 << 30, enable_prefix_caching=False, seed=0)
    report = {"args": {k: str(v) for k, v in vars(args).items()}}
    for backend in ("default", "chunked"):
        spec = {"model": str(model), "engine": dict(engine), "backend": backend, "input": args.input,
                "output": args.output, "prompts": args.prompts or args.batch}
        if backend == "chunked":
            spec["engine"]["attention_backend"] = "chunked_kv"
            if not (Path(model) / "chunked_kv_serve.json").is_file():
                spec["engine"]["additional_config"] = {"chunked_kv": {"chunk_size": 4, "window": 128, "sink_tokens": 4}}
        result = run_json_script([sys.executable, __file__, "--worker"], spec, None, marker='{"steps"')
        report[backend] = summarise(result, layers, row_bytes, backend, args.batch, args.input + args.output // 2)
        print(backend, json.dumps({k: v if not isinstance(v, dict) else {p: round(x, 3) for p, x in v.items()}
                                   for k, v in report[backend].items()}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    worker_or_main(worker, main)
