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
