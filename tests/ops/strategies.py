"""Shared test inputs for the attention definitions: any valid config, q/k/v, grid origins."""

import torch
import torch.nn.functional as F
from hypothesis import assume
from hypothesis import strategies as st

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError


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


def qkv(seq_len: int, num_heads: int, num_kv_heads: int, head_dim: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(seq_len, num_heads, head_dim, generator=gen)
    k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
    return q, k, v


def sdpa(q, k, v):
    # [T, H, D] -> [H, T, D] for SDPA, and back
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
    return out.transpose(0, 1)


def capped_sink_attention(q, k, v, softcap: float, sinks, lookback: int = 0):
    """Causal attention written out: logits q.k / sqrt(D), capped to
    softcap * tanh(x / softcap) when softcap > 0, a sink logit per query head
    ``[H]`` (or None) in each softmax's denominator, keys at least
    ``lookback`` positions back hidden (a sliding window; 0: none).
    [T, H, D] -> [T, H, Dv]."""
    seq_len, num_heads, head_dim = q.shape
    group = num_heads // k.shape[1]
    out = torch.empty(seq_len, num_heads, v.shape[-1])
    for h in range(num_heads):
        keys, values = k[:, h // group], v[:, h // group]  # [T, D], [T, Dv]
        logits = q[:, h] @ keys.T / head_dim ** 0.5  # [T, T]
        if softcap > 0:
            logits = softcap * torch.tanh(logits / softcap)
        hidden = torch.ones(seq_len, seq_len).triu(1).bool()  # [T, T] later keys
        if lookback:
            hidden |= torch.ones(seq_len, seq_len).tril(-lookback).bool()  # keys t - j >= lookback
        logits = logits.masked_fill(hidden, float("-inf"))
        if sinks is not None:
            logits = torch.cat([logits, sinks[h].expand(seq_len, 1)], dim=1)  # [T, T + 1]
        out[:, h] = logits.softmax(dim=-1)[:, :seq_len] @ values
    return out


def pick_origins(draw_origins, cfg: ChunkedKVConfig, num_kv_heads: int):
    return [o % cfg.hop for o in draw_origins[:num_kv_heads]]


ORIGINS = st.lists(st.integers(0, 7), min_size=4, max_size=4)
