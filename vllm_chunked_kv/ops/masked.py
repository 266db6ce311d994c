"""Chunked attention over a whole sequence as one masked softmax.

The vectorised form of `reference.py`, for training and long sequences:
every head's pooled chunk rows are appended to the raw keys, and an additive
mask (``-inf`` hidden, ``0`` raw, ``log_weight`` on pooled rows) turns plain
attention over that extended key set into the visible set of
docs/design.md §3. `tests/ops/test_masked.py` holds it to the per-query
definition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from vllm_chunked_kv.core import boundaries, grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.reference import check_shapes, pool_chunk, softmax_weights


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
    seq_len: int, cfg: ChunkedKVConfig, origins: torch.Tensor, positions: torch.Tensor | None = None,
    lookback: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Visible rows of every query on every KV head, as boolean masks
    ``raw [L, num_kv_heads, T]`` (query, head, key position) and
    ``rows [L, num_kv_heads, N]`` (query, head, chunk index), N = num_chunks.
    The queries are at ``positions`` ``[L]`` (default: all T positions);
    ``lookback``: the layer's own sliding window (0: none)."""
    device = origins.device
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    t = positions.view(-1, 1, 1)  # [L, 1, 1] query position
    o = origins.view(1, -1, 1)  # [1, Hkv, 1]
    j = torch.arange(seq_len, device=device).view(1, 1, -1)  # [1, 1, T] key position
    sealed = grid.num_sealed(cfg, t, o)  # [L, Hkv, 1]
    raw = (j < cfg.sink_tokens) | (j < o) | (j >= grid.raw_from(cfg, t, o))  # [L, Hkv, T]
    if cfg.keep_boundary:
        raw = raw | grid.is_boundary(cfg, j, sealed, o)
    raw = raw & (j <= t) & grid.in_lookback(t, j, lookback)
    n = num_chunks(seq_len, cfg, origins)
    k = torch.arange(n, device=device).view(1, 1, -1)  # [1, 1, N] chunk index
    rows = (k < sealed) & (grid.chunk_last(cfg, k, o) >= cfg.sink_tokens)  # [L, Hkv, N]
    rows = rows & grid.chunk_in_lookback(cfg, k, t, lookback, o)
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
    weights: torch.Tensor | None = None,
    lookback: int = 0,
) -> ExtendedKV:
    """Build the extended key set of one sequence: k, v ``[T, num_kv_heads,
    head_dim]`` (keys after RoPE). Row ``T + c`` of head ``h`` is chunk ``c``
    of that head's grid (a padding row, always masked, if it does not fit).
    The bias covers queries at ``positions`` ``[L]`` (default: all T).
    ``weights`` ``[chunk_size]``: slot weights replacing ``cfg``'s pooling
    (`reference.pool_chunk`; learned gains, fixed chunks only). ``lookback``:
    the layer's own sliding window (0: none; `visibility`)."""
    seq_len, num_kv_heads, head_dim = k.shape
    dynamic, cfg_in = cfg.boundaries == "dynamic", cfg
    if weights is not None and dynamic:
        raise ValueError("slot weights need fixed chunk boundaries")
    cfg = cfg.storage_grid()  # dynamic boundaries: the grid of units, each holding its chunk's row
    o = _origins_tensor(origins, num_kv_heads, cfg, k.device)
    n = num_chunks(seq_len, cfg, o)
    starts = grid.chunk_start(cfg, torch.arange(n, device=k.device).view(-1, 1), o.view(1, -1))  # [N, Hkv]
    slots = starts.unsqueeze(-1) + torch.arange(cfg.chunk_size, device=k.device)  # [N, Hkv, chunk_size]
    slots = slots.clamp(max=max(seq_len - 1, 0))  # padding rows read in-range garbage, masked below
    heads = torch.arange(num_kv_heads, device=k.device).view(1, -1, 1)  # [1, Hkv, 1]
    chunk_k = k[slots, heads]  # [N, Hkv, chunk_size, head_dim]
    chunk_v = v[slots, heads]  # [N, Hkv, chunk_size, head_dim]
    if n and dynamic:
        row_k, row_v, _ = boundaries.unit_rows(k, v, cfg_in)  # [N, Hkv, head_dim] x2
        log_weight = torch.full((n, num_kv_heads), cfg.log_weight, dtype=torch.float32, device=k.device)
    elif n:
        row_k, row_v, log_weight = pool_chunk(chunk_k, chunk_v, cfg, weights)  # [N, Hkv, head_dim] x2, [N, Hkv]
    else:
        row_k = k.new_zeros((n, num_kv_heads, head_dim), dtype=torch.float32)
        row_v = v.new_zeros((n, num_kv_heads, v.shape[-1]), dtype=torch.float32)
        log_weight = k.new_zeros((n, num_kv_heads), dtype=torch.float32)
    raw, rows = visibility(seq_len, cfg, o, positions, lookback)  # [L, Hkv, T], [L, Hkv, N]
    raw_bias = torch.zeros(raw.shape, dtype=torch.float32, device=k.device).masked_fill(~raw, float("-inf"))
    row_bias = log_weight.T.unsqueeze(0).expand(rows.shape)  # [N, Hkv] -> [1, Hkv, N] -> [L, Hkv, N]
    row_bias = row_bias.masked_fill(~rows, float("-inf"))
    return ExtendedKV(
        keys=torch.cat([k.float(), row_k], dim=0),  # [T + N, Hkv, head_dim]
        values=torch.cat([v.float(), row_v], dim=0),  # [T + N, Hkv, head_dim]
        bias=torch.cat([raw_bias, row_bias], dim=-1),  # [L, Hkv, T + N]
    )


