"""Contract of `benchmarks/serve_load.py`:

- `engine_stats` reads the engine's periodic log lines: the most requests
  running at once, and mean prompt / generation tokens/s over the busy lines
  only (idle lines would dilute them);
- `ratios` are chunked over default, None where a figure is missing;
- `--kv-cache-dtypes auto,fp8` serves a row four times (both backends, with
  and without `--kv-cache-dtype fp8`, the chunked ones with the backend flag)
  and reports chunked fp8 over chunked auto and over default fp8;
- end to end on the tiny Llama (two real servers, `vllm bench serve` against
  each): every prompt completes on both, the chunked server ran CHUNKED_KV and
  the default one did not, the KV budget and the command are recorded, and
  `--logs` keeps both servers' logs.
"""

from __future__ import annotations

import json

import pytest

LOG = """\
(APIServer pid=1) INFO 12-05 22:00:00 [loggers.py:1] Engine 000: Avg prompt throughput: 1200.0 tokens/s, Avg generation throughput: 10.0 tokens/s, Running: 4 reqs, Waiting: 12 reqs, GPU KV cache usage: 98.0%
(APIServer pid=1) INFO 12-05 22:00:10 [loggers.py:1] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 30.0 tokens/s, Running: 3 reqs, Waiting: 0 reqs, GPU KV cache usage: 50.0%
(APIServer pid=1) INFO 12-05 22:00:20 [loggers.py:1] Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, Running: 0 reqs, Waiting: 0 reqs, GPU KV cache usage: 0.0%
"""


def test_engine_stats_read_the_busy_log_lines(load_benchmark):
    stats = load_benchmark("serve_load").engine_stats(LOG)
    assert stats == {"max_running": 4, "prompt_tokens_per_s": 600.0, "generation_tokens_per_s": 20.0, "log_lines": 3}


def test_ratios_are_chunked_over_default(load_benchmark):
    ratios = load_benchmark("serve_load").ratios(
        {"output_throughput": 30.0, "median_ttft_ms": 50.0, "median_tpot_ms": None},
        {"output_throughput": 20.0, "median_ttft_ms": 100.0, "median_tpot_ms": 5.0})
    assert ratios == {"output_tok_s": 1.5, "ttft_p50": 0.5, "tpot_p50": None}


def test_four_combinations_of_backend_and_pages(load_benchmark, monkeypatch):
    bench = load_benchmark("serve_load")
    served = []

    def serve_and_load(opts, server_args, row, label):
        served.append((label, server_args))
        tok_s = 10.0 * (2 if "chunked_kv" in server_args else 1) * (1.5 if "fp8" in server_args else 1)
        return {"output_throughput": tok_s, "median_ttft_ms": 100.0, "median_tpot_ms": 10.0, "max_running": 4}

    monkeypatch.setattr(bench, "serve_and_load", serve_and_load)
    opts = bench.parse_args(["--model", "M", "--kv-cache-dtypes", "auto,fp8"])
    row = bench.run_row(opts, "6000x512", bench.ROWS["6000x512"])
    assert [label for label, _ in served] == ["6000x512-default", "6000x512-chunked", "6000x512-default-fp8",
                                              "6000x512-chunked-fp8"]
    assert served[3][1] == ["--attention-backend", "chunked_kv", "--kv-cache-dtype", "fp8"]
    assert row["ratio"]["output_tok_s"] == 2.0 and row["caches"]["fp8"]["chunked"]["output_throughput"] == 30.0
    assert row["fp8_ratio"]["chunked_over_chunked_auto"]["output_tok_s"] == 1.5
    assert row["fp8_ratio"]["chunked_over_default"]["output_tok_s"] == 2.0


@pytest.mark.slow
@pytest.mark.server
def test_both_servers_under_the_same_load(load_benchmark, tiny_llama, tmp_path):
    bench = load_benchmark("serve_load")
    out = tmp_path / "load.json"
    argv = ["--model", str(tiny_llama), "--dtype", "float32", "--input-len", "200", "--output-len", "16",
            "--prompts", "8", "--kv-mib", "4", "--max-num-seqs", "8", "--chunked-kv", '{"chunk_size": 4, "window": 32}',
            "--json", str(out), "--logs", str(tmp_path / "logs")]
    assert bench.main(argv) == 0
    (row,) = json.loads(out.read_text())["rows"]
    for name in ("default", "chunked"):
        assert row[name]["completed"] == 8 and row[name]["kv_budget_mib"] == 4 and row[name]["output_throughput"] > 0
    assert row["chunked"]["chunked_kv_running"] and not row["default"]["chunked_kv_running"]
    assert row["ratio"]["output_tok_s"] > 0
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["custom-chunked.log", "custom-default.log"]
    assert "serve_load.py --model" in json.loads(out.read_text())["command"]
