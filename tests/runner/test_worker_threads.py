"""Under pytest-xdist no worker's OpenMP threads outnumber its share of the
cores (`tests/conftest.py`): torch here, and every engine or server a test
starts, inherit the same `OMP_NUM_THREADS`."""

from __future__ import annotations

import os

import pytest
import torch


@pytest.mark.skipif("PYTEST_XDIST_WORKER_COUNT" not in os.environ, reason="runs alone: all cores are its own")
def test_workers_share_the_cores():
    workers, cores = int(os.environ["PYTEST_XDIST_WORKER_COUNT"]), len(os.sched_getaffinity(0))
    assert torch.get_num_threads() * workers <= max(cores, workers)
