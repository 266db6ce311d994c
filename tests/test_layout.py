"""Contract of vllm_chunked_kv.layout, against brute force over positions:

- a step computing ``[start, end)`` writes exactly the chunks whose last token
  lies there, each chunk once over any split of a sequence into steps;
- chunk ``k`` lives in the slot group of the page holding its last token, so
  a page is complete once its tokens are computed, and slot groups of one
  head never collide;
- pages hold ``block_size / tokens_per_state`` rows, matching the config's
  ``tokens_per_state``; the default block size is a multiple of hop near 32;
- the raw window covers every raw row a query reads and every row a chunk
  completing in the next step pools.
"""

from __future__ import annotations

import random

import pytest

from vllm_chunked_kv import layout
from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import reference

CONFIGS = [
    dict(mitigation="none", chunk_size=4, window=4),
    dict(mitigation="boundary", chunk_size=5, window=6, sink_tokens=3),
    dict(mitigation="overlap", chunk_size=6, window=6),
    dict(mitigation="stride2", window=2),
    dict(mitigation="none", chunk_size=8, hop=2, window=8),
    dict(mitigation="none", chunk_size=1, window=1),
]


def chunk_end(cfg: ChunkedKVConfig, k: int, origin: int) -> int:
    return reference.chunk_bounds(k, cfg, origin)[1] - 1


@pytest.mark.parametrize("settings", CONFIGS)
def test_steps_write_each_chunk_once(settings):
    cfg = ChunkedKVConfig(**settings)
    rng = random.Random(0)
    for origin in range(cfg.hop):
        cuts = sorted({0, 97, *rng.sample(range(1, 97), 12)})
        written = []
        for start, end in zip(cuts, cuts[1:]):
            chunks = layout.completed_chunks(cfg, start, end, origin)
            assert all(start <= chunk_end(cfg, k, origin) < end for k in chunks)
            written += list(chunks)
        assert written == [k for k in range(97) if chunk_end(cfg, k, origin) < 97]


@pytest.mark.parametrize("settings", CONFIGS)
def test_chunks_live_in_the_page_of_their_last_token(settings):
    cfg = ChunkedKVConfig(**settings)
    block_size = 4 * cfg.hop
    per_block = layout.states_per_block(cfg, block_size)
    spg = layout.slots_per_group(cfg)
    for origin in range(cfg.hop):
        groups = [layout.first_group(cfg, origin) + k for k in range(40)]
        assert len(set(groups)) == len(groups)
        for k, group in enumerate(groups):
            page = group * spg // per_block
            assert page == chunk_end(cfg, k, origin) // block_size
            assert (group * spg + spg - 1) // per_block == page  # all rows of a chunk in one page


@pytest.mark.parametrize("settings", CONFIGS)
def test_page_rows_and_block_size(settings):
    cfg = ChunkedKVConfig(**settings)
    assert layout.tokens_per_state(cfg) == cfg.tokens_per_state
    size = layout.default_block_size(cfg)
    assert size % layout.block_multiple(cfg) == 0 and 32 <= size < 32 + cfg.hop
    assert layout.states_per_block(cfg, size) * cfg.tokens_per_state == size
    if cfg.hop > 1:
        with pytest.raises(ValueError):
            layout.states_per_block(cfg, size + 1)


@pytest.mark.parametrize("settings", CONFIGS)
def test_raw_window_covers_every_read(settings):
    cfg = ChunkedKVConfig(**settings)
    kept = layout.raw_window(cfg) - 1  # vLLM keeps the newest sliding_window - 1 computed tokens before a step
    for origin in range(cfg.hop):
        for t in range(120):
            raw, _ = reference.visible_set(t, cfg, origin)
            raw_from = layout.raw_from(cfg, t, origin)
            assert raw_from >= t - kept
            assert [j for j in raw if j >= raw_from] == list(range(raw_from, t + 1))
            # Raw rows before raw_from are kept forever, or boundary rows stored with their chunk.
            assert all(j < max(cfg.sink_tokens, origin) or cfg.keep_boundary for j in raw if j < raw_from)
        for start in range(1, 60):
            for k in layout.completed_chunks(cfg, start, start + 1, origin):
                assert chunk_end(cfg, k, origin) - cfg.chunk_size + 1 >= start - kept
