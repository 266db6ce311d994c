"""Fixtures for the metrics tests: real VllmConfigs of the tiny model, and a
real Prometheus server (Debian's `prometheus` package) on 127.0.0.1."""

from __future__ import annotations

import json
import shutil
from functools import lru_cache

import pytest



@pytest.fixture(scope="session")
def make_vllm_config(tiny_llama):
    """make_vllm_config(additional_config=None, attention_backend=None, kv_cache_dtype="auto") -> VllmConfig."""
    import vllm_chunked_kv

    vllm_chunked_kv.register()  # what the general plugin does in a server

    @lru_cache(maxsize=None)
    def build(additional_json: str, attention_backend: str | None, kv_cache_dtype: str):
        from vllm.engine.arg_utils import EngineArgs

        return EngineArgs(
            model=str(tiny_llama), enforce_eager=True, max_model_len=128, dtype="float32",
            attention_backend=attention_backend, additional_config=json.loads(additional_json),
            kv_cache_dtype=kv_cache_dtype,
        ).create_engine_config()

    def make(additional_config: dict | None = None, attention_backend: str | None = None, kv_cache_dtype: str = "auto"):
        return build(json.dumps(additional_config or {}, sort_keys=True), attention_backend, kv_cache_dtype)

    return make


@pytest.fixture(scope="session")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool not installed (Debian package `prometheus`; scripts/setup.sh test installs it)")
    return path


@pytest.fixture(scope="session")
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    if path is None:
        pytest.skip("prometheus not installed (Debian package `prometheus`; scripts/setup.sh test installs it)")
    return path
