"""Contract of `benchmarks/cpu_kernel.py`: `time_vllm` runs vLLM's own CPU
attention on the shapes of a chunked step (decode and a batch of prefill
pieces) and gives a positive median time, and a small run of the script
prints one row per case with vLLM's time and the C++/vLLM ratio beside the
C++ kernels' time (vLLM's CPU attention is installed here, so no '-')."""

from __future__ import annotations

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


def test_rows_carry_vllm_time_and_ratio():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--contexts", "300", "--batches", "2",
                           "--prefill", "64", "--prefill-batch", "2", "--layers", "1", "--repeat", "1",
                           "--dtype", "bfloat16"], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split() for line in proc.stdout.splitlines() if line.lstrip().startswith(("decode", "prefill"))]
    assert [r[:2] for r in rows] == [["decode", "b=2"], ["prefill", "2x64"]]
    for row in rows:  # label (2 fields), context, plan, py plan, torch, cpp, speedup, vllm, cpp/vllm, ...
        cpp_ms, vllm_ms, ratio = float(row[6]), float(row[8]), float(row[9])
        half = 0.005  # every number is printed to two decimals
        assert vllm_ms > 0 and ratio > 0, row
        assert (cpp_ms - half) / (vllm_ms + half) - half <= ratio <= (cpp_ms + half) / (vllm_ms - half) + half, row
