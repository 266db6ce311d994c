"""Contract of `benchmarks/cpu_kernel.py`: `time_vllm` runs vLLM's own CPU
attention on the shapes of a chunked step (decode and a batch of prefill
pieces) and gives a positive median time, and a small run of the script
prints one row per case with vLLM's time and the C++/vLLM ratio beside the
C++ kernels' time (vLLM's CPU attention is installed here, so no '-'), torch
SDPA's time and ratio, vLLM's path on this CPU, and the rates (decode: read
and streaming-read GB/s; prefill: GFLOP/s of each kernel); `--json` writes
the same rows with the CPU's model and flags. The FLOP count of the
chunked kernel equals a count of `reference.visible_set` rows."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kernel.py"


def test_vllm_attention_times_the_same_shapes(load_benchmark):
    cpu_kernel = load_benchmark("cpu_kernel")
    shape = dict(layers=1, heads=4, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, repeat=1)
    assert cpu_kernel.time_vllm(300, 3, 1, **shape) > 0
    assert cpu_kernel.time_vllm(300, 2, 100, **shape) > 0


def test_rows_carry_vllm_time_and_ratio(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "300", "--batches", "2",
                           "--prefill", "64", "--prefill-batch", "2", "--layers", "1", "--repeat", "1",
                           "--dtype", "bfloat16", "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.lstrip().startswith(("decode", "prefill"))]
    assert [r[:2] for r in rows] == [["decode", "b=2"], ["prefill", "2x64"]]
    for row in rows:  # label (2 fields), context, plan, py plan, torch, cpp, speedup, vllm, cpp/vllm, ...
        cpp_ms, vllm_ms, ratio = float(row[6]), float(row[8]), float(row[9])
        half = 0.005  # every number is printed to two decimals
        assert vllm_ms > 0 and ratio > 0, row
        assert (cpp_ms - half) / (vllm_ms + half) - half <= ratio <= (cpp_ms + half) / (vllm_ms - half) + half, row
        sdpa_ms, sdpa_ratio = float(row[10]), float(row[11])
        assert sdpa_ms > 0 and sdpa_ratio > 0 and row[12] in ("amx", "vec", "vec16"), row
        assert all(float(rate) > 0 for rate in row[13:16]), row
    saved = json.loads(out.read_text())
    assert saved["cpu"]["model"] and isinstance(saved["cpu"]["flags"], list)
    assert [(r["step"], r["context"]) for r in saved["rows"]] == [("decode", 300), ("prefill", 300)]
    assert saved["rows"][1]["cpp_gflops"] > 0 and saved["rows"][0]["stream_gbs"] > 0


def test_chunked_flops_count_the_visible_rows(load_benchmark):
    from vllm_chunked_kv.core.config import ChunkedKVConfig
    from vllm_chunked_kv.ops.reference import visible_set

    cpu_kernel = load_benchmark("cpu_kernel")
    cfg = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2)
    chunked, full = cpu_kernel.attention_flops(cfg, 60, 5, batch=1, layers=1, heads=1, head_size=1)
    rows = 0
    for t in range(55, 60):
        raw, sealed = visible_set(t, cfg)
        rows += len(raw) + len(sealed)
    assert chunked == rows * 4 and full == sum(t + 1 for t in range(55, 60)) * 4
