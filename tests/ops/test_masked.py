"""Contract of vllm_chunked_kv.ops.masked, the vectorised form of the reference.

- Its masks equal the per-query ``visible_set`` of the reference for every
  query and head, with and without a model sliding window (``lookback``),
  and every row it shows is a sealed chunk.
- The whole-sequence masked attention equals `reference_chunked_attention`
  (the per-query loop) on odd lengths, 1-token sequences and GQA ratios 1,
  2, 4, for any valid config and grid origins, with and without a window.
- `extended_kv` appends one padded row per chunk and head, with a bias of
  ``-inf``, ``0`` on raw rows and ``log_weight`` on pooled rows; origins out
  of ``[0, hop)`` are refused, as are slot weights with dynamic boundaries
  (whose rows would not use them).
- Staggered grids keep the same rows per token as the unstaggered one, plus
  fewer than hop raw rows on average (the positions before the origin).
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.strategies import ORIGINS, configs, pick_origins, qkv
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.masked import extended_kv, masked_chunked_attention, visibility
from vllm_chunked_kv.ops.reference import is_sealed, reference_chunked_attention, visible_set

torch.set_num_threads(1)


@settings(max_examples=25, deadline=None)
@given(cfg=configs(), seq_len=st.integers(1, 50), origins=ORIGINS, lookback=st.sampled_from([0, 1, 7, 20]))
def test_masks_equal_visible_set(cfg, seq_len, origins, lookback):
    o = pick_origins(origins, cfg, 3)
    raw, rows = visibility(seq_len, cfg, torch.tensor(o), lookback=lookback)  # [T, Hkv, T], [T, Hkv, N]
    for t in range(seq_len):
        for h, origin in enumerate(o):
            want_raw, want_rows = visible_set(t, cfg, origin, lookback)
            assert raw[t, h].nonzero().flatten().tolist() == want_raw
            assert rows[t, h].nonzero().flatten().tolist() == want_rows
            assert all(is_sealed(c, t, cfg, origin) for c in want_rows)


@settings(max_examples=15, deadline=None)
@given(cfg=configs(), seq_len=st.sampled_from([1, 2, 17, 63, 100]), group=st.sampled_from([1, 2, 4]), origins=ORIGINS,
       lookback=st.sampled_from([0, 9]))
def test_equals_the_per_query_reference(cfg, seq_len, group, origins, lookback):
    q, k, v = qkv(seq_len, 2 * group, 2)
    o = pick_origins(origins, cfg, 2)
    torch.testing.assert_close(
        masked_chunked_attention(q, k, v, cfg, origins=o, lookback=lookback),
        reference_chunked_attention(q, k, v, cfg, origins=o, lookback=lookback),
        atol=1e-5, rtol=1e-5,
    )


@pytest.mark.parametrize("seq_len", [1, 17, 63, 100])
@pytest.mark.parametrize("sinks", [0, 3])
def test_dynamic_boundaries_equal_the_per_query_reference(seq_len, sinks):
    cfg = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16, sink_tokens=sinks)
    q, k, v = qkv(seq_len, 4, 2)
    torch.testing.assert_close(masked_chunked_attention(q, k, v, cfg), reference_chunked_attention(q, k, v, cfg),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mitigation", ["none", "boundary", "overlap", "stride2"])
@pytest.mark.parametrize("sinks", [0, 5])
def test_stagger_keeps_memory_per_token(mitigation, sinks):
    cfg = ChunkedKVConfig(mitigation=mitigation, chunk_size=2 if mitigation == "stride2" else 8, window=16, sink_tokens=sinks)
    seq_len = 400
    origins = torch.arange(cfg.hop)  # one head per origin
    raw, rows = visibility(seq_len, cfg, origins)  # [T, Hkv, T], [T, Hkv, N]
    kept = raw.sum(-1) + rows.sum(-1)  # [T, Hkv] rows each query sees per head
    tail = kept[100 : 100 + 20 * cfg.chunk_size].float()  # whole periods of every grid
    extra = tail.mean(0) - tail[:, 0].mean()  # average extra rows of each origin over origin 0
    assert torch.all(extra.abs() < cfg.hop)
    if sinks == 0:  # the o positions before the origin stay raw instead of compressed
        compressed_rate = float(cfg.rows_per_chunk / cfg.chunk_size)  # rows per token when sealed
        torch.testing.assert_close(extra, origins.float() * (1 - compressed_rate))
    assert torch.all(kept[-1] - kept[-1 - cfg.chunk_size * 10] == kept[-1, 0] - kept[-1 - cfg.chunk_size * 10, 0])


def test_extended_kv_shapes_and_bias():
    cfg = ChunkedKVConfig(window=4, sink_tokens=2)
    q, k, v = qkv(23, 2, 2)
    ext = extended_kv(k, v, cfg, origins=[0, 3])
    n = ext.keys.shape[0] - 23
    assert n == 5  # head 0 fits chunks [0,4) .. [16,20); head 3's fit fewer and pad
    assert ext.keys.shape == (23 + n, 2, 8) and ext.values.shape == (23 + n, 2, 8)
    assert ext.bias.shape == (23, 2, 23 + n)
    rows = ext.bias[..., 23:]
    assert torch.all((rows == float("-inf")) | (rows == math.log(4)))
    raw = ext.bias[..., :23]
    assert torch.all((raw == float("-inf")) | (raw == 0))
    with pytest.raises(ValueError):
        extended_kv(k, v, cfg, origins=[0, 4])
    dynamic = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16, sink_tokens=1)
    with pytest.raises(ValueError, match="fixed chunk boundaries"):
        extended_kv(k, v, dynamic, weights=torch.full((dynamic.chunk_size,), 0.25))
