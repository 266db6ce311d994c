"""Contract of vllm_chunked_kv.core.layout, against brute force over positions:

- chunk ``k`` lives in the slot group of the page holding its last token, so
  a page is complete once its tokens are computed, and slot groups of one
  head never collide;
- pages hold ``block_size / tokens_per_state`` rows; vLLM's spec gets
  ``tokens_per_state`` as an int where it is one; the default block size is a multiple of hop near 32;
- the raw window covers every raw row a query reads and every row a chunk
  completing in the next step pools.
"""

from __future__ import annotations

import pytest

from tests.core.test_grid import CONFIGS
from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import reference

@pytest.mark.parametrize("settings", CONFIGS)
def test_chunks_live_in_the_page_of_their_last_token(settings):
    cfg = ChunkedKVConfig(**settings)
    block_size = 4 * cfg.hop
    per_block = layout.states_per_block(cfg, block_size)
    spg = grid.slots_per_group(cfg)
    for origin in range(cfg.hop):
        groups = [grid.first_group(cfg, origin) + k for k in range(40)]
        assert len(set(groups)) == len(groups)
        for k, group in enumerate(groups):
            page = group * spg // per_block
            assert page == grid.chunk_last(cfg, k, origin) // block_size
            assert (group * spg + spg - 1) // per_block == page  # all rows of a chunk in one page


@pytest.mark.parametrize("settings", CONFIGS)
def test_page_rows_and_block_size(settings):
    cfg = ChunkedKVConfig(**settings)
    spec_value = layout.spec_tokens_per_state(cfg)
    assert spec_value == grid.tokens_per_state(cfg)
    assert isinstance(spec_value, int) == (grid.tokens_per_state(cfg).denominator == 1)
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
            raw_from = grid.raw_from(cfg, t, origin)
            assert raw_from >= t - kept
            assert [j for j in raw if j >= raw_from] == list(range(raw_from, t + 1))
            # Raw rows before raw_from are kept forever, or boundary rows stored with their chunk.
            assert all(j < max(cfg.sink_tokens, origin) or cfg.keep_boundary for j in raw if j < raw_from)
        for start in range(1, 60):
            for k in grid.completed_chunks(cfg, start, start + 1, origin):
                assert grid.chunk_last(cfg, k, origin) - cfg.chunk_size + 1 >= start - kept


@pytest.mark.parametrize("settings, want", [
    ({"sink_tokens": 2}, 2),
    ({"sink_tokens": 2, "stagger": [[3, 0]]}, 3),
    ({"sink_tokens": 2, "stagger": "layers"}, 3),
    ({"sink_tokens": 2, "align": "prompt_end", "chunk_size": 8}, 7),
    ({"sink_tokens": 9, "align": "prompt_end"}, 9),
])
def test_model_forever_raw_covers_every_origin_a_request_may_take(settings, want):
    """The raw pages keep the positions before any head's origin in any request:
    with `align`, every origin in [0, hop) is possible."""
    assert layout.model_forever_raw(ChunkedKVConfig(**settings), 2) == want


@pytest.mark.parametrize("block_size", [4, 8, 16, 32])
def test_dynamic_unit_slots_lag_their_chunk_decision(block_size):
    """Dynamic boundaries: unit m's slot page is complete only after m's chunk
    is decided; the slot is written (at position m*u + lag) before the unit
    seals, from rows the raw window still holds; too large a block for the
    window is refused in one line naming the window."""
    import torch

    from vllm_chunked_kv.core import boundaries

    cfg = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=24)
    if block_size > 16:
        with pytest.raises(ValueError, match=r"^chunked_kv\.window: boundaries 'dynamic' with --block-size"):
            layout.check_block_size(cfg, block_size)
        return
    layout.check_block_size(cfg, block_size)
    unit, size = cfg.min_chunk, cfg.chunk_size
    lag = layout.dynamic_lag_pages(cfg, block_size) * block_size
    per_block = layout.states_per_block(cfg, block_size)
    cuts = boundaries.chunk_cuts(cfg, torch.randn(400, 1, 8, generator=torch.Generator().manual_seed(0)))[:, 0]
    first = 0
    for frame, last in enumerate(cuts.tolist()):
        decided_at = (frame + 1) * size  # the frame's next position
        for m in range(first // unit, last // unit + 1):
            write_at = m * unit + lag
            page = m // per_block + lag // block_size
            assert decided_at <= write_at and decided_at <= (page + 1) * block_size - 1
            assert page * block_size <= write_at < (page + 1) * block_size  # written when its page is computed
            assert write_at <= m * unit + unit - 1 + cfg.window  # before the unit seals
            assert write_at - (m * unit // size - 1) * size <= layout.raw_window(cfg) - 1  # rows read still stored
        first = last + 1
    assert layout.default_block_size(cfg) == 2 * size and layout.dynamic_lag_pages(cfg, 2 * size) == 1
