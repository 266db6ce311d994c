"""Session fixtures of the model tests: one cache directory, and SmolLM2-135M
and Gemma 3 270M fetched into it once per run.

The cache is `$CHUNKED_KV_CACHE` when set, so a developer's cache is
reused (no download, no conversion); otherwise a fresh temporary directory,
shared by all pytest-xdist workers of the run, and the first test that needs
a model downloads and converts it (SmolLM2: 93 MB, about 20 s). A worker
that asks for a model while the other builds it waits on the model's lock
(`models.cache.exclusive`) and then finds it built.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from vllm_chunked_kv.models import cache
from vllm_chunked_kv.models.fetcher import fetch


@pytest.fixture(scope="session")
def models_cache(tmp_path_factory) -> Path:
    configured = cache.configured()
    if configured:
        return Path(configured).expanduser()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # basetemp is per worker; its parent is the run's
        shared = tmp_path_factory.getbasetemp().parent / "models-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("models-cache")


@pytest.fixture(scope="session")
def smollm2_dir(models_cache) -> Path:
    return fetch("smollm2-135m", models_cache)


@pytest.fixture(scope="session")
def gemma3_dir(models_cache) -> Path:
    return fetch("gemma3-270m", models_cache)
