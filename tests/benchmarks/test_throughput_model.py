"""Contract of benchmarks/throughput.py with `--model DIR` and `--dtype`.

- On a given model directory (the tiny Llama, fp32) one run measures both
  backends at each context: the JSON has one row per context with positive
  prefill seconds and decode tokens/s for `default` and `chunked`, their
  ratios, and the arguments it ran with (model, dtype, chunked_kv settings).
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
def test_model_and_dtype_end_to_end(tiny_llama, tmp_path):
    out = tmp_path / "throughput.json"
    settings = '{"chunk_size": 4, "window": 32, "sink_tokens": 4}'
    proc = _run("--model", str(tiny_llama), "--dtype", "float32", "--contexts", "200", "--decode-tokens", "4",
                "--chunked-kv", settings, "--json", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["args"]["model"] == str(tiny_llama) and report["args"]["dtype"] == "float32"
    assert json.loads(report["args"]["chunked_kv"]) == json.loads(settings)
    [row] = report["rows"]
    assert row["context"] == 200
    for side in ("default", "chunked"):
        assert row[side]["prefill_s"] > 0 and row[side]["decode_tok_s"] > 0
    assert row["prefill_time_ratio"] == pytest.approx(row["chunked"]["prefill_s"] / row["default"]["prefill_s"])
    assert row["decode_speed_ratio"] == pytest.approx(row["chunked"]["decode_tok_s"] / row["default"]["decode_tok_s"])
    assert "dtype=float32" in proc.stdout
