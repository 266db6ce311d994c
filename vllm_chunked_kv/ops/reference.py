"""The ground truth for every CHUNKED_KV kernel: docs/design.md §3-4 and §10, read literally.

Positions count from 0 at the first prompt token. Each KV head has a grid
origin ``o`` in ``[0, hop)`` (0 unless staggered; with per-request
alignment, ``align``, the heads' origins shifted by the request's prompt
length mod hop, `grid.shifted`); the grid itself (chunk bounds, the seal
rule) is `core/grid.py`. For a query at position ``t`` on one
KV head:

- chunks ``0 .. K-1`` are sealed, ``K = grid.num_sealed(cfg, t, o)``;
- raw positions (a set, each attended once): ``j <= t`` that is a sink
  (``j < sink_tokens``), lies before the origin, lies at or after the end of
  the last sealed chunk, or (``keep_boundary``) is the first or last token
  of a sealed chunk;
- one compressed row per sealed chunk, pooled over its (interior)
  positions, sinks included, with logit bias ``log(n)`` when proportional;
  a chunk lying wholly inside the sinks gets no row;
- in a layer with the model's own sliding window of ``W`` tokens, only the
  raw positions ``j > t - W`` and the rows of chunks whose last token is
  ``> t - W`` (``lookback``; docs/design.md §13);
- one softmax over raw positions and compressed rows (`softmax_weights`):
  the scaled logits soft-capped first when the model caps them
  (``softcap * tanh(x / softcap)``, Gemma 2), then the pooled rows' bias
  added; a model's learned sink logit per query head (GPT-OSS) joins the
  denominator and carries no value.

With dynamic boundaries (``boundaries: dynamic``) the grid above is the
storage grid of units (`ChunkedKVConfig.storage_grid`) and the compressed
row of unit ``m`` is the mean of the dynamic chunk that covers it
(`boundaries.unit_rows`), with bias ``log(min_chunk)``.

`reference_chunked_attention` is that, one query and one head at a time, in
fp32. `masked.py` is the same as one masked softmax over the whole sequence
(for training and long inputs); the kernels are held to this module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from vllm_chunked_kv.core import boundaries, grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.fp8 import PageFormat


def chunk_bounds(k: int, cfg: ChunkedKVConfig, origin: int = 0) -> tuple[int, int]:
    """Positions ``[start, end)`` covered by chunk ``k`` of a grid starting at ``origin``."""
    return grid.chunk_start(cfg, k, origin), grid.chunk_last(cfg, k, origin) + 1


def is_sealed(k: int, t: int, cfg: ChunkedKVConfig, origin: int = 0) -> bool:
    """Whether chunk ``k`` is sealed for a query at position ``t``."""
    return 0 <= k < grid.num_sealed(cfg, t, origin)


def visible_set(t: int, cfg: ChunkedKVConfig, origin: int = 0, lookback: int = 0) -> tuple[list[int], list[int]]:
    """What a query at ``t`` attends to on one KV head: (raw positions, sorted;
    indices of the sealed chunks that have a compressed row). In a layer with
    the model's own sliding window (``lookback`` tokens; 0: none), only raw
    positions within it and chunks whose last token lies within it
    (`grid.chunk_in_lookback`)."""
    sealed = grid.num_sealed(cfg, t, origin)
    kept_raw = set(range(min(grid.forever_raw(cfg, [origin]), t + 1)))  # sinks, positions before the origin
    raw = kept_raw | set(range(grid.raw_from(cfg, t, origin), t + 1))
    rows = []
    for k in range(sealed):
        start, end = chunk_bounds(k, cfg, origin)
        if cfg.keep_boundary:
            raw |= {start, end - 1}
        if end > cfg.sink_tokens and grid.chunk_in_lookback(cfg, k, t, lookback, origin):
            rows.append(k)
    return sorted(j for j in raw if grid.in_lookback(t, j, lookback)), rows


# ----------------------------------------------------------------------- pooling


def slot_weights(keys: torch.Tensor, cfg: ChunkedKVConfig) -> torch.Tensor:
    """Pooling weight of each slot of each chunk, fp32, ``[..., chunk_size]``,
    summing to 1 over the pooled slots (0 on kept boundary slots)."""
    if cfg.pooling != "key_norm":
        fixed = torch.tensor(cfg.normalised_gains(), dtype=torch.float32, device=keys.device)
        return fixed.expand(keys.shape[:-1])  # [chunk_size] -> [..., chunk_size]
    slot = torch.arange(cfg.chunk_size, device=keys.device)  # [chunk_size]
    pooled = (slot >= cfg.pooled_slots.start) & (slot < cfg.pooled_slots.stop)  # [chunk_size]
    norms = keys.float().norm(dim=-1)  # [..., chunk_size, head_dim] -> [..., chunk_size]
    return norms.masked_fill(~pooled, float("-inf")).softmax(dim=-1)


def pool_chunk(
    keys: torch.Tensor, values: torch.Tensor, cfg: ChunkedKVConfig, weights: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pool chunks into compressed rows.

    keys, values: ``[..., chunk_size, head_dim]`` (keys after RoPE), any
    leading dims (chunks, heads). Returns fp32 ``(key_row [..., head_dim],
    value_row [..., head_dim], log_weight [...])``, where log_weight is the
    logit bias of the row: ``log(pooled positions)`` if proportional, else 0.
    ``weights`` ``[chunk_size]``, if given, replace ``slot_weights`` (learned
    gains in training, with gradients; the logit bias stays ``cfg``'s).
    """
    if keys.shape[-2] != cfg.chunk_size or values.shape[:-1] != keys.shape[:-1]:
        raise ValueError(f"expected [..., {cfg.chunk_size}, head_dim] keys and values, got {tuple(keys.shape)}, {tuple(values.shape)}")
    if weights is None:
        weights = slot_weights(keys, cfg)  # [..., chunk_size]
    elif weights.shape != (cfg.chunk_size,):
        raise ValueError(f"expected {cfg.chunk_size} slot weights, got shape {tuple(weights.shape)}")
    weights = weights.float().unsqueeze(-1)  # [..., chunk_size] -> [..., chunk_size, 1]
    key_row = (weights * keys.float()).sum(dim=-2)  # -> [..., head_dim]
    value_row = (weights * values.float()).sum(dim=-2)  # -> [..., head_dim]
    log_weight = torch.full(keys.shape[:-2], cfg.log_weight, dtype=torch.float32, device=keys.device)
    return key_row, value_row, log_weight


