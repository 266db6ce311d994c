"""Triton chunked attention over the compressed layout (docs/design.md §3-4, §10):
`attend` computes what `compressed.attend` computes, from the same
`StepPlan`, without its dense bias.

One program handles up to ``BLOCK_M`` consecutive queries of one row of a
`KeySet` (a decode request, or a tile of one multi-token request) on one KV
head, i.e. ``BLOCK_M * GROUP`` query rows (GQA), and keeps one online
softmax per row over the key set's three parts:

1. stored raw rows (sinks, rows before the head's grid origin, the raw
   region before the step), read through their (block, offset);
2. the step's own rows, read from the step's K/V: only the index ranges that
   can be visible to the tile (the leading forever-raw positions and the raw
   region from the tile's first query on), not the whole request;
3. compressed slots ``0 .. num_slots - 1`` of the request, up to the last
   group sealed for the tile; a pooled row enters with logit bias
   ``log_weight``, boundary rows (slots 1 and 2 of a group) raw.

Visibility per row follows from positions and the config in
`_chunked_kv_seal` / `_chunked_kv_raw_visible` / `_chunked_kv_slot_visible`,
the same rule `step_plan._bias` writes as a tensor. Long contexts can be
split across ``NUM_SPLITS`` programs per (tile, head): each takes every
NUM_SPLITS-th block of every part and writes a partial softmax (max, sum,
weighted values) that `_combine` merges.

FP8 pages (``FP8``, `triton_fp8`): every key and value row is read as its
bytes, the step's own rows too (`attend` takes their stored bytes), and
the scales are applied outside the loops: k_scale folded into the query
scale (a logit is ``scale * k_scale * q . k_byte``), v_scale multiplying
the weighted values (and so the split partials before merging).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels import triton_fp8
from vllm_chunked_kv.ops.plans.step_plan import KeySet, StepPlan

INTERPRETED = bool(triton.knobs.runtime.interpret)

SLOT_POOLED = tl.constexpr(int(grid.SlotKind.POOLED))  # the grid's slot kinds, by name in the kernels
SLOT_FIRST = tl.constexpr(int(grid.SlotKind.FIRST))
_NEG_BIG = tl.constexpr(-1.0e30)  # finite start of the running max (see _chunked_kv_online_update)


@triton.jit
def _chunked_kv_seal(t, window, origin, CHUNK_SIZE: tl.constexpr, HOP: tl.constexpr):
    """For query position(s) ``t``: (number of sealed chunks, first position of
    the raw region after them) on a grid starting at ``origin``: `grid.num_sealed`
    and `grid.raw_from` in kernel form."""
    slack = t - window - (origin + CHUNK_SIZE - 1)
    sealed = tl.where(slack >= 0, tl.maximum(slack, 0) // HOP + 1, 0)
    raw_from = tl.where(sealed > 0, origin + (sealed - 1) * HOP + CHUNK_SIZE, origin)
    return sealed, raw_from


@triton.jit
def _chunked_kv_raw_visible(j, ok, t, raw_from, prefix_end, lookback):
    """Raw rows at positions ``j [N]`` seen by queries at ``t [ROWS]``: the
    forever-raw prefix and the raw region, causally, within the layer's own
    sliding window of ``lookback`` tokens (0: none) -> ``[ROWS, N]``."""
    raw = (j[None, :] < prefix_end) | (j[None, :] >= raw_from[:, None])
    in_window = (lookback == 0) | (t[:, None] - j[None, :] < lookback)
    return ok[None, :] & raw & (j[None, :] <= t[:, None]) & in_window


@triton.jit
def _chunked_kv_slot_visible(n, ok, sealed, origin, first_group, sink_tokens, t, lookback,
                             CHUNK_SIZE: tl.constexpr, HOP: tl.constexpr, SPG: tl.constexpr):
    """Compressed slots ``n [N]`` seen by rows at ``t [ROWS]`` with ``sealed
    [ROWS]`` chunks -> ``[ROWS, N]``, and whether each slot is a pooled row
    ``[N]``. A chunk wholly inside the sinks has no pooled row; a boundary
    token that is a sink is seen once, as a sink; within a sliding window of
    ``lookback`` tokens (0: none), a slot is seen while `grid.slot_position` is."""
    kind = n % SPG  # a grid.SlotKind
    k = n // SPG - first_group  # chunk index
    first = origin + k * HOP
    last = first + CHUNK_SIZE - 1
    exists = ok & (k >= 0) & tl.where(kind == SLOT_FIRST, first >= sink_tokens, last >= sink_tokens)
    visible = exists[None, :] & (n[None, :] < SPG * (sealed[:, None] + first_group))
    leaves = tl.where(kind == SLOT_FIRST, first, last)
    visible = visible & ((lookback == 0) | (t[:, None] - leaves[None, :] < lookback))
    return visible, kind == SLOT_POOLED


@triton.jit
def _chunked_kv_mm(a, b, USE_DOT: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32 (tensor cores need every dim >= 16)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _chunked_kv_load_rows(ptr, row_off, ok, COL0: tl.constexpr, WIDTH: tl.constexpr, W_P2: tl.constexpr,
                          FP8: tl.constexpr):
    """Columns ``[COL0, COL0 + WIDTH)`` of the rows at element offsets
    ``row_off [N]`` (int64) as fp32 ``[N, W_P2]``, 0 where masked (FP8
    pages: the bytes' values, unscaled)."""
    col = tl.arange(0, W_P2)
    mask = ok[:, None] & (col < WIDTH)[None, :]
    return triton_fp8.load(ptr, row_off[:, None] + COL0 + col[None, :], mask, FP8)


@triton.jit
def _chunked_kv_online_update(m_i, l_i, acc, q, ptr, row_off, ok, visible, bias, softcap,
                              HEAD_D: tl.constexpr, D_P2: tl.constexpr, HEAD_DV: tl.constexpr,
                              DV_P2: tl.constexpr, USE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
                              FP8: tl.constexpr):
    """Fold a block of ``N`` rows (keys then values at ``row_off``) into the
    running softmax of every query row, logits capped first with
    ``SOFTCAP``. ``m_i`` starts finite, so hidden scores (-inf) give exactly
    0 even before a row has seen anything."""
    keys = _chunked_kv_load_rows(ptr, row_off, ok, 0, HEAD_D, D_P2, FP8)  # [N, D_P2]
    values = _chunked_kv_load_rows(ptr, row_off, ok, HEAD_D, HEAD_DV, DV_P2, FP8)  # [N, DV_P2]
    logits = _chunked_kv_mm(q, tl.trans(keys), USE_DOT)  # [ROWS, N]
    if SOFTCAP:  # softcap * tanh(x / softcap), tanh(y) = 1 - 2 / (e^2y + 1)
        logits = softcap * (1.0 - 2.0 / (tl.exp(2.0 * logits / softcap) + 1.0))
    logits = logits + bias
    logits = tl.where(visible, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))  # [ROWS]
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])  # [ROWS, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _chunked_kv_mm(p, values, USE_DOT)  # [ROWS, DV_P2]
    return m_new, l_i, acc


