"""The ground truth for every CHUNKED_KV kernel: docs/design.md §3-4 and §10 in plain PyTorch.

Positions count from 0 at the first prompt token. Each KV head ``h`` has a
grid origin ``o`` in ``[0, hop)`` (0 unless staggered). For a query at
position ``t``:

- chunk ``k`` covers ``[o + k*hop, o + k*hop + chunk_size)``;
- chunk ``k`` is sealed when ``o + k*hop + chunk_size - 1 <= t - window``;
  sealed chunks are always ``0 .. K-1`` for some ``K``;
- raw positions (a set, each attended once): ``j <= t`` that is a sink
  (``j < sink_tokens``), lies before the origin, lies at or after the end of
  the last sealed chunk, or (``keep_boundary``) is the first or last token of
  a sealed chunk;
- one compressed row per sealed chunk, pooled over all its (interior)
  positions, sinks included, with logit bias ``log(n)`` when proportional;
  a chunk lying wholly inside the sinks gets no row;
- one softmax over raw positions and compressed rows.

All math is fp32. Functions that take many chunks or heads are vectorised;
``visible_set`` and the seal rule are per query, for readability and tests.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vllm_chunked_kv.config import ChunkedKVConfig

# ----------------------------------------------------------------- the seal rule


def chunk_bounds(k: int, cfg: ChunkedKVConfig, origin: int = 0) -> tuple[int, int]:
    """Positions ``[start, end)`` covered by chunk ``k`` of a grid starting at ``origin``."""
    start = origin + k * cfg.hop
    return start, start + cfg.chunk_size


def is_sealed(k: int, t: int, cfg: ChunkedKVConfig, origin: int = 0) -> bool:
    """Whether chunk ``k`` is sealed for a query at position ``t``."""
    _, end = chunk_bounds(k, cfg, origin)
    return k >= 0 and end - 1 <= t - cfg.window


def num_sealed(t: int, cfg: ChunkedKVConfig, origin: int = 0) -> int:
    """Number ``K`` of sealed chunks for a query at ``t`` (they are chunks ``0 .. K-1``)."""
    slack = t - cfg.window - (origin + cfg.chunk_size - 1)
    return slack // cfg.hop + 1 if slack >= 0 else 0


def visible_set(t: int, cfg: ChunkedKVConfig, origin: int = 0) -> tuple[list[int], list[int]]:
    """What a query at ``t`` attends to on one KV head: (raw positions, sorted;
    indices of the sealed chunks that have a compressed row)."""
    sealed = num_sealed(t, cfg, origin)
    raw_from = chunk_bounds(sealed - 1, cfg, origin)[1] if sealed else origin
    raw = set(range(min(cfg.sink_tokens, t + 1))) | set(range(min(origin, t + 1))) | set(range(raw_from, t + 1))
    rows = []
    for k in range(sealed):
        start, end = chunk_bounds(k, cfg, origin)
        if cfg.keep_boundary:
            raw |= {start, end - 1}
        if end > cfg.sink_tokens and len(cfg.pooled_slots) > 0:
            rows.append(k)
    return sorted(raw), rows


# ----------------------------------------------------------------------- pooling


def slot_weights(keys: torch.Tensor, cfg: ChunkedKVConfig) -> torch.Tensor:
    """Pooling weight of each slot of each chunk, fp32, ``[..., chunk_size]``,
    summing to 1 over the pooled slots (0 on kept boundary slots)."""
    if cfg.pooling != "key_norm":
        fixed = torch.tensor(cfg.normalised_gains(), dtype=torch.float32, device=keys.device)
        return fixed.expand(keys.shape[:-1])  # [chunk_size] -> [..., chunk_size]
    pooled = torch.zeros(cfg.chunk_size, dtype=torch.bool, device=keys.device)
    pooled[list(cfg.pooled_slots)] = True
    norms = keys.float().norm(dim=-1)  # [..., chunk_size, head_dim] -> [..., chunk_size]
    return norms.masked_fill(~pooled, float("-inf")).softmax(dim=-1)


def pool_chunk(
    keys: torch.Tensor, values: torch.Tensor, cfg: ChunkedKVConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool chunks into compressed rows.

    keys, values: ``[..., chunk_size, head_dim]`` (keys after RoPE), any
    leading dims (chunks, heads). Returns fp32 ``(key_row [..., head_dim],
    value_row [..., head_dim], log_weight [...])``, where log_weight is the
    logit bias of the row: ``log(pooled positions)`` if proportional, else 0.
    """
    if keys.shape[-2] != cfg.chunk_size or values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"expected [..., {cfg.chunk_size}, head_dim] keys and values, got {tuple(keys.shape)}, {tuple(values.shape)}")
    if len(cfg.pooled_slots) == 0:
        raise ValueError("a chunk without interior has no pooled row")
    weights = slot_weights(keys, cfg).unsqueeze(-1)  # [..., chunk_size] -> [..., chunk_size, 1]
    key_row = (weights * keys.float()).sum(dim=-2)  # -> [..., head_dim]
    value_row = (weights * values.float()).sum(dim=-2)  # -> [..., head_dim]
    log_weight = torch.full(keys.shape[:-2], cfg.log_weight, dtype=torch.float32, device=keys.device)
    return key_row, value_row, log_weight


