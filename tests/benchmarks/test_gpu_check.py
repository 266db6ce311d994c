"""Contract of `benchmarks/gpu_check.sh`, run on CPU with tiny shapes (its
GPU_CHECK_* overrides) so that it cannot rot: every step leaves one JSON
line with its exit status in OUT_DIR/results.jsonl and its stderr in
OUT_DIR/<step>.err; the CUDA build fails here (no CUDA device) and the
steps after it still run: graph_check.py's lines (no host sync, equal to
the PyTorch path, graph skipped with its reason, a timing) for head 128's
run and the two extra head sizes, the kernel checks and the tests; the
versions line comes first."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def test_every_step_runs_and_records_even_after_a_failed_build(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_IMPLS": "cpp", "GPU_CHECK_CASES": "2x100",
           "GPU_CHECK_WIDE_CASES": "2x100",
           "GPU_CHECK_SHAPE": "--num-heads 4 --num-kv-heads 2 --head-size 32 --repeats 1"}
    env.pop("CHUNKED_KV_BUILD_CUDA", None)
    env["PYTHON"] = sys.executable  # the suite's interpreter, whatever python3 is on PATH
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=480)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert records[0]["step"] == "versions" and "torch" in records[0]
    steps = {r["step"]: r["rc"] for r in records if "rc" in r}
    assert list(steps) == ["versions", "build", "graph_cpp", "checks", "tests", "graph_cpp_h64", "graph_cpp_h256"]
    assert steps["build"] != 0 and all(rc == 0 for name, rc in steps.items() if name != "build")
    assert all((tmp_path / f"{name}.err").exists() for name in steps)
    checks = [r for r in records if "check" in r]
    assert {(r["check"], r["mitigation"]) for r in checks} >= {("sync", "none"), ("sync", "boundary"),
                                                               ("reference", "none"), ("reference", "boundary")}
    assert all(r["ok"] for r in checks if r["check"] != "graph")
    assert all(r["ok"] is None and r["skipped"] for r in checks if r["check"] == "graph")
    assert sum("timing" in r for r in records) == 4  # none and boundary, then one per extra head size
