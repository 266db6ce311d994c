"""Contract of benchmarks/capacity.py's `--as-served` row, on the tiny Llama through vLLM.

- A model directory with `chunked_kv_serve.json` is measured as that file
  serves it (`attention_backend` alone): its capacity is that of the file's
  settings, near the theory of those settings with prefix caching on (at
  least 0.9 of it, never above it), not the default backend's.
- A hybrid model's row leaves the theory out (its sliding layers cost both
  backends a window per request, which the uniform theory does not count).
"""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_chunked_kv.core.serve_file import SERVE_FILE

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SETTINGS = {"chunk_size": 4, "window": 32, "sink_tokens": 4, "stagger": "layers", "pooling": "gated",
            "slot_gains": [1.0, 2.0, 3.0, 4.0]}
ENGINE = {"kv_cache_memory_bytes": 64 << 20, "max_model_len": 4096, "max_num_batched_tokens": 1024}


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("capacity")


def test_as_served_row_is_the_serve_files_capacity(bench, tiny_llama, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_llama, model)
    (model / SERVE_FILE).write_text(json.dumps({"attention_backend": "chunked_kv",
                                                "additional_config": {"chunked_kv": SETTINGS}}))
    default = bench.capacity_tokens(model, ENGINE)
    row = bench.as_served(model, ENGINE, default)
    assert row["settings"]["window"] == 32 and row["settings"]["pooling"] == "gated"
    assert row["theoretical"] > 2 and 0.9 <= row["fraction"] <= 1.0 + 1e-9, row
    assert row["ratio"] == row["tokens"] / default


def test_a_hybrid_row_has_no_uniform_theory(bench, tiny_gemma3, tmp_path, monkeypatch):
    model = tmp_path / "model"
    shutil.copytree(tiny_gemma3, model)
    (model / SERVE_FILE).write_text(json.dumps({"attention_backend": "chunked_kv",
                                                "additional_config": {"chunked_kv": {"chunk_size": 4, "window": 16}}}))
    monkeypatch.setattr(bench, "capacity_tokens", lambda model, engine: 3000)
    row = bench.as_served(model, ENGINE, 1000)
    assert row["theoretical"] is None and row["fraction"] is None and row["ratio"] == 3.0
