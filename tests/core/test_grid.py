"""Contract of vllm_chunked_kv.core.grid, against the definition read by brute force:

- `num_sealed` counts the chunks whose last token is at least `window`
  behind the query (chunk k sealed iff origin + k*hop + chunk_size - 1 <=
  t - window), and sealed chunks are always 0 .. K-1; `raw_from` is the end
  of the last sealed chunk, or the origin;
- every function gives the same values on torch tensors (broadcast) as on
  Python ints, negative positions included;
- a step computing ``[start, end)`` completes exactly the chunks whose last
  token lies there, each chunk once over any split of a sequence into steps;
- slot ``s`` has kind ``s % slots_per_group`` (`SlotKind`) and holds chunk
  ``s // slots_per_group - first_group``; `visible_slots` covers exactly the
  groups of the sealed chunks; `tokens_per_state` is hop / slots per group;
- `is_boundary` marks exactly the first and last tokens of sealed chunks;
- with per-request alignment (`align: prompt_end`, `grid.shifted` by
  `grid_shift`), what the last prompt token's query sees, counted back
  from the prompt's end, is the same for every prompt length; without it,
  it changes with the prompt length mod hop;
- in a layer with the model's own sliding window, the slots below
  `first_lookback_slot` are hidden (or hold no chunk) and the one at it is seen.
"""

from __future__ import annotations

import random
from fractions import Fraction

import pytest
import torch

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig

CONFIGS = [
    dict(mitigation="none", chunk_size=4, window=4),
    dict(mitigation="boundary", chunk_size=5, window=6, sink_tokens=3),
    dict(mitigation="overlap", chunk_size=6, window=6),
    dict(mitigation="stride2", window=2),
    dict(mitigation="none", chunk_size=8, hop=2, window=8),
    dict(mitigation="none", chunk_size=1, window=1),
]


def sealed_by_definition(cfg: ChunkedKVConfig, t: int, origin: int) -> list[int]:
    return [k for k in range(200) if origin + k * cfg.hop + cfg.chunk_size - 1 <= t - cfg.window]


@pytest.mark.parametrize("settings", CONFIGS)
def test_seal_rule_by_brute_force(settings):
    cfg = ChunkedKVConfig(**settings)
    for origin in range(cfg.hop):
        for t in range(150):
            sealed = sealed_by_definition(cfg, t, origin)
            assert sealed == list(range(len(sealed)))
            assert grid.num_sealed(cfg, t, origin) == len(sealed)
            want = grid.chunk_last(cfg, sealed[-1], origin) + 1 if sealed else origin
            assert grid.raw_from(cfg, t, origin) == want


@pytest.mark.parametrize("settings", CONFIGS)
def test_tensors_match_ints(settings):
    cfg = ChunkedKVConfig(**settings)
    t = torch.arange(-5, 120).view(-1, 1)  # [T, 1]
    o = torch.arange(cfg.hop).view(1, -1)  # [1, hop]
    for fn in (grid.num_sealed, grid.raw_from, grid.visible_slots, grid.chunk_start, grid.chunk_last):
        got = fn(cfg, t, o)  # [T, hop]
        want = [[fn(cfg, int(a), int(b)) for b in o[0]] for a in t[:, 0]]
        assert got.tolist() == want, fn.__name__
    s = torch.arange(60)
    assert grid.slot_kind(cfg, s).tolist() == [grid.slot_kind(cfg, int(x)) for x in s]
    assert grid.slot_chunk(cfg, s, 1 % cfg.hop).tolist() == [grid.slot_chunk(cfg, int(x), 1 % cfg.hop) for x in s]


@pytest.mark.parametrize("settings", CONFIGS)
def test_steps_complete_each_chunk_once(settings):
    cfg = ChunkedKVConfig(**settings)
    rng = random.Random(0)
    for origin in range(cfg.hop):
        cuts = sorted({0, 97, *rng.sample(range(1, 97), 12)})
        written = []
        for start, end in zip(cuts, cuts[1:]):
            chunks = grid.completed_chunks(cfg, start, end, origin)
            assert all(start <= grid.chunk_last(cfg, k, origin) < end for k in chunks)
            written += list(chunks)
        assert written == [k for k in range(97) if grid.chunk_last(cfg, k, origin) < 97]


