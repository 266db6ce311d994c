"""Session fixtures of the model tests: one cache directory, and SmolLM2-135M
fetched into it once per session.

The cache is `$CHUNKED_KV_CACHE` when set, so a developer's cache is
reused (no download, no conversion); otherwise a fresh temporary directory,
shared by all pytest-xdist workers of the run, and the first test that needs
the model downloads it (93 MB) and converts it (about 20 s). Two workers that
fetch at once both build, and the first to publish wins (`models.cache`).
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
