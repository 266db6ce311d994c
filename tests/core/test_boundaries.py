"""Dynamic boundaries (`core/boundaries.py`, docs/design.md §12):

- every decided frame ends one chunk after one of its units, so chunks are
  whole units of ``min_chunk`` to ``2 * chunk_size - min_chunk`` tokens;
- the cut is where adjacent keys differ most, a tie going to the later cut
  (keys that never change give the fixed grid of `none`);
- a frame's cut reads no key after the frame's next position: the cuts of a
  prefix are those of the whole sequence (what a step recomputes from the
  pages, and what prefix caching needs);
- each unit's row is the mean of the chunk that covers it, and with the
  storage grid's ``log(min_chunk)`` bias a wholly sealed chunk of ``n``
  tokens weighs as one row with ``log(n)``."""

from __future__ import annotations

import math

import pytest
import torch

from vllm_chunked_kv.core import boundaries
from vllm_chunked_kv.core.config import ChunkedKVConfig

CFG = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16)


def keys(seq_len: int, heads: int = 3, seed: int = 0) -> torch.Tensor:
    return torch.randn(seq_len, heads, 8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cfg", [CFG, ChunkedKVConfig(boundaries="dynamic", chunk_size=6, min_chunk=2, window=24),
                                 ChunkedKVConfig(boundaries="dynamic", chunk_size=8, min_chunk=4, window=32)])
def test_one_cut_per_frame_after_a_unit(cfg):
    cuts = boundaries.chunk_cuts(cfg, keys(203))  # [F, Hkv]
    assert cuts.shape == (boundaries.decided_frames(cfg, 203), 3)
    frames = torch.arange(cuts.shape[0])[:, None]
    assert torch.all(cuts // cfg.chunk_size == frames)  # one cut in each frame
    assert torch.all((cuts + 1) % cfg.min_chunk == 0)  # after a unit's last token
    lengths = torch.diff(torch.cat([torch.full((1, 3), -1), cuts]), dim=0)
    assert lengths.min() >= cfg.min_chunk and lengths.max() <= boundaries.max_chunk(cfg)
    assert len(set(lengths.flatten().tolist())) > 1  # the cuts move with the keys


def test_cut_where_keys_change_most_and_ties_go_late():
    k = torch.ones(13, 1, 8)
    assert boundaries.chunk_cuts(CFG, k)[:, 0].tolist() == [3, 7, 11]  # the fixed grid
    k[6:] = -1  # keys change between positions 5 and 6
    assert boundaries.chunk_cuts(CFG, k)[:, 0].tolist() == [3, 5, 11]


def test_cuts_of_a_prefix_are_final():
    k = keys(150)
    whole = boundaries.chunk_cuts(CFG, k)
    for seq_len in (1, 4, 5, 9, 61, 100):
        prefix = boundaries.chunk_cuts(CFG, k[:seq_len])
        assert torch.equal(prefix, whole[: prefix.shape[0]])


def test_unit_rows_are_their_chunk_mean():
    k, v = keys(61), keys(61, seed=1)
    key_rows, value_rows, decided = boundaries.unit_rows(k, v, CFG)  # [N, Hkv, D] x2, [N, Hkv]
    cuts = boundaries.chunk_cuts(CFG, k)
    for h in range(3):
        first = 0
        for last in cuts[:, h].tolist():
            for m in range(first // 2, last // 2 + 1):
                assert decided[m, h]
                torch.testing.assert_close(key_rows[m, h], k[first:last + 1, h].mean(0))
                torch.testing.assert_close(value_rows[m, h], v[first:last + 1, h].mean(0))
            first = last + 1
        assert not decided[first // 2:, h].any()


def test_sealed_chunk_weighs_as_one_row():
    """n / u equal rows with bias log u and one row with log n give one softmax."""
    grid = CFG.storage_grid()
    n, logit = 6, torch.tensor(0.7)
    copies = torch.cat([torch.zeros(5), torch.full((n // CFG.min_chunk,), logit + grid.log_weight)]).softmax(0)
    single = torch.cat([torch.zeros(5), (logit + math.log(n))[None]]).softmax(0)
    torch.testing.assert_close(copies[:5], single[:5])
