"""Session fixtures: the tiny test models are built once per test session.

Under pytest-xdist every worker gets an equal share of the cores for OpenMP
(`OMP_NUM_THREADS`, inherited by the engines and servers the tests start),
unless the caller set it. Two workers each running a 2-thread engine on 2
cores made every engine step wait on descheduled OpenMP threads: measured
side by side, one invariance schedule took 95 s instead of 10 s."""

from __future__ import annotations

import os

_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _workers > 1:  # before anything imports torch
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // _workers)))

import pytest  # noqa: E402

from vllm_chunked_kv.testing import models  # noqa: E402


@pytest.fixture(scope="session")
def test_models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("test-models")


@pytest.fixture(scope="session")
def tiny_llama(test_models_dir):
    return models.build_tiny_llama(test_models_dir / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_qwen(test_models_dir):
    return models.build_tiny_qwen(test_models_dir / "tiny-qwen")
