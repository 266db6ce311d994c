"""The second half of the configs of `tests/test_scheduling_invariance.py`
(same contract), in a file of its own so that pytest-xdist (`--dist
loadfile`) runs the two halves on both workers."""

from __future__ import annotations

import pytest

from tests.test_scheduling_invariance import SECOND_HALF, check_invariance

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", SECOND_HALF)
def test_outputs_do_not_depend_on_scheduling(config, tiny_llama):
    check_invariance(config, tiny_llama)
