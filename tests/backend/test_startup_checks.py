"""Contract of `backend.startup_checks.check_engine_support` on settings
it refuses without starting an engine: vLLM's micro-batching (a step's plans
join the metadata of two cache groups, built for the whole batch) is one
line, with any settings; the same settings without micro-batching pass. Dynamic boundaries
with a --block-size whose slot lag outlasts the window are refused in one
line naming the window; their default block size passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.backend.startup_checks import check_engine_support


def _engine(use_ubatching: bool, block_size: int | None = 32) -> SimpleNamespace:
    cache = SimpleNamespace(block_size=block_size or 16, user_specified_block_size=block_size is not None)
    return SimpleNamespace(cache_config=cache,
                           parallel_config=SimpleNamespace(use_ubatching=use_ubatching),
                           scheduler_config=SimpleNamespace(disable_hybrid_kv_cache_manager=False))


@pytest.mark.parametrize("align", ["none", "prompt_end"])
def test_micro_batching_is_refused_in_one_line(align):
    with pytest.raises(ChunkedKVConfigError) as info:
        check_engine_support(ChunkedKVConfig(align=align), _engine(use_ubatching=True))
    assert str(info.value).startswith("chunked_kv: micro-batching (--enable-dbo) is not supported")
    assert "\n" not in str(info.value)


def test_the_same_settings_without_micro_batching_pass():
    check_engine_support(ChunkedKVConfig(align="prompt_end"), _engine(use_ubatching=False))
    check_engine_support(ChunkedKVConfig(), _engine(use_ubatching=False))


def test_dynamic_boundaries_with_a_block_beyond_the_window_are_refused_in_one_line():
    cfg = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16)
    with pytest.raises(ChunkedKVConfigError) as info:
        check_engine_support(cfg, _engine(use_ubatching=False, block_size=32))
    assert str(info.value).startswith("chunked_kv.window: boundaries 'dynamic' with --block-size 32 needs window >= 40")
    assert "\n" not in str(info.value)
    engine = _engine(use_ubatching=False, block_size=None)
    check_engine_support(cfg, engine)
    assert engine.cache_config.block_size == 8  # the default: a lag of one page
