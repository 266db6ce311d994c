"""Contract of `integration.startup_checks.check_engine_support` on settings
it refuses without starting an engine: `align` with vLLM's micro-batching
(the builder reads prompt lengths per whole batch) is one line naming the
field; the same settings without micro-batching pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_chunked_kv.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.integration.startup_checks import check_engine_support


def _engine(use_ubatching: bool) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(block_size=32, user_specified_block_size=True),
                           parallel_config=SimpleNamespace(use_ubatching=use_ubatching),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))


def test_align_with_micro_batching_is_refused_in_one_line():
    with pytest.raises(ChunkedKVConfigError) as info:
        check_engine_support(ChunkedKVConfig(align="prompt_end"), _engine(use_ubatching=True))
    assert str(info.value).startswith("chunked_kv.align: is not supported with micro-batching")
    assert "\n" not in str(info.value)


def test_align_without_micro_batching_and_micro_batching_without_align_pass():
    check_engine_support(ChunkedKVConfig(align="prompt_end"), _engine(use_ubatching=False))
    check_engine_support(ChunkedKVConfig(), _engine(use_ubatching=True))
