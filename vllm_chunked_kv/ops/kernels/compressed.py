"""Chunked attention over the compressed layout, in plain PyTorch.

Per layer and step (see `core/layout.py` for where rows live, `plans/step_plan.py`
for the indices):

1. `shared.write_raw`: store the step's new K/V rows that outlive the step in
   the raw pages;
2. `write_chunks`: pool every chunk completed in this step from its raw rows
   (stored, or the step's own) and store the pooled row (and, with boundary
   retention, its first and last raw rows) in the compressed pages;
3. `attend`: one softmax per query over sinks + sealed compressed rows + the
   raw region, every request's key set gathered from both page sets and the
   step's own rows.

Caches are ``[num_blocks, num_kv_heads, rows_per_block, head_size +
head_size_v]`` (keys then values), raw pages with one row per token,
compressed pages with one row per state. Math is fp32; stored rows keep the
cache dtype, or are FP8 bytes read and written through `ops/fp8.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import fp8, reference
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels.shared import gather_rows, step_gains, store_rows, zero_unused_slots
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites, KeySet, StepPlan


def write_chunks(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: ChunkWrites,
                 cfg: ChunkedKVConfig, head_size: int, fmt: PageFormat | None = None) -> None:
    """Pool the chunks completed in this step into their compressed slots. With FP8
    pages (`fmt`), step_rows are the step's stored bytes, the chunk's rows are read as
    the pages hold them and the pooled row is quantised once."""
    zero_unused_slots(comp_cache, writes)
    if not writes.heads.numel():
        return
    rows = gather_rows(raw_cache, step_rows, writes.src_blocks, writes.src_offsets, writes.src_step,
                       writes.heads[:, None], fmt)  # [M, chunk_size, Dk + Dv]
    keys, values = rows[..., :head_size], rows[..., head_size:]  # [M, chunk_size, Dk], [M, chunk_size, Dv]
    gains = None if cfg.pooling == "key_norm" else step_gains(writes, cfg, comp_cache.device)  # [chunk_size]
    key_row, value_row, _ = reference.pool_chunk(keys, values, cfg, gains)  # [M, Dk], [M, Dv]
    pooled = torch.cat([key_row, value_row], dim=-1).to(rows.dtype)  # [M, Dk + Dv]
    kept = [pooled] + ([rows[:, 0], rows[:, -1]] if cfg.keep_boundary else [])  # grid.SlotKind order
    comp_cache[writes.dst_blocks, writes.heads[:, None], writes.dst_offsets] = store_rows(
        torch.stack(kept, dim=1), comp_cache, fmt)


def attend(query: torch.Tensor, step_rows: torch.Tensor, comp_cache: torch.Tensor, raw_cache: torch.Tensor,
           plan: StepPlan, scale: float, *, out: torch.Tensor | None = None, softcap: float = 0.0,
           sinks: torch.Tensor | None = None, lookback: int = 0, fmt: PageFormat | None = None) -> torch.Tensor:
    """Attention of every query token of the step: query ``[n, Hq, D]``,
    step_rows ``[n, Hkv, Dk + Dv]`` (the step's K/V; with FP8 pages, `fmt`, the
    bytes stored for them, read back as the pages are) -> ``[n, Hq, Dv]`` in the
    query dtype (fp32 math), written into ``out`` when given. The plan must
    carry its bias (`build_plan(..., bias=True)`). ``softcap`` (0: none) and
    ``sinks`` ``[Hq]`` (None: none) are the model's logit cap and learned
    sink logits (`reference.softmax_weights`); ``lookback`` (0: none) the
    layer's own sliding window (`reference.visible_set`), applied here on
    top of the plan's bias, which the step's layers share.

    Each key set's rows are gathered per KV head (``[b, Hkv, N, Dk + Dv]``,
    three parts: stored raw rows, the step's own rows, compressed slots) and
    enter one softmax: for the batched single-token queries without copying
    the parts into one tensor, for a multi-token request through PyTorch's
    fused attention over the concatenated rows (it never holds all logits),
    or, with a cap or sinks, which it cannot apply, the parts' softmax over
    `QUERY_SLICE` queries at a time.
    """
    n, num_heads, head_size = query.shape
    num_kv_heads = raw_cache.shape[1]
    group = num_heads // num_kv_heads
    if out is None:
        out = query.new_empty(n, num_heads, raw_cache.shape[-1] - head_size)
    for keys in plan.key_sets:
        b, num_q = keys.query_index.shape
        raw = _read(_gather(raw_cache, keys.raw_blocks, keys.raw_offsets), fmt)  # [b, Hkv, Nr, Dk + Dv]
        padding = torch.arange(raw.shape[2], device=raw.device)[None, :] >= keys.num_raw[:, None]  # [b, Nr]
        raw = raw.masked_fill(padding[:, None, :, None], 0)  # padding rows may hold dropped rows: masked anyway
        own = _read(step_rows[keys.query_index].transpose(1, 2), fmt)  # [b, Hkv, L, Dk + Dv]
        slots = _read(_gather(comp_cache, *keys.slot_tables()), fmt)  # [b, Hkv, Nc, Dk + Dv]
        bias = keys.bias
        if lookback:  # the layer's own sliding window, on top of the bias the step's layers share
            bias = bias.masked_fill(outside_lookback(plan.cfg, keys, raw.shape[2], lookback), float("-inf"))
        q = query[keys.query_index].float()  # [b, L, Hq, D]
        q = q.view(b, num_q, num_kv_heads, group, head_size).permute(0, 2, 3, 1, 4)  # [b, Hkv, G, L, D]
        parts = [part.float() for part in (raw, own, slots)]
        head_sinks = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1, 1)
        if num_q == 1:
            o = _attend_parts(q, parts, bias, scale, head_size, softcap, head_sinks)  # [b, Hkv, G, 1, Dv]
        elif softcap > 0 or sinks is not None:  # one request, its queries a slice at a time
            o = torch.cat([_attend_parts(q[:, :, :, lo:lo + QUERY_SLICE], parts, bias[:, :, lo:lo + QUERY_SLICE],
                                         scale, head_size, softcap, head_sinks)
                           for lo in range(0, num_q, QUERY_SLICE)], dim=3)  # [1, Hkv, G, L, Dv]
        else:  # one request: a fused kernel over the concatenated rows
            kv = torch.cat(parts, dim=2)[0]  # [Hkv, N, Dk + Dv]
            o = F.scaled_dot_product_attention(
                q[0], kv[:, None, :, :head_size], kv[:, None, :, head_size:], attn_mask=bias[0][:, None],
                scale=scale, enable_gqa=True)[None]  # [1, Hkv, G, L, Dv]
        o = o.permute(0, 3, 1, 2, 4)  # [b, L, Hkv, G, Dv]
        out[keys.query_index] = o.reshape(b, num_q, num_heads, -1).to(out.dtype)  # [b, L, Hq, Dv]
    return out


def outside_lookback(cfg: ChunkedKVConfig, keys: KeySet, num_raw: int, lookback: int) -> torch.Tensor:
    """Where a layer's own sliding window hides a row, ``[b, Hkv, L, Nr + L +
    Nc]`` bool like the plan's bias: stored raw rows and the step's rows by
    position, compressed slots by `grid.slot_position` (column ``n`` of a
    bias plan is slot ``n``)."""
    t = keys.query_positions[:, None, :, None]  # [b, 1, L, 1]
    j = torch.cat([keys.raw_positions[:, :num_raw], keys.query_positions], dim=1)[:, None, None, :]  # [b, 1, 1, Nr + L]
    o = keys.origins[:, :, None, None]  # [b, Hkv, 1, 1]
    num_slots = keys.bias.shape[-1] - j.shape[-1]
    s = torch.arange(num_slots, device=t.device)[None, None, None, :]  # [1, 1, 1, Nc]
    raw = grid.in_lookback(t, j, lookback).expand(-1, o.shape[1], -1, -1)  # [b, Hkv, L, Nr + L]
    slots = grid.in_lookback(t, grid.slot_position(cfg, s, o), lookback)  # [b, Hkv, L, Nc]
    return torch.cat([raw, slots.expand(-1, -1, t.shape[2], -1)], dim=-1).logical_not()


QUERY_SLICE = 256  # queries of a multi-token request whose logits are held at once (cap or sinks)


def _gather(cache: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows at (block, offset) ``[b, N]`` of every KV head: ``[b, Hkv, N, Dk + Dv]``.
    A contiguous cache is read as a flat row array (a plain row copy)."""
    num_blocks, num_kv_heads, per_block, width = cache.shape
    heads = torch.arange(num_kv_heads, device=cache.device)[None, :, None]  # [1, Hkv, 1]
    if not cache.is_contiguous():
        return cache[blocks[:, None, :], heads, offsets[:, None, :]]
    flat = (blocks[:, None, :] * num_kv_heads + heads) * per_block + offsets[:, None, :]  # [b, Hkv, N]
    return cache.view(-1, width).index_select(0, flat.view(-1)).view(*flat.shape, width)