# ------------------------------------------------------------------ attention


def softmax_weights(logits: torch.Tensor, bias: torch.Tensor, *, softcap: float = 0.0,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention weights from scaled logits ``[..., N]``: soft-capped when
    ``softcap > 0``, plus ``bias`` (broadcast: the pooled rows' log weight,
    -inf where hidden), softmax over N; with ``sinks`` ``[..., 1]`` (a learned
    logit per query row, broadcast) in the denominator too -> ``[..., N]``,
    summing to 1 less the sink's share."""
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    logits = logits + bias
    if sinks is None:
        return logits.softmax(dim=-1)
    full = torch.cat([logits, sinks.to(logits.dtype).expand(*logits.shape[:-1], 1)], dim=-1)  # [..., N + 1]
    return full.softmax(dim=-1)[..., :-1]


def check_shapes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """q ``[T, num_heads, D]``, k ``[T, num_kv_heads, D]``, v ``[T, num_kv_heads, Dv]``,
    num_heads a multiple of num_kv_heads."""
    seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.shape != (seq_len, num_kv_heads, head_dim) or v.shape[:2] != k.shape[:2] or num_heads % num_kv_heads:
        raise ValueError(f"bad shapes q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")


def reference_chunked_attention(
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
    fmt: PageFormat | None = None,
) -> torch.Tensor:
    """Causal chunked attention over one sequence, one query and head at a time.

    q ``[T, num_heads, head_dim]``; k, v ``[T, num_kv_heads, head_dim]`` with
    keys after RoPE; query head ``i`` reads KV head ``i // (num_heads /
    num_kv_heads)``; origins: one grid origin per KV head in ``[0, hop)``
    (None: all 0); softcap: the model's logit cap (0: none); sinks
    ``[num_heads]``: its learned sink logits (None: none); lookback: the
    layer's own sliding window in tokens (0: none, `visible_set`); fmt: FP8
    pages (`fp8.PageFormat`; None: none): every key and value is read as
    stored and read back, and every pooled row is pooled from those and then
    stored and read back (`fp8.round_trip`). Returns ``[T, num_heads, Dv]`` in
    q's dtype, computed in fp32.
    """
    check_shapes(q, k, v)
    seq_len, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    dynamic, cfg_in = cfg.boundaries == "dynamic", cfg
    cfg = cfg.storage_grid()
    origins = [0] * num_kv_heads if origins is None else [int(o) for o in origins]
    if len(origins) != num_kv_heads or any(not 0 <= o < cfg.hop for o in origins):
        raise ValueError(f"origins must be {num_kv_heads} integers in [0, hop={cfg.hop}), got {origins}")
    if dynamic and any(origins):
        raise ValueError(f"dynamic boundaries cut frames from position 0: origins must be 0, got {origins}")
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    k, v = _stored(k.float(), v.float(), fmt)
    if dynamic:
        unit_k, unit_v, decided = boundaries.unit_rows(k, v, cfg_in)  # [N, Hkv, D], [N, Hkv, Dv], [N, Hkv]
        unit_k, unit_v = _stored(unit_k, unit_v, fmt)
    out = torch.empty((seq_len, num_heads, v.shape[-1]), dtype=torch.float32, device=q.device)
    pooled: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # (head, chunk) -> row
    for t in range(seq_len):
        for h, origin in enumerate(origins):
            raw, chunks = visible_set(t, cfg, origin, lookback)
            for c in chunks:
                if (h, c) in pooled:
                    continue
                if dynamic:  # every sealed unit's chunk is decided (window >= 2 * chunk_size)
                    assert decided[c, h], (c, h, t)
                    pooled[h, c] = unit_k[c, h], unit_v[c, h], torch.tensor(cfg.log_weight)  # [D], [Dv], []
                else:
                    start, end = chunk_bounds(c, cfg, origin)
                    key_row, value_row, log_weight = pool_chunk(k[start:end, h], v[start:end, h], cfg)
                    pooled[h, c] = (*_stored(key_row, value_row, fmt), log_weight)  # [D], [Dv], []
            keys = torch.cat([k[raw, h], *(pooled[h, c][0][None] for c in chunks)])  # [R + C, D]
            values = torch.cat([v[raw, h], *(pooled[h, c][1][None] for c in chunks)])  # [R + C, Dv]
            bias = torch.cat([k.new_zeros(len(raw)), *(pooled[h, c][2][None] for c in chunks)])  # [R + C]
            queries = q[t, h * group:(h + 1) * group].float()  # [group, D]: the query heads reading head h
            head_sinks = None if sinks is None else sinks[h * group:(h + 1) * group, None].float()  # [group, 1]
            probs = softmax_weights(queries @ keys.T * scale, bias, softcap=softcap, sinks=head_sinks)  # [group, R + C]
            out[t, h * group:(h + 1) * group] = probs @ values  # [group, Dv]
    return out.to(q.dtype)


def _stored(keys: torch.Tensor, values: torch.Tensor, fmt: PageFormat | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[..., D]`` and values ``[..., Dv]`` as pages of format `fmt` give them back (None: unchanged)."""
    return (keys, values) if fmt is None else fp8.round_trip_kv(keys, values, fmt)
