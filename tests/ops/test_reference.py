"""Contract of vllm_chunked_kv.ops.reference, the ground truth of docs/design.md §3-4 and §10.

- With nothing sealed (window >= length) or chunk_size == hop == 1 it is
  causal attention (torch SDPA, GQA) within 1e-5; with a logit cap and
  learned sinks, chunk 1 is causal attention with the cap and the sinks
  written out, and each of them changes the output.
- With the model's own sliding window (``lookback``), chunk 1 is
  sliding-window causal attention, a window past the sequence changes
  nothing, and the visible set keeps raw positions within the window and
  the chunks whose last token lies within it.
- The output at position t depends only on tokens <= t.
- The visible set follows the seal rule by hand (sinks, boundaries, origins).
- Rows kept per chunk_size tokens match the docs/design.md §4 table.
- The proportional logit makes a chunk of identical tokens weigh like the
  raw tokens it replaced.
- Pooling: gated one-hot gains pick their slot, key_norm weights are the
  softmax of the key norms, keep_boundary pools the chunk_size - 2 interior;
  explicit slot weights (learned gains) pool like gated with those gains,
  carry gradients, and keep cfg's logit bias.
- Staggered grids: all origins 0 is the unstaggered result.

The vectorised form is held to this module in `test_masked.py`.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.ops.strategies import ORIGINS, capped_sink_attention, configs, pick_origins, qkv, sdpa
from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.reference import pool_chunk, reference_chunked_attention, visible_set

torch.set_num_threads(1)
FAST = settings(max_examples=25, deadline=None)


@FAST
@given(cfg=configs(), seq_len=st.integers(1, 40), group=st.sampled_from([1, 2, 4]), origins=ORIGINS)
def test_nothing_sealed_is_causal_attention(cfg, seq_len, group, origins):
    cfg = cfg.model_copy(update={"window": max(cfg.window, seq_len)})
    q, k, v = qkv(seq_len, 2 * group, 2)
    out = reference_chunked_attention(q, k, v, cfg, origins=pick_origins(origins, cfg, 2))
    torch.testing.assert_close(out, sdpa(q, k, v), atol=1e-5, rtol=0)


@FAST
@given(window=st.integers(1, 9), sinks=st.integers(0, 5), seq_len=st.integers(1, 60), group=st.sampled_from([1, 2, 4]))
def test_unit_chunks_are_causal_attention(window, sinks, seq_len, group):
    cfg = ChunkedKVConfig(chunk_size=1, window=window, sink_tokens=sinks)
    q, k, v = qkv(seq_len, 2 * group, 2)
    torch.testing.assert_close(reference_chunked_attention(q, k, v, cfg), sdpa(q, k, v), atol=1e-5, rtol=0)


@pytest.mark.parametrize("softcap, with_sinks", [(3.0, False), (0.0, True), (3.0, True)])
def test_unit_chunks_with_cap_and_sinks_are_causal_attention(softcap, with_sinks):
    cfg = ChunkedKVConfig(chunk_size=1, window=4, sink_tokens=2)
    q, k, v = qkv(30, 6, 2)
    q = q * 3  # logits past the cap
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(5)) * 2 if with_sinks else None
    got = reference_chunked_attention(q, k, v, cfg, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, capped_sink_attention(q, k, v, softcap, sinks), atol=1e-5, rtol=0)
    assert not torch.allclose(got, reference_chunked_attention(q, k, v, cfg), atol=1e-3)


@pytest.mark.parametrize("lookback", [1, 5, 16])
def test_unit_chunks_with_a_sliding_window_are_sliding_window_attention(lookback):
    cfg = ChunkedKVConfig(chunk_size=1, window=4, sink_tokens=2)
    q, k, v = qkv(40, 4, 2)
    got = reference_chunked_attention(q, k, v, cfg, lookback=lookback)
    torch.testing.assert_close(got, capped_sink_attention(q, k, v, 0.0, None, lookback), atol=1e-5, rtol=0)


@FAST
@given(cfg=configs(), seq_len=st.integers(1, 40), origins=ORIGINS)
def test_a_window_past_the_sequence_changes_nothing(cfg, seq_len, origins):
    q, k, v = qkv(seq_len, 4, 2)
    o = pick_origins(origins, cfg, 2)
    torch.testing.assert_close(reference_chunked_attention(q, k, v, cfg, origins=o, lookback=seq_len),
                               reference_chunked_attention(q, k, v, cfg, origins=o), atol=0, rtol=0)


def test_sliding_window_visible_set_by_hand():
    cfg = ChunkedKVConfig(chunk_size=4, window=4, sink_tokens=2)
    # t = 30: chunks 0..5 sealed ([0, 24)), raw from 24; window 10 reads positions 21..30.
    raw, rows = visible_set(30, cfg, 0, lookback=10)
    assert raw == list(range(24, 31))  # the sinks 0, 1 have left the window
    assert rows == [5]  # chunk 5 = [20, 24): last token 23 > 20; chunk 4 ends at 19
    assert visible_set(30, cfg, 0, lookback=11)[1] == [5]  # 19 is not > 30 - 11
    assert visible_set(30, cfg, 0, lookback=12)[1] == [4, 5]


@FAST
@given(cfg=configs(), seq_len=st.integers(2, 60), cut=st.integers(0, 59), origins=ORIGINS)
def test_causal(cfg, seq_len, cut, origins):
    cut = cut % seq_len
    q, k, v = qkv(seq_len, 4, 2)
    later = torch.arange(seq_len) > cut
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[later] = torch.randn_like(x[later]) * 3
    o = pick_origins(origins, cfg, 2)
    before = reference_chunked_attention(q, k, v, cfg, origins=o)[: cut + 1]
    after = reference_chunked_attention(q2, k2, v2, cfg, origins=o)[: cut + 1]
    torch.testing.assert_close(before, after, atol=0, rtol=0)


def test_sinks_and_boundaries_by_hand():
    # chunk 4, window 4, 6 sinks, t = 20: chunks ending at or before 17 are sealed (0..3);
    # chunk 0 = [0, 4) lies inside the sinks (no row); chunk 1 = [4, 8) is pooled whole.
    cfg = ChunkedKVConfig(chunk_size=4, window=4, sink_tokens=6)
    assert grid.num_sealed(cfg, 20) == 4
    assert visible_set(20, cfg) == ([0, 1, 2, 3, 4, 5, 16, 17, 18, 19, 20], [1, 2, 3])
    boundary = ChunkedKVConfig(mitigation="boundary", window=4, sink_tokens=1)
    assert visible_set(20, boundary) == ([0, 3, 4, 7, 8, 11, 12, 15, 16, 17, 18, 19, 20], [0, 1, 2, 3])
    # origin 2: positions 0, 1 stay raw; chunk k covers [2 + 4k, 6 + 4k), sealed while 5 + 4k <= 16
    assert visible_set(20, ChunkedKVConfig(chunk_size=4, window=4), origin=2) == ([0, 1, 14, 15, 16, 17, 18, 19, 20], [0, 1, 2])


# docs/design.md §4: stored rows per `base` tokens of the compressed region, for chunk size `base`.
DESIGN_ROWS = {"none": lambda base: 1, "boundary": lambda base: 3, "overlap": lambda base: 2, "stride2": lambda base: base // 2, "stagger": lambda base: 1}


@pytest.mark.parametrize("base", [4, 8])
@pytest.mark.parametrize("mitigation", list(DESIGN_ROWS))
def test_rows_per_chunk_match_design_table(mitigation, base):
    settings_ = {"mitigation": mitigation, "window": 16, "sink_tokens": 3}
    if mitigation != "stride2":
        settings_["chunk_size"] = base
    cfg = ChunkedKVConfig(**settings_)
    periods = 50
    for origin in sorted({0, cfg.hop - 1}):

        def count(t):
            raw, rows = visible_set(t, cfg, origin)
            return len(raw) + len(rows)

        t = 101
        assert count(t + periods * base) - count(t) == periods * DESIGN_ROWS[mitigation](base)
    assert cfg.rows_per_chunk * base / cfg.chunk_size == DESIGN_ROWS[mitigation](base)


@pytest.mark.parametrize("pooling", ["mean", "gated", "key_norm"])
@pytest.mark.parametrize("mitigation", ["none", "boundary", "stride2", "stagger"])
def test_proportional_logit_makes_identical_chunk_weigh_like_raw_tokens(mitigation, pooling):
    gains = {"gated": [0.5, 2.0, 1.0, 0.3] if mitigation != "stride2" else [0.5, 2.0]}.get(pooling)
    cfg = ChunkedKVConfig(mitigation=mitigation, window=8, pooling=pooling, slot_gains=gains)
    seq_len, origins = 60, [0, cfg.hop // 2]
    q, k, v = qkv(seq_len, 4, 2)
    for h, origin in enumerate(origins):  # make every chunk of head h's grid hold one repeated token
        for start in range(origin, seq_len, cfg.chunk_size):
            k[start : start + cfg.chunk_size, h] = k[start, h].clone()
            v[start : start + cfg.chunk_size, h] = v[start, h].clone()
    exact = sdpa(q, k, v)
    torch.testing.assert_close(reference_chunked_attention(q, k, v, cfg, origins=origins), exact, atol=1e-5, rtol=0)
    unweighted = cfg.model_copy(update={"proportional": False})
    gap = (reference_chunked_attention(q, k, v, unweighted, origins=origins) - exact).abs().max()
    assert gap > 1e-3


def test_pooling_modes():
    gen = torch.Generator().manual_seed(1)
    keys = torch.randn(5, 3, 4, 8, generator=gen)  # [chunks, heads, chunk_size, head_dim]
    values = torch.randn(5, 3, 4, 8, generator=gen)
    for slot in range(4):
        gains = [0.0] * 4
        gains[slot] = 2.5
        row_k, row_v, log_w = pool_chunk(keys, values, ChunkedKVConfig(pooling="gated", slot_gains=gains))
        torch.testing.assert_close(row_k, keys[..., slot, :])
        torch.testing.assert_close(row_v, values[..., slot, :])
        assert log_w.shape == (5, 3) and torch.allclose(log_w, torch.tensor(math.log(4)))
    norms = torch.linalg.vector_norm(keys, dim=-1)  # [5, 3, 4]
    weights = norms.exp() / norms.exp().sum(-1, keepdim=True)
    row_k, row_v, _ = pool_chunk(keys, values, ChunkedKVConfig(pooling="key_norm"))
    torch.testing.assert_close(row_v, (weights[..., None] * values).sum(-2))
    torch.testing.assert_close(row_k, (weights[..., None] * keys).sum(-2))
    row_k, _, _ = pool_chunk(keys, values, ChunkedKVConfig())
    torch.testing.assert_close(row_k, keys.mean(-2))
    _, _, log_w = pool_chunk(keys, values, ChunkedKVConfig(proportional=False))
    assert torch.all(log_w == 0)


def test_explicit_slot_weights_pool_like_gated():
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(5, 3, 4, 8, generator=gen)  # [chunks, heads, chunk_size, head_dim]
    values = torch.randn(5, 3, 4, 8, generator=gen)
    logits = torch.randn(4, generator=gen).requires_grad_()
    row_k, row_v, log_w = pool_chunk(keys, values, ChunkedKVConfig(), logits.softmax(-1))
    gated = ChunkedKVConfig(pooling="gated", slot_gains=logits.softmax(-1).tolist())
    want_k, want_v, want_log_w = pool_chunk(keys, values, gated)
    torch.testing.assert_close(row_k, want_k)
    torch.testing.assert_close(row_v, want_v)
    torch.testing.assert_close(log_w, want_log_w)
    row_k.sum().backward()
    assert logits.grad is not None and logits.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="4 slot weights"):
        pool_chunk(keys, values, ChunkedKVConfig(), torch.ones(3) / 3)


def test_keep_boundary_pools_the_interior():
    gen = torch.Generator().manual_seed(2)
    keys = torch.randn(7, 6, 8, generator=gen)  # [chunks, chunk_size, head_dim]
    values = torch.randn(7, 6, 8, generator=gen)
    row_k, row_v, log_w = pool_chunk(keys, values, ChunkedKVConfig(mitigation="boundary", chunk_size=6))
    torch.testing.assert_close(row_k, keys[:, 1:5].mean(-2))
    torch.testing.assert_close(row_v, values[:, 1:5].mean(-2))
    assert torch.allclose(log_w, torch.tensor(math.log(4)))
    gated = ChunkedKVConfig(mitigation="boundary", chunk_size=6, pooling="gated", slot_gains=[9.0, 1.0, 0.0, 0.0, 3.0, 9.0])
    row_k, _, _ = pool_chunk(keys, values, gated)
    torch.testing.assert_close(row_k, 0.25 * keys[:, 1] + 0.75 * keys[:, 4])
    norms = torch.linalg.vector_norm(keys[:, 1:5], dim=-1)  # [7, 4] interior only
    row_k, _, _ = pool_chunk(keys, values, ChunkedKVConfig(mitigation="boundary", chunk_size=6, pooling="key_norm"))
    torch.testing.assert_close(row_k, (norms.softmax(-1)[..., None] * keys[:, 1:5]).sum(-2))


@FAST
@given(cfg=configs(), seq_len=st.integers(1, 80))
def test_all_origins_zero_is_unstaggered(cfg, seq_len):
    q, k, v = qkv(seq_len, 4, 2)
    torch.testing.assert_close(
        reference_chunked_attention(q, k, v, cfg, origins=[0, 0]), reference_chunked_attention(q, k, v, cfg), atol=0, rtol=0
    )