def _read(rows: torch.Tensor, fmt: PageFormat | None) -> torch.Tensor:
    """Gathered rows as their pages hold them: themselves, or FP8 bytes dequantised (fp32)."""
    return rows if fmt is None else fp8.dequantise(rows, fmt)


def _attend_parts(q: torch.Tensor, parts: list[torch.Tensor], bias: torch.Tensor, scale: float,
                  head_size: int, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One softmax over several row sets without copying them into one tensor:
    q ``[b, Hkv, G, L, D]``, parts ``[b, Hkv, N_i, Dk + Dv]``, bias ``[b, Hkv, L,
    sum N_i]``, sinks ``[1, Hkv, G, 1, 1]`` or None -> ``[b, Hkv, G, L, Dv]``."""
    b, num_kv_heads, group, num_q, _ = q.shape
    q = q.reshape(b, num_kv_heads, group * num_q, head_size) * scale  # [b, Hkv, G*L, D]
    logits = torch.cat([q @ part[..., :head_size].transpose(-1, -2) for part in parts], dim=-1)  # [b, Hkv, G*L, N]
    logits = logits.view(b, num_kv_heads, group, num_q, -1)  # [b, Hkv, G, L, N]
    probs = reference.softmax_weights(logits, bias[:, :, None], softcap=softcap, sinks=sinks)  # [b, Hkv, G, L, N]
    probs = probs.view(b, num_kv_heads, group * num_q, -1)  # [b, Hkv, G*L, N]
    sizes = [part.shape[2] for part in parts]
    out = sum(p @ part[..., head_size:] for p, part in zip(probs.split(sizes, dim=-1), parts))  # [b, Hkv, G*L, Dv]
    return out.view(b, num_kv_heads, group, num_q, -1)