# ------------------------------------------------------- a whole sequence at once


def _origins_tensor(origins: Sequence[int] | torch.Tensor | None, num_kv_heads: int, cfg: ChunkedKVConfig, device) -> torch.Tensor:
    if origins is None:
        return torch.zeros(num_kv_heads, dtype=torch.long, device=device)
    out = torch.as_tensor(origins, dtype=torch.long, device=device)
    if out.shape != (num_kv_heads,) or bool(((out < 0) | (out >= cfg.hop)).any()):
        raise ValueError(f"origins must be {num_kv_heads} integers in [0, hop={cfg.hop}), got {out.tolist()}")
    return out


def num_chunks(seq_len: int, cfg: ChunkedKVConfig, origins: torch.Tensor) -> int:
    """Most whole chunks any head's grid fits in ``seq_len`` positions (the
    compressed rows ``extended_kv`` builds per head, padded to this count)."""
    fits = seq_len - int(origins.min()) - cfg.chunk_size
    return fits // cfg.hop + 1 if fits >= 0 else 0


def visibility(
    seq_len: int, cfg: ChunkedKVConfig, origins: torch.Tensor, positions: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible rows of every query on every KV head, as boolean masks
    ``raw [L, num_kv_heads, T]`` (query, head, key position) and
    ``rows [L, num_kv_heads, N]`` (query, head, chunk index), N = num_chunks.
    The queries are at ``positions`` ``[L]`` (default: all T positions)."""
    device = origins.device
    hop, chunk_size = cfg.hop, cfg.chunk_size
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    t = positions.view(-1, 1, 1)  # [L, 1, 1] query position
    o = origins.view(1, -1, 1)  # [1, Hkv, 1]
    j = torch.arange(seq_len, device=device).view(1, 1, -1)  # [1, 1, T] key position
    slack = t - cfg.window - (o + chunk_size - 1)  # [T, Hkv, 1]
    sealed = torch.where(slack >= 0, torch.div(slack, hop, rounding_mode="floor") + 1, 0)  # [T, Hkv, 1]
    raw_from = torch.where(sealed > 0, o + (sealed - 1) * hop + chunk_size, o)  # [T, Hkv, 1]
    raw = (j < cfg.sink_tokens) | (j < o) | (j >= raw_from)  # [T, Hkv, T]
    if cfg.keep_boundary:
        rel = j - o  # [1, Hkv, T] offset into the head's grid
        first = (rel >= 0) & (rel % hop == 0) & (torch.div(rel, hop, rounding_mode="floor") < sealed)
        last_rel = rel - (chunk_size - 1)
        last = (last_rel >= 0) & (last_rel % hop == 0) & (torch.div(last_rel, hop, rounding_mode="floor") < sealed)
        raw = raw | first | last
    raw = raw & (j <= t)
    n = num_chunks(seq_len, cfg, origins)
    k = torch.arange(n, device=device).view(1, 1, -1)  # [1, 1, N] chunk index
    chunk_end = o + k * hop + chunk_size  # [1, Hkv, N]
    rows = (k < sealed) & (chunk_end > cfg.sink_tokens)  # [T, Hkv, N]
    if len(cfg.pooled_slots) == 0:  # a chunk without interior has no row
        rows = torch.zeros_like(rows)
    return raw, rows


class ExtendedKV(NamedTuple):
    """Raw keys/values followed by every head's pooled chunk rows, and the
    additive mask that turns plain attention over them into §3 attention."""

    keys: torch.Tensor  # [T + N, num_kv_heads, head_dim], fp32
    values: torch.Tensor  # [T + N, num_kv_heads, head_dim], fp32
    bias: torch.Tensor  # [L, num_kv_heads, T + N]: -inf hidden, 0 raw, log_weight on rows (L queries)


def extended_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: ChunkedKVConfig,
    origins: Sequence[int] | torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
) -> ExtendedKV:
    """Build the extended key set of one sequence: k, v ``[T, num_kv_heads,
    head_dim]`` (keys after RoPE). Row ``T + c`` of head ``h`` is chunk ``c``
    of that head's grid (a padding row, always masked, if it does not fit).
    The bias covers queries at ``positions`` ``[L]`` (default: all T)."""
    seq_len, num_kv_heads, head_dim = k.shape
    o = _origins_tensor(origins, num_kv_heads, cfg, k.device)
    n = num_chunks(seq_len, cfg, o)
    starts = o.view(1, -1) + cfg.hop * torch.arange(n, device=k.device).view(-1, 1)  # [N, Hkv]
    slots = starts.unsqueeze(-1) + torch.arange(cfg.chunk_size, device=k.device)  # [N, Hkv, chunk_size]
    slots = slots.clamp(max=max(seq_len - 1, 0))  # padding rows read in-range garbage, masked below
    heads = torch.arange(num_kv_heads, device=k.device).view(1, -1, 1)  # [1, Hkv, 1]
    chunk_k = k[slots, heads]  # [N, Hkv, chunk_size, head_dim]
    chunk_v = v[slots, heads]  # [N, Hkv, chunk_size, head_dim]
    if n and len(cfg.pooled_slots):
        row_k, row_v, log_weight = pool_chunk(chunk_k, chunk_v, cfg)  # [N, Hkv, head_dim] x2, [N, Hkv]
    else:
        row_k = k.new_zeros((n, num_kv_heads, head_dim), dtype=torch.float32)
        row_v = v.new_zeros((n, num_kv_heads, v.shape[-1]), dtype=torch.float32)
        log_weight = k.new_zeros((n, num_kv_heads), dtype=torch.float32)
    raw, rows = visibility(seq_len, cfg, o, positions)  # [L, Hkv, T], [L, Hkv, N]
    raw_bias = torch.zeros(raw.shape, dtype=torch.float32, device=k.device).masked_fill(~raw, float("-inf"))
    row_bias = log_weight.T.unsqueeze(0).expand(rows.shape)  # [N, Hkv] -> [1, Hkv, N] -> [L, Hkv, N]
    row_bias = row_bias.masked_fill(~rows, float("-inf"))
    return ExtendedKV(
        keys=torch.cat([k.float(), row_k], dim=0),  # [T + N, Hkv, head_dim]
        values=torch.cat([v.float(), row_v], dim=0),  # [T + N, Hkv, head_dim]
        bias=torch.cat([raw_bias, row_bias], dim=-1),  # [L, Hkv, T + N]
    )


def reference_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: ChunkedKVConfig,
    *,
    scale: float | None = None,
    origins: Sequence[int] | torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal chunked attention over one sequence (docs/design.md §3-4, §10).

    q ``[T, num_heads, head_dim]``; k, v ``[T, num_kv_heads, head_dim]`` with
    keys after RoPE; num_heads a multiple of num_kv_heads (query head ``i``
    reads KV head ``i // (num_heads / num_kv_heads)``); origins: one grid
    origin per KV head (None: all 0). Returns ``[T, num_heads, head_dim]`` in
    q's dtype, computed in fp32.
    """
    seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (seq_len, num_kv_heads, head_dim) or v.shape[:2] != k.shape[:2] or num_heads % num_kv_heads:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    return attend_extended(q, extended_kv(k, v, cfg, origins), scale)


def attend_extended(q: torch.Tensor, ext: ExtendedKV, scale: float) -> torch.Tensor:
    """One softmax of queries ``q [L, num_heads, head_dim]`` over an extended
    key set whose bias rows belong to those L queries; ``[L, num_heads, Dv]``
    in q's dtype, fp32 math."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = ext.keys.shape[1]
    group = num_heads // num_kv_heads
    grouped_q = q.float().view(num_queries, num_kv_heads, group, head_dim)  # [L, Hkv, G, D]
    logits = torch.einsum("thgd,shd->hgts", grouped_q, ext.keys) * scale  # [Hkv, G, L, T + N]
    logits = logits + ext.bias.permute(1, 0, 2).unsqueeze(1)  # bias [L, Hkv, T+N] -> [Hkv, 1, L, T+N]
    probs = logits.softmax(dim=-1)  # [Hkv, G, L, T + N]
    out = torch.einsum("hgts,shd->thgd", probs, ext.values)  # [L, Hkv, G, Dv]
    return out.reshape(num_queries, num_heads, ext.values.shape[-1]).to(q.dtype)  # [L, num_heads, Dv]
