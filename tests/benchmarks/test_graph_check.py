"""Contract of `benchmarks/graph_check.py`, the vLLM-free decode-step harness,
on CPU in eager mode (what CI can run; graph capture needs CUDA):

- for the PyTorch path and the C++ kernels, under `none` and `boundary`,
  over steps that cross chunk boundaries: a whole step after a warm-up
  makes no host synchronisation (`host_sync.no_host_sync`), and every
  step's outputs and the compressed pages written equal the PyTorch path
  with its dense bias from the same pages; every result is a JSON line
  appended to ``--jsonl`` as it comes, the graph check says why it was
  skipped, and the timing line carries the step, per-layer parts, SDPA over
  the full cache and the copy bandwidth;
- the sync check fails when the step makes a tensor from host data (the
  plan's constants made per call, as a GPU would copy them every step) or
  the pooling gains are made per call;
- the reference check fails when the kernel's output differs.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "graph_check.py"
SMALL = ["--device", "cpu", "--cases", "3x150", "--steps", "9", "--layers", "2",
         "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "32", "--repeats", "1"]


@pytest.fixture(scope="module")
def graph_check(load_benchmark):
    return load_benchmark("graph_check")


@pytest.mark.parametrize("impl", ["torch", "cpp"])
@pytest.mark.parametrize("mitigation", ["none", "boundary"])
def test_eager_step_is_sync_free_and_equals_the_pytorch_path(graph_check, impl, mitigation, tmp_path):
    out = tmp_path / "graph.jsonl"
    code = graph_check.main([*SMALL, "--impl", impl, "--mitigations", mitigation, "--jsonl", str(out),
                             *(["--no-timing"] if impl == "torch" else [])])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    checks = {r["check"]: r for r in records if "check" in r}
    assert code == 0, records
    assert checks["sync"]["ok"] and checks["reference"]["ok"]
    assert checks["graph"]["ok"] is None and "CUDA" in checks["graph"]["skipped"]
    assert records[0]["impl"] == impl and records[0]["versions"]["torch"] == torch.__version__
    if impl == "cpp":
        timing = next(r for r in records if "timing" in r)
        assert timing["eager_step_ms"] > 0 and timing["sdpa_ms"] > 0 and timing["copy_gbs"] > 0
        assert set(timing["per_layer_ms"]) == {"plan", "write_raw", "write_chunks", "attend"}


def _per_call_constant(values, device):
    return torch.tensor(values, dtype=torch.long, device=device)  # a host copy on every call


def _per_call_gains(cfg, device):
    return torch.tensor(cfg.normalised_gains(), dtype=torch.float32, device=device)


@pytest.mark.parametrize("module, name, replacement", [
    ("vllm_chunked_kv.ops.plans.constants", "ints", _per_call_constant),
    ("vllm_chunked_kv.ops.kernels.shared", "fixed_gains", _per_call_gains),
])
def test_sync_check_catches_a_tensor_from_host_data(graph_check, monkeypatch, module, name, replacement):
    monkeypatch.setattr(sys.modules[module] if module in sys.modules else __import__(module, fromlist=[name]),
                        name, replacement)
    args = graph_check.parse_args([*SMALL, "--impl", "torch"])
    stack = graph_check.make_stack(args, torch.device("cpu"))
    record = graph_check.check_sync(stack, graph_check.dispatch.ops("torch"), torch.device("cpu"))
    assert not record["ok"] and "copies host data to the device" in record["error"]


def test_reference_check_catches_a_wrong_output(graph_check):
    args = graph_check.parse_args([*SMALL, "--impl", "cpp", "--dtype", "float32"])
    stack = graph_check.make_stack(args, torch.device("cpu"))
    ops = graph_check.dispatch.ops("cpp")
    eager, pages = graph_check.eager_run(stack, ops, bias=False)
    assert graph_check.check_reference(stack, ops, eager, pages, 1e-4)["ok"]
    eager[-1][0][1, 2, 3] += 1e-2  # one element of one layer's output at the last step
    assert not graph_check.check_reference(stack, ops, eager, pages, 1e-4)["ok"]


def test_script_runs_as_a_file(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--impl", "cpp", "--no-timing",
                           "--jsonl", str(tmp_path / "g.jsonl")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len((tmp_path / "g.jsonl").read_text().splitlines()) == 4  # header, sync, reference, graph