def masked_chunked_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cfg: ChunkedKVConfig,
    *,
    scale: float | None = None,
    origins: Sequence[int] | torch.Tensor | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    lookback: int = 0,
) -> torch.Tensor:
    """`reference.reference_chunked_attention`, vectorised: one masked softmax
    (with the same logit cap, sink logits ``[num_heads]`` and sliding window).

    q ``[T, num_heads, head_dim]``; k, v ``[T, num_kv_heads, head_dim]`` with
    keys after RoPE; num_heads a multiple of num_kv_heads (query head ``i``
    reads KV head ``i // (num_heads / num_kv_heads)``); origins: one grid
    origin per KV head (None: all 0). Returns ``[T, num_heads, head_dim]`` in
    q's dtype, computed in fp32.
    """
    check_shapes(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return attend_extended(q, extended_kv(k, v, cfg, origins, lookback=lookback), scale, softcap=softcap, sinks=sinks)


def attend_extended(q: torch.Tensor, ext: ExtendedKV, scale: float, *, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One softmax of queries ``q [L, num_heads, head_dim]`` over an extended
    key set whose bias rows belong to those L queries (`reference.softmax_weights`:
    the model's logit cap, sink logits ``[num_heads]``); ``[L, num_heads, Dv]``
    in q's dtype, fp32 math."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads = ext.keys.shape[1]
    group = num_heads // num_kv_heads
    grouped_q = q.float().view(num_queries, num_kv_heads, group, head_dim)  # [L, Hkv, G, D]
    logits = torch.einsum("thgd,shd->hgts", grouped_q, ext.keys) * scale  # [Hkv, G, L, T + N]
    bias = ext.bias.permute(1, 0, 2).unsqueeze(1)  # [L, Hkv, T+N] -> [Hkv, 1, L, T+N]
    head_sinks = None if sinks is None else sinks.float().view(num_kv_heads, group, 1, 1)
    probs = softmax_weights(logits, bias, softcap=softcap, sinks=head_sinks)  # [Hkv, G, L, T + N]
    out = torch.einsum("hgts,shd->thgd", probs, ext.values)  # [L, Hkv, G, Dv]
    return out.reshape(num_queries, num_heads, ext.values.shape[-1]).to(q.dtype)  # [L, num_heads, Dv]
