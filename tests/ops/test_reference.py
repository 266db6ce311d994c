"""Contract of vllm_chunked_kv.ops.reference, the ground truth of docs/design.md §3-4 and §10.

- With nothing sealed (window >= length) or chunk_size == hop == 1 it is
  causal attention (torch SDPA, GQA) within 1e-5.
- The output at position t depends only on tokens <= t.
- The vectorised masks equal the per-query ``visible_set`` of §3, and the
  whole-sequence attention equals a per-query loop over ``visible_set`` and
  ``pool_chunk`` (odd lengths, 1-token sequences, GQA ratios 1, 2, 4).
- Rows kept per chunk_size tokens match the docs/design.md §4 table.
- The proportional logit makes a chunk of identical tokens weigh like the
  raw tokens it replaced.
- Pooling: gated one-hot gains pick their slot, key_norm weights are the
  softmax of the key norms, keep_boundary pools the chunk_size - 2 interior.
- Staggered grids: all origins 0 is the unstaggered result; a staggered head
  keeps the same rows per token, plus fewer than hop raw rows on average.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from vllm_chunked_kv.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.ops.reference import (
    extended_kv,
    is_sealed,
    num_sealed,
    pool_chunk,
    reference_chunked_attention,
    visibility,
    visible_set,
)

torch.set_num_threads(1)
FAST = settings(max_examples=25, deadline=None)


@st.composite
def configs(draw, **fixed) -> ChunkedKVConfig:
    """Any valid config (invalid draws are rejected)."""
    mitigation = fixed.pop("mitigation", None) or draw(st.sampled_from(["none", "boundary", "overlap", "stride2", "stagger"]))
    chunk_size = 2 if mitigation == "stride2" else draw(st.sampled_from([1, 2, 3, 4, 6, 8]))
    pooling = draw(st.sampled_from(["mean", "gated", "key_norm"]))
    raw = {
        "mitigation": mitigation,
        "chunk_size": chunk_size,
        "window": draw(st.integers(chunk_size, 3 * chunk_size + 4)),
        "sink_tokens": draw(st.integers(0, 6)),
        "pooling": pooling,
        "proportional": draw(st.booleans()),
    }
    if mitigation == "none":
        raw["hop"] = draw(st.sampled_from([d for d in range(1, chunk_size + 1) if chunk_size % d == 0]))
    if pooling == "gated":
        raw["slot_gains"] = draw(st.lists(st.floats(0.0, 2.0), min_size=chunk_size, max_size=chunk_size))
    raw.update(fixed)
    try:
        return ChunkedKVConfig(**raw)
    except ChunkedKVConfigError:
        assume(False)


def _qkv(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    return q, k, v


def _sdpa(q, k, v):
    # [T, H, D] -> [H, T, D] for SDPA, and back
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def _origins(draw_origins, cfg: ChunkedKVConfig, num_kv_heads: int):
    return [o % cfg.hop for o in draw_origins[:num_kv_heads]]


ORIGINS = st.lists(st.integers(0, 7), min_size=4, max_size=4)


@FAST
@given(cfg=configs(), seq_len=st.integers(1, 40), group=st.sampled_from([1, 2, 4]), origins=ORIGINS)
def test_nothing_sealed_is_causal_attention(cfg, seq_len, group, origins):
    cfg = cfg.model_copy(update={"window": max(cfg.window, seq_len)})
    q, k, v = _qkv(seq_len, 2 * group, 2)
    out = reference_chunked_attention(q, k, v, cfg, origins=_origins(origins, cfg, 2))
    torch.testing.assert_close(out, _sdpa(q, k, v), atol=1e-5, rtol=0)


@FAST
@given(window=st.integers(1, 9), sinks=st.integers(0, 5), seq_len=st.integers(1, 60), group=st.sampled_from([1, 2, 4]))
def test_unit_chunks_are_causal_attention(window, sinks, seq_len, group):
    cfg = ChunkedKVConfig(chunk_size=1, window=window, sink_tokens=sinks)
    q, k, v = _qkv(seq_len, 2 * group, 2)
    torch.testing.assert_close(reference_chunked_attention(q, k, v, cfg), _sdpa(q, k, v), atol=1e-5, rtol=0)


@FAST
@given(cfg=configs(), seq_len=st.integers(2, 60), cut=st.integers(0, 59), origins=ORIGINS)
def test_causal(cfg, seq_len, cut, origins):
    cut = cut % seq_len
    q, k, v = _qkv(seq_len, 4, 2)
    later = torch.arange(seq_len) > cut
    q2, k2, v2 = (x.clone() for x in (q, k, v))
    for x in (q2, k2, v2):
        x[later] = torch.randn_like(x[later]) * 3
    o = _origins(origins, cfg, 2)
    before = reference_chunked_attention(q, k, v, cfg, origins=o)[: cut + 1]
    after = reference_chunked_attention(q2, k2, v2, cfg, origins=o)[: cut + 1]
    torch.testing.assert_close(before, after, atol=0, rtol=0)


@FAST
@given(cfg=configs(), seq_len=st.integers(1, 50), origins=ORIGINS)
def test_masks_equal_visible_set(cfg, seq_len, origins):
    o = _origins(origins, cfg, 3)
    raw, rows = visibility(seq_len, cfg, torch.tensor(o))  # [T, Hkv, T], [T, Hkv, N]
    for t in range(seq_len):
        for h, origin in enumerate(o):
            want_raw, want_rows = visible_set(t, cfg, origin)
            assert raw[t, h].nonzero().flatten().tolist() == want_raw
            assert rows[t, h].nonzero().flatten().tolist() == want_rows
            assert all(is_sealed(c, t, cfg, origin) for c in want_rows)


def _per_query_attention(q, k, v, cfg, origins):
    """§3 read literally: for each query and head, gather its visible rows and softmax."""
    seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty_like(q)
    for t in range(seq_len):
        for head in range(num_heads):
            kv_head = head // group
            origin = origins[kv_head]
            raw, rows = visible_set(t, cfg, origin)
            keys, values, bias = [k[raw, kv_head]], [v[raw, kv_head]], [torch.zeros(len(raw))]
            for c in rows:
                start = origin + c * cfg.hop
                row_k, row_v, log_w = pool_chunk(k[start : start + cfg.chunk_size, kv_head], v[start : start + cfg.chunk_size, kv_head], cfg)
                keys.append(row_k[None])
                values.append(row_v[None])
                bias.append(log_w[None])
            logits = torch.cat(keys) @ q[t, head] / math.sqrt(head_dim) + torch.cat(bias)
            out[t, head] = logits.softmax(-1) @ torch.cat(values)
    return out


@settings(max_examples=15, deadline=None)
@given(cfg=configs(), seq_len=st.sampled_from([1, 2, 17, 63, 100]), group=st.sampled_from([1, 2, 4]), origins=ORIGINS)
def test_equals_per_query_definition(cfg, seq_len, group, origins):
    q, k, v = _qkv(seq_len, 2 * group, 2)
    o = _origins(origins, cfg, 2)
    torch.testing.assert_close(
        reference_chunked_attention(q, k, v, cfg, origins=o), _per_query_attention(q, k, v, cfg, o), atol=1e-5, rtol=1e-5
    )


def test_sinks_and_boundaries_by_hand():
    # chunk 4, window 4, 6 sinks, t = 20: chunks ending at or before 17 are sealed (0..3);
    # chunk 0 = [0, 4) lies inside the sinks (no row); chunk 1 = [4, 8) is pooled whole.
    cfg = ChunkedKVConfig(chunk_size=4, window=4, sink_tokens=6)
    assert num_sealed(20, cfg) == 4
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
    q, k, v = _qkv(seq_len, 4, 2)
    for h, origin in enumerate(origins):  # make every chunk of head h's grid hold one repeated token
        for start in range(origin, seq_len, cfg.chunk_size):
            k[start : start + cfg.chunk_size, h] = k[start, h].clone()
            v[start : start + cfg.chunk_size, h] = v[start, h].clone()
    exact = _sdpa(q, k, v)
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
    q, k, v = _qkv(seq_len, 4, 2)
    torch.testing.assert_close(
        reference_chunked_attention(q, k, v, cfg, origins=[0, 0]), reference_chunked_attention(q, k, v, cfg), atol=0, rtol=0
    )


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
    q, k, v = _qkv(23, 2, 2)
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
