"""The memory saving of CHUNKED_KV is real in vLLM's own accounting: with the
same KV cache memory, vLLM reports a KV capacity (in tokens of
max_model_len requests) at least 0.9 of the theoretical ratio over its
default backend, where the theory counts, per request, max_model_len /
tokens_per_state compressed rows, the raw window, the rows kept raw for
sinks and staggered origins, the page of unit slots dynamic boundaries lag
by, and (prefix caching is on, vLLM's default) the
raw tails a step keeps for later prefix hits. The compressed pages hold `tokens_per_state`
tokens per row, and the raw rows live in a cache group of their own."""

from __future__ import annotations

import re

import pytest

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend.raw_cache import kept_tail_rows
from vllm_chunked_kv.runner.engine import generate

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MAX_MODEL_LEN = 4096
ENGINE = dict(max_model_len=MAX_MODEL_LEN, block_size=32, max_num_batched_tokens=256, kv_cache_memory_bytes=32 << 20)
CONFIGS = {
    "none": dict(mitigation="none", chunk_size=4, window=32),
    "boundary-sinks": dict(mitigation="boundary", chunk_size=4, window=32, sink_tokens=4),
    "stride2": dict(mitigation="stride2", window=32),
    "stagger": dict(mitigation="stagger", chunk_size=4, window=32),
    # one unit slot per 2 tokens; 32-token pages lag one page: window >= 32 + 2 * 4
    "dynamic": dict(boundaries="dynamic", chunk_size=4, min_chunk=2, window=40),
}
CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
GROUP_SIZES = re.compile(r"kv cache group sizes \((\d+), (\d+)\)")


def capacity(model, engine: dict) -> tuple[int, str]:
    log = generate(model, engine, rounds=[])["log"]
    return int(CAPACITY.findall(log)[-1].replace(",", "")), log


@pytest.fixture(scope="module")
def default_capacity(tiny_llama):
    return capacity(tiny_llama, ENGINE)[0]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_capacity_is_near_theory(name, tiny_llama, default_capacity):
    settings = CONFIGS[name]
    cfg = ChunkedKVConfig(**settings)
    tokens, log = capacity(tiny_llama, {**ENGINE, "attention_backend": "chunked_kv",
                                        "additional_config": {"chunked_kv": settings}})
    kept = kept_tail_rows(cfg, 32, ENGINE["max_num_batched_tokens"], 0)  # prefix caching is on: kept raw tails
    assert kept > 0
    lag = layout.dynamic_lag_pages(cfg, 32) * layout.states_per_block(cfg, 32)  # dynamic boundaries: slots lag a page
    rows = MAX_MODEL_LEN / cfg.tokens_per_state + layout.raw_window(cfg) + layout.model_forever_raw(cfg, 2) + kept + lag
    theory = MAX_MODEL_LEN / float(rows)
    assert tokens / default_capacity >= 0.9 * theory, (tokens, default_capacity, theory)
    # Two cache groups: compressed pages of 32 tokens, raw pages with as many rows as a compressed page.
    assert GROUP_SIZES.findall(log)[-1] == ("32", str(layout.states_per_block(cfg, 32)))