@pytest.mark.parametrize("settings", CONFIGS)
def test_slots(settings):
    cfg = ChunkedKVConfig(**settings)
    spg = grid.slots_per_group(cfg)
    assert spg == (grid.BOUNDARY_SLOTS if cfg.keep_boundary else 1)
    assert grid.tokens_per_state(cfg) == Fraction(cfg.hop, spg)
    for origin in range(cfg.hop):
        for k in range(10):
            group = grid.first_group(cfg, origin) + k
            slots = range(group * spg, (group + 1) * spg)
            assert [grid.slot_chunk(cfg, s, origin) for s in slots] == [k] * spg
            kinds = [grid.SlotKind(grid.slot_kind(cfg, s)) for s in slots]
            assert kinds == (list(grid.SlotKind) if cfg.keep_boundary else [grid.SlotKind.POOLED])
        for t in range(100):
            sealed = grid.num_sealed(cfg, t, origin)
            if sealed:
                visible = range(grid.visible_slots(cfg, t, origin))
                assert {grid.slot_chunk(cfg, s, origin) for s in visible if grid.slot_chunk(cfg, s, origin) >= 0} \
                    == set(range(sealed))


@pytest.mark.parametrize("settings", CONFIGS)
def test_boundaries(settings):
    cfg = ChunkedKVConfig(**settings)
    for origin in range(cfg.hop):
        for sealed in range(6):
            ends = {p for k in range(sealed) for p in (grid.chunk_start(cfg, k, origin), grid.chunk_last(cfg, k, origin))}
            marked = {j for j in range(60) if grid.is_boundary(cfg, j, sealed, origin)}
            assert marked == ends


def _seen_from_the_end(cfg: ChunkedKVConfig, prompt_len: int, origin: int) -> tuple:
    """The query at the last prompt token, on a head with grid `origin`:
    its raw positions and its sealed chunks' bounds, as distances back from
    that token, over the last 3 windows (sinks and the first chunks differ
    by construction)."""
    from vllm_chunked_kv.ops.reference import chunk_bounds, visible_set

    t = prompt_len - 1
    raw, chunks = visible_set(t, cfg, origin)
    near = 3 * (cfg.window + cfg.chunk_size)
    bounds = [chunk_bounds(k, cfg, origin) for k in chunks]
    return (tuple(t - j for j in raw if t - j < near),
            tuple((t - start, t - end) for start, end in bounds if t - start < near))


@pytest.mark.parametrize("settings", [dict(mitigation="none", chunk_size=4, window=6, sink_tokens=2),
                                      dict(mitigation="overlap", chunk_size=4, window=5),
                                      dict(mitigation="boundary", chunk_size=4, window=4),
                                      dict(mitigation="stagger", chunk_size=4, window=7)])
def test_align_makes_the_last_prompt_query_see_the_same_grid_at_every_length(settings):
    aligned, fixed = ChunkedKVConfig(**settings, align="prompt_end"), ChunkedKVConfig(**settings)
    lengths = range(60, 60 + 2 * aligned.hop + 3)
    for origin in set(aligned.origins(0, 2)):
        seen = {_seen_from_the_end(aligned, n, grid.shifted(aligned, origin, aligned.grid_shift(n))) for n in lengths}
        assert len(seen) == 1
        assert len({_seen_from_the_end(fixed, n, origin) for n in lengths}) == fixed.hop


@pytest.mark.parametrize("settings", [dict(chunk_size=4, window=4), dict(mitigation="overlap", chunk_size=4, window=4),
                                      dict(mitigation="boundary", chunk_size=5, window=5)])
@pytest.mark.parametrize("origin", [0, 1])
def test_first_lookback_slot_is_the_first_slot_a_window_can_show(settings, origin):
    """Every slot below `first_lookback_slot` holds no chunk (a group below
    the head's first) or one the window hides (`slot_position` behind it);
    the slot group at it holds a chunk whose last token the query still sees."""
    cfg = ChunkedKVConfig(**settings)
    origin = origin % cfg.hop
    spg = grid.slots_per_group(cfg)
    for t in range(60):
        for lookback in (1, 5, 13):
            lo = grid.first_lookback_slot(cfg, t, lookback, origin)
            assert all(not grid.in_lookback(t, grid.slot_position(cfg, s, origin), lookback)
                       for s in range(lo) if grid.slot_chunk(cfg, s, origin) >= 0)
            k = grid.slot_chunk(cfg, lo, origin)
            assert lo % spg == 0 and grid.chunk_in_lookback(cfg, k, t, lookback, origin)
            assert k == 0 or not grid.chunk_in_lookback(cfg, k - 1, t, lookback, origin)
