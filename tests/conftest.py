"""Session fixtures: the tiny test models are built once per test session."""

from __future__ import annotations

import pytest

from vllm_chunked_kv.testing import models


@pytest.fixture(scope="session")
def test_models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("test-models")


@pytest.fixture(scope="session")
def tiny_llama(test_models_dir):
    return models.build_tiny_llama(test_models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen(test_models_dir):
    return models.build_tiny_qwen(test_models_dir / "tiny-qwen")


# Files that take a large share of the suite (minutes each on 2 cores) run
# first: with one file per worker at a time (`--dist loadfile`, setup.sh), a
# long file started late would leave the other worker idle at the end.
LONG_FILES = ("test_scheduling_invariance.py", "test_backend_reference.py", "test_prefix_hits.py")


def pytest_collection_modifyitems(session, config, items):
    def rank(item) -> int:
        name = item.path.name
        return LONG_FILES.index(name) if name in LONG_FILES else len(LONG_FILES)

    items.sort(key=rank)  # stable: the order within each file and among the others is kept