@triton.jit
def _chunked_kv_own_rows(m_i, l_i, acc, q, step_ptr, q_index_row, lo, hi, p0, t, raw_from, prefix_end, lookback,
                         split, head64, stride_st, stride_sh, softcap, HEAD_D: tl.constexpr, D_P2: tl.constexpr,
                         HEAD_DV: tl.constexpr, DV_P2: tl.constexpr, BLOCK_N: tl.constexpr,
                         NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
                         FP8: tl.constexpr):
    """Fold the step's own rows ``lo .. hi - 1`` of a key-set row (own row
    ``i`` is token ``q_index_row[i]`` at position ``p0 + i``)."""
    n = tl.arange(0, BLOCK_N)
    for i in range(split, tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N), NUM_SPLITS):
        idx = lo + i * BLOCK_N + n
        ok = idx < hi
        own = tl.load(q_index_row + idx, mask=ok, other=0).to(tl.int64)
        row_off = own * stride_st + head64 * stride_sh
        visible = _chunked_kv_raw_visible(p0 + idx, ok, t, raw_from, prefix_end, lookback)
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, q, step_ptr, row_off, ok, visible, 0.0, softcap,
                                                  HEAD_D, D_P2, HEAD_DV, DV_P2, USE_DOT, SOFTCAP, FP8)
    return m_i, l_i, acc


