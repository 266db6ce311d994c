"""Contract of benchmarks/throughput.py with `--model DIR` and `--dtype`.

- On a given model directory (the tiny Llama, fp32) one run measures the
  default backend and CHUNKED_KV's C++ kernels (`--impls cpp`, which it
  checks in the engine's log) at each context and batch: the JSON has one
  row per (batch, context) with positive prefill seconds (batch 1 only) and
  decode tokens/s for `default` and `cpp`, their ratios, and the arguments
  it ran with (model, dtype, chunked_kv settings).
- A context whose prompt plus decoded tokens does not fit the model's
  `max_position_embeddings` is refused before any engine starts, with the
  largest context that fits.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "throughput.py"


def _run(*argv: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, timeout=timeout)


def test_context_beyond_the_model_is_refused(tiny_llama):
    proc = _run("--model", str(tiny_llama), "--contexts", "256", "4090", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "exceeds the model's 4096 positions (use at most 4056)" in proc.stderr


@pytest.mark.slow
@pytest.mark.engine
def test_model_and_dtype_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    settings = '{"chunk_size": 4, "window": 32, "sink_tokens": 4}'
    proc = _run("--model", str(tiny_llama), "--dtype", "float32", "--contexts", "200", "--decode-tokens", "4",
                "--batches", "1", "2", "--impls", "cpp", "--chunked-kv", settings, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["args"]["model"] == str(tiny_llama) and report["args"]["dtype"] == "float32"
    assert json.loads(report["args"]["chunked_kv"]) == json.loads(settings)
    assert [(row["batch"], row["context"]) for row in report["rows"]] == [(1, 200), (2, 200)]
    for row in report["rows"]:
        res, ratios = row["results"], row["ratios"]
        assert set(res) == {"default", "cpp"}
        for side in res.values():
            assert side["decode_tok_s"] > 0 and (side["prefill_s"] > 0 if row["batch"] == 1 else side["prefill_s"] is None)
        assert ratios["cpp"]["decode_speed"] == pytest.approx(res["cpp"]["decode_tok_s"] / res["default"]["decode_tok_s"])
    first = report["rows"][0]
    assert first["ratios"]["cpp"]["prefill_time"] == pytest.approx(first["results"]["cpp"]["prefill_s"]
                                                                   / first["results"]["default"]["prefill_s"])
    assert "dtype=float32" in proc.stdout
