"""Contract of `benchmarks/step_profile.py`: on the tiny Llama (bf16), one
run times every model step of both backends inside a real engine and
reports decode and mixed steps apart. Both backends have decode steps and,
with more prompts than `--batch`, mixed ones; the default backend's
attention forward was timed; CHUNKED_KV's plan, raw writes, chunk writes and
attention were each timed (so they ran); the writes and the attention fit
inside its attention forward, and the plan, made by the metadata builder
before the layers run, fits beside it inside the step; each backend's
decode attention has a read rate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "step_profile.py"


@pytest.mark.slow
@pytest.mark.engine
def test_both_backends_parts_per_step(tiny_llama, tmp_path):
    out = tmp_path / "profile.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--model", str(tiny_llama), "--batch", "2", "--prompts", "3",
                           "--input", "200", "--output", "8", "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    for backend in ("default", "chunked"):
        side = report[backend]
        assert side["decode"]["steps"] > 0 and side["mixed"]["steps"] > 0, side
        assert 0 < side["decode"]["attention"] < side["decode"]["step"]
        assert side["attn_gb_s"] > 0
    decode = report["chunked"]["decode"]
    assert all(decode[part] > 0 for part in ("plan", "write_raw", "write_chunks", "attend")), decode
    assert decode["write_raw"] + decode["write_chunks"] + decode["attend"] <= decode["attention"]
    assert decode["plan"] + decode["attention"] <= decode["step"]
    assert "plan" not in report["default"]["decode"]