@triton.jit
def _chunked_kv_attention_kernel(
    q_ptr, step_ptr, raw_ptr, comp_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    q_index_ptr, q_pos_ptr,  # [b, L] contiguous
    raw_blocks_ptr, raw_offsets_ptr, raw_pos_ptr,  # [b, Nr] contiguous
    comp_blocks_ptr, comp_offsets_ptr,  # [b, Nc] contiguous
    num_raw_ptr, num_slots_ptr, origins_ptr,  # [b], [b], [b, Hkv]
    sinks_ptr,  # [Hq] fp32 learned sink logits (read when HAS_SINKS)
    scale, v_scale,  # the query scale (FP8 pages: times k_scale) and the values' scale (1 without FP8 pages)
    log_weight, softcap, lookback, window, sink_tokens, num_q, max_raw, max_slots, num_tokens, tiles_per_row,
    stride_qt, stride_qh, stride_st, stride_sh, stride_rb, stride_rh, stride_rs,
    stride_cb, stride_ch, stride_cs, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr,
    ROWS: tl.constexpr, HEAD_D: tl.constexpr, D_P2: tl.constexpr, HEAD_DV: tl.constexpr, DV_P2: tl.constexpr,
    CHUNK_SIZE: tl.constexpr, HOP: tl.constexpr, SPG: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, FP8: tl.constexpr,
):
    work, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    row = work // tiles_per_row  # row of the key set (a request)
    first = (work % tiles_per_row) * BLOCK_M  # this tile's first query within the row
    count = tl.minimum(num_q - first, BLOCK_M)
    q_row = row.to(tl.int64) * num_q
    p0 = tl.load(q_pos_ptr + q_row)  # position of the row's first query (positions are consecutive)
    t_lo = p0 + first
    t_hi = t_lo + count - 1
    origin = tl.load(origins_ptr + row * tl.num_programs(1) + head)  # the request's grid on this KV head
    first_group = (origin + CHUNK_SIZE - 1) // HOP
    prefix_end = tl.maximum(sink_tokens, origin)  # forever raw: sinks, positions before the origin
    head64 = head.to(tl.int64)

    # Query rows: row r is query first + r // GROUP_P2, query head head * GROUP + r % GROUP_P2.
    r = tl.arange(0, ROWS)
    m_idx = r // GROUP_P2
    g = r % GROUP_P2
    row_ok = (m_idx < count) & (m_idx < BLOCK_M) & (g < GROUP)
    token = tl.load(q_index_ptr + q_row + first + m_idx, mask=row_ok, other=0).to(tl.int64)  # [ROWS]
    q_head = head * GROUP + g
    d = tl.arange(0, D_P2)
    q_ptrs = q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (d < HEAD_D)[None, :], other=0.0).to(tl.float32) * scale  # [ROWS, D_P2]
    t = t_lo + m_idx  # [ROWS] query positions
    sealed, raw_from = _chunked_kv_seal(t, window, origin, CHUNK_SIZE, HOP)  # [ROWS], [ROWS]
    sealed_hi, _ = _chunked_kv_seal(t_hi, window, origin, CHUNK_SIZE, HOP)
    _, raw_lo = _chunked_kv_seal(t_lo, window, origin, CHUNK_SIZE, HOP)

    m_i = tl.zeros([ROWS], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    if HAS_SINKS:  # a learned sink logit: in split 0's denominator from the start, no value
        sink = tl.load(sinks_ptr + q_head, mask=row_ok, other=0.0)  # [ROWS]
        m_i = tl.where(split == 0, sink, m_i)
        l_i = tl.where(split == 0, 1.0, l_i)
    acc = tl.zeros([ROWS, DV_P2], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # 1. stored raw rows (before the step): few, all of them
    raw_row = row.to(tl.int64) * max_raw
    num_raw = tl.load(num_raw_ptr + row)
    for i in range(split, tl.cdiv(num_raw, BLOCK_N), NUM_SPLITS):
        idx = i * BLOCK_N + n
        ok = idx < num_raw
        j = tl.load(raw_pos_ptr + raw_row + idx, mask=ok, other=0)
        block = tl.load(raw_blocks_ptr + raw_row + idx, mask=ok, other=0).to(tl.int64)
        offset = tl.load(raw_offsets_ptr + raw_row + idx, mask=ok, other=0).to(tl.int64)
        row_off = block * stride_rb + head64 * stride_rh + offset * stride_rs
        visible = _chunked_kv_raw_visible(j, ok, t, raw_from, prefix_end, lookback)
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, q, raw_ptr, row_off, ok, visible, 0.0, softcap,
                                                  HEAD_D, D_P2, HEAD_DV, DV_P2, USE_DOT, SOFTCAP, FP8)

    # 2. the step's own rows: own row i is at position p0 + i; two disjoint
    # index ranges can be visible: the forever-raw prefix and the raw region.
    tail_hi = t_hi - p0 + 1  # causal: nothing after the tile's last query
    pre_hi = tl.minimum(tl.maximum(tl.minimum(prefix_end, raw_lo) - p0, 0), tail_hi)
    tail_lo = tl.maximum(raw_lo - p0, 0)
    m_i, l_i, acc = _chunked_kv_own_rows(m_i, l_i, acc, q, step_ptr, q_index_ptr + q_row, 0, pre_hi, p0, t,
                                         raw_from, prefix_end, lookback, split, head64, stride_st, stride_sh, softcap,
                                         HEAD_D, D_P2, HEAD_DV, DV_P2, BLOCK_N, NUM_SPLITS, USE_DOT, SOFTCAP, FP8)
    m_i, l_i, acc = _chunked_kv_own_rows(m_i, l_i, acc, q, step_ptr, q_index_ptr + q_row, tail_lo, tail_hi, p0, t,
                                         raw_from, prefix_end, lookback, split, head64, stride_st, stride_sh, softcap,
                                         HEAD_D, D_P2, HEAD_DV, DV_P2, BLOCK_N, NUM_SPLITS, USE_DOT, SOFTCAP, FP8)

    # 3. compressed slots up to the last group sealed for the tile, from the first chunk whose last token
    # the first query still sees through a sliding window (grid.first_lookback_slot; vLLM frees the pages
    # behind it)
    comp_row = row.to(tl.int64) * max_slots
    limit = tl.minimum(tl.load(num_slots_ptr + row), SPG * (sealed_hi + first_group))
    behind = t_lo - lookback - origin - CHUNK_SIZE + 1
    first_chunk = tl.where(behind >= 0, tl.maximum(behind, 0) // HOP + 1, 0)
    slot_lo = tl.where(lookback > 0, SPG * (first_chunk + first_group), 0)
    for i in range(split, tl.cdiv(tl.maximum(limit - slot_lo, 0), BLOCK_N), NUM_SPLITS):
        s = slot_lo + i * BLOCK_N + n
        ok = s < limit
        visible, pooled = _chunked_kv_slot_visible(s, ok, sealed, origin, first_group, sink_tokens, t, lookback,
                                                   CHUNK_SIZE, HOP, SPG)
        block = tl.load(comp_blocks_ptr + comp_row + s, mask=ok, other=0).to(tl.int64)
        offset = tl.load(comp_offsets_ptr + comp_row + s, mask=ok, other=0).to(tl.int64)
        row_off = block * stride_cb + head64 * stride_ch + offset * stride_cs
        bias = tl.where(pooled, log_weight, 0.0)[None, :]  # [1, BLOCK_N]
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, q, comp_ptr, row_off, ok, visible, bias, softcap,
                                                  HEAD_D, D_P2, HEAD_DV, DV_P2, USE_DOT, SOFTCAP, FP8)

    acc = acc * v_scale  # FP8 pages: the values' scale (1 otherwise)
    dv = tl.arange(0, DV_P2)
    store_ok = row_ok[:, None] & (dv < HEAD_DV)[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + dv[None, :]
        tl.store(out_ptrs, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=store_ok)
    else:  # partials [NUM_SPLITS, num_tokens, NUM_Q_HEADS, HEAD_DV] and [2, NUM_SPLITS, num_tokens, NUM_Q_HEADS]
        flat = (split * num_tokens + token) * NUM_Q_HEADS + q_head  # [ROWS]
        tl.store(part_acc_ptr + flat[:, None] * HEAD_DV + dv[None, :], acc, mask=store_ok)
        tl.store(part_ml_ptr + flat, m_i, mask=row_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * NUM_Q_HEADS + flat, l_i, mask=row_ok)


# ------------------------------------------------------------------ host side


def default_splits(num_programs: int, max_keys: int, device: torch.device) -> int:
    """Programs per (tile, head): enough to fill the device when few tiles
    cover a long context, never more than one per 1024 keys. NUM_SPLITS is a
    kernel constant, so the count is rounded down to a power of two: a
    server compiles at most six variants instead of one per batch shape."""
    if device.type != "cuda" or num_programs == 0:
        return 1
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return split_bucket(min(triton.cdiv(target, num_programs), triton.cdiv(max_keys, 1024), 32))


def split_bucket(splits: int) -> int:
    """The power of two at or below `splits` (at least 1)."""
    return 1 << (max(1, splits).bit_length() - 1)


def launch_constants(plan: StepPlan, *, num_heads: int, num_kv_heads: int, head_d: int, head_dv: int,
                     tile_m: int, splits: int, on_gpu: bool = True, softcap: bool = False,
                     sinks: bool = False, fp8_kind: int = 0) -> dict:
    """The constexpr parameters (and num_warps) of one attention launch
    (``softcap``, ``sinks``: whether the model caps logits, has sink logits;
    ``fp8_kind``: the pages' `triton_fp8.kind`)."""
    cfg = plan.cfg
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    rows = max(16 if on_gpu else 1, triton.next_power_of_2(tile_m * group_p2))  # tl.dot on a GPU wants >= 16 rows
    return dict(
        NUM_Q_HEADS=num_heads, GROUP=group, GROUP_P2=group_p2, BLOCK_M=tile_m, ROWS=rows,
        HEAD_D=head_d, D_P2=triton.next_power_of_2(head_d), HEAD_DV=head_dv, DV_P2=triton.next_power_of_2(head_dv),
        CHUNK_SIZE=cfg.chunk_size, HOP=cfg.hop, SPG=grid.slots_per_group(cfg),
        BLOCK_N=16 if INTERPRETED else 64 if max(head_d, head_dv) <= 128 else 32,  # head 256: fits shared memory
        NUM_SPLITS=splits,
        USE_DOT=rows >= 16 and head_d >= 16 and head_dv >= 16,
        SOFTCAP=softcap, HAS_SINKS=sinks, FP8=fp8_kind,
        num_warps=4 if rows <= 32 else 8,
    )


def attend(query: torch.Tensor, step_rows: torch.Tensor, comp_cache: torch.Tensor, raw_cache: torch.Tensor,
           plan: StepPlan, scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
           block_m: int | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None,
           lookback: int = 0, fmt: PageFormat | None = None) -> torch.Tensor:
    """`compressed.attend` (bias not needed): query ``[n, Hq, D]``, step_rows
    ``[n, Hkv, D + Dv]``, caches ``[num_blocks, Hkv, rows, D + Dv]`` (rows
    contiguous) -> ``[n, Hq, Dv]`` in the query dtype (fp32 math), written
    into ``out`` when given (every element of the step's queries is
    written), with the model's logit cap, sink logits ``[Hq]`` and the
    layer's own sliding window as there (slots behind it are not read).
    ``num_splits``: programs per tile and head (None: enough to
    fill the device). ``block_m``: queries per tile of a multi-token request
    (None: 64 query rows per tile). FP8 pages (`fmt`): caches and step_rows of bytes (the
    step's rows as stored)."""
    n, num_heads, head_d = query.shape
    num_kv_heads, head_dv = raw_cache.shape[1], raw_cache.shape[-1] - head_d
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    for name, t in (("query", query), ("step_rows", step_rows), ("comp_cache", comp_cache), ("raw_cache", raw_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last-dim stride 1)")
    if out is None:
        out = query.new_empty(n, num_heads, head_dv)
    if n == 0:
        return out
    scales = (float(scale), 1.0)  # the kernel's query scale and v_scale
    if fmt is not None:
        step_rows = triton_fp8.page_bytes(step_rows, "step_rows")  # [n, Hkv, D + Dv] the stored bytes
        comp_cache = triton_fp8.page_bytes(comp_cache, "comp_cache")  # [num_blocks, Hkv, rows, D + Dv] bytes
        raw_cache = triton_fp8.page_bytes(raw_cache, "raw_cache")
        scales = (float(scale) * fmt.k_scale, float(fmt.v_scale))
    device = query.device
    group_p2 = triton.next_power_of_2(num_heads // num_kv_heads)
    block_m = block_m or max(1, 64 // group_p2)
    tiles = [(keys, 1 if keys.query_index.shape[1] == 1 else block_m) for keys in plan.key_sets]
    programs = sum(keys.query_index.shape[0] * triton.cdiv(keys.query_index.shape[1], tile_m)
                   for keys, tile_m in tiles) * num_kv_heads
    max_keys = max(keys.raw_blocks.shape[1] + keys.query_index.shape[1] + keys.num_slot_columns
                   for keys, _ in tiles)
    splits = num_splits or default_splits(programs, max_keys, device)
    part_acc = part_ml = out  # unused placeholders when there is one split
    if splits > 1:
        part_acc = torch.empty(splits, n, num_heads, head_dv, dtype=torch.float32, device=device)
        part_ml = torch.empty(2, splits, n, num_heads, dtype=torch.float32, device=device)
    logits = (float(softcap), out if sinks is None else sinks.to(device=device, dtype=torch.float32).contiguous(),
              int(lookback))
    for keys, tile_m in tiles:
        consts = launch_constants(plan, num_heads=num_heads, num_kv_heads=num_kv_heads, head_d=head_d,
                                  head_dv=head_dv, tile_m=tile_m, splits=splits, on_gpu=device.type != "cpu",
                                  softcap=softcap > 0, sinks=sinks is not None, fp8_kind=triton_fp8.kind(fmt))
        _launch(query, step_rows, comp_cache, raw_cache, out, part_acc, part_ml, keys, plan, scales, logits, consts)
    if splits > 1:
        _combine(part_acc, part_ml, out)
    return out


def _launch(query, step_rows, comp_cache, raw_cache, out, part_acc, part_ml, keys: KeySet, plan: StepPlan,
            scales: tuple, logits: tuple, consts: dict) -> None:
    """One kernel launch over the queries of one key set; ``scales``: the
    query scale and v_scale; ``logits``: the model's (softcap, sinks ``[Hq]``
    fp32, any tensor when it has none, the layer's sliding window or 0)."""
    softcap, sinks, lookback = logits
    num_rows, num_q = keys.query_index.shape
    tiles_per_row = triton.cdiv(num_q, consts["BLOCK_M"])
    c = lambda t: t.contiguous()  # noqa: E731
    cfg = plan.cfg
    comp_blocks, comp_offsets = keys.slot_tables()  # [b, Nc] each
    _chunked_kv_attention_kernel[(num_rows * tiles_per_row, raw_cache.shape[1], consts["NUM_SPLITS"])](
        query, step_rows, raw_cache, comp_cache, out, part_acc, part_ml,
        c(keys.query_index), c(keys.query_positions),
        c(keys.raw_blocks), c(keys.raw_offsets), c(keys.raw_positions),
        c(comp_blocks), c(comp_offsets),
        c(keys.num_raw), c(keys.num_slots), keys.origins.to(dtype=torch.int32).contiguous(), sinks,
        *scales, cfg.log_weight, softcap, lookback, cfg.window, cfg.sink_tokens, num_q, keys.raw_blocks.shape[1],
        comp_blocks.shape[1], query.shape[0], tiles_per_row,
        query.stride(0), query.stride(1), step_rows.stride(0), step_rows.stride(1),
        raw_cache.stride(0), raw_cache.stride(1), raw_cache.stride(2),
        comp_cache.stride(0), comp_cache.stride(1), comp_cache.stride(2), out.stride(0), out.stride(1),
        **consts,
    )


def _combine(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split partials: acc ``[S, n, Hq, Dv]``, (max, sum) ``[2, S, n, Hq]``."""
    m, l = part_ml[0], part_ml[1]  # [S, n, Hq] each
    weight = torch.exp(m - m.max(dim=0, keepdim=True).values)  # [S, n, Hq]
    total = (weight * l).sum(dim=0)  # [n, Hq]
    merged = (weight.unsqueeze(-1) * part_acc).sum(dim=0) / total.unsqueeze(-1)  # [n, Hq, Dv]
    out.copy_(merged.to(out.dtype))
