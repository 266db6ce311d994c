"""Contract of benchmarks/gpu_kernels.py's output, on CPU with the PyTorch path.

The script runs end to end with ``--device cpu --impls torch`` and small
shapes. Its JSON has the device, the copy bandwidth, one check row per
implementation x op (attend, write_chunks) x mitigation (+ stagger) with a
max abs error against the reference (the PyTorch path on compressed pages
is within 1e-5 of it), and one timing row per mode x context x batch x
implementation x mitigation with positive milliseconds and bandwidth, the
bytes read by a `none` step below those of full attention at these
contexts (window 32), plus one row per vLLM baseline (full attention's
bytes) that says why it was skipped without CUDA. Implementations that cannot run
(CUDA on CPU) are listed with their reasons. The printed Markdown has both
tables.
"""

import json

import pytest
import torch


@pytest.fixture(scope="module")
def gpu_kernels(load_benchmark):
    return load_benchmark("gpu_kernels")


def test_output_format_on_cpu(gpu_kernels, tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "results.json"
    argv = ["--device", "cpu", "--impls", "torch,cuda", "--contexts", "200,333", "--batches", "1,3",
            "--prefill-tokens", "40", "--num-heads", "4", "--num-kv-heads", "2", "--head-size", "16",
            "--window", "32", "--dtype", "float32", "--repeats", "2", "--copy-bytes", "1000000", "--json", str(out)]
    returned = gpu_kernels.main(argv)
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert results == json.loads(json.dumps(returned))
    assert results["device"] == "cpu" and results["copy_gbps"] > 0
    assert "CUDA device" in results["skipped_impls"]["cuda"][0]

    mitigations = ["none", "boundary", "overlap", "stride2", "stagger"]
    checks = {(c["impl"], c["op"], c["mitigation"]) for c in results["checks"]}
    assert checks == {("torch", op, m) for op in ("attend", "write_chunks") for m in mitigations}
    assert all(c["ok"] and c["max_abs_err"] < 1e-5 for c in results["checks"])

    timed = [t for t in results["timings"] if t["impl"] == "torch"]
    expected = {("decode", ctx, b) for ctx in (200, 333) for b in (1, 3)} | {("prefill", ctx, 1) for ctx in (200, 333)}
    for mitigation in mitigations[:4]:
        assert {(t["mode"], t["context"], t["batch"]) for t in timed if t["mitigation"] == mitigation} == expected
    for t in timed:
        assert t["status"] == "ok" and t["ms"] > 0 and t["gbps"] > 0
        assert t["fraction_of_copy"] == pytest.approx(t["gbps"] / results["copy_gbps"])
        full = t["batch"] * t["context"] * 2 * 2 * 16 * 4
        assert 0 < t["kv_bytes"] and (t["kv_bytes"] < full or t["mitigation"] != "none")
    baselines = [t for t in results["timings"] if t["impl"].startswith("vllm_")]
    assert {t["impl"] for t in baselines} == {"vllm_triton", "vllm_flash_attn"}
    assert len(baselines) == 2 * len(expected)
    assert all(t["status"].startswith("skipped:") and "CUDA" in t["status"] for t in baselines)
    assert all(t["kv_bytes"] == t["batch"] * t["context"] * 2 * 2 * 16 * 4 for t in baselines)

    assert "| check | impl | mitigation | max abs err | ok |" in printed
    assert "| mode | context | batch | impl | mitigation | ms | GB/s | of copy | status |" in printed
    assert printed.count("| decode | 333 | 3 | torch |") == 4
    assert "not run: cuda:" in printed
