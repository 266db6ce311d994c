"""Triton paged chunked attention (DESIGN.md §3-4, §10): `attend` computes
what `paged.attend` computes, reading the paged cache through the block table.

One program handles up to ``BLOCK_M`` consecutive query tokens of one request
on one KV head, i.e. ``BLOCK_M * GROUP`` query rows (GQA), and keeps one
online softmax per row over three disjoint sources:

1. the raw prefix ``[0, max(sink_tokens, origin))`` (sinks and positions
   before the head's grid origin);
2. the chunks ``c_first .. K-1`` sealed for some row: each is pooled on the fly
   from its stored raw rows (`triton_pool` helpers, so both kernels pool
   alike) and enters with logit bias ``log_weight``; with keep_boundary its
   first and last rows enter raw as well;
3. the raw tail ``[raw_from, t]`` after the last sealed chunk.

Per row, a mask keeps exactly the visible set of that row's position (the
rows of one program have different positions, so different seals). The seal
rule lives in `_chunked_kv_seal` only; a change of layout (pooled rows stored
in their own pages) replaces the loading in step 2 and nothing else.

Long contexts can be split across ``NUM_SPLITS`` programs per (tile, head):
each takes every NUM_SPLITS-th block of every source and writes a partial
softmax (max, sum, weighted values) that `_combine` merges.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops.paged import PagedBatch
from vllm_chunked_kv.ops.triton_pool import (
    _chunked_kv_pool_rows,
    _chunked_kv_slot_weights,
    gains_tensor,
    pooling_constants,
)

INTERPRETED = bool(triton.knobs.runtime.interpret)

_NEG_BIG = tl.constexpr(-1.0e30)  # finite start of the running max (see _chunked_kv_online_update)
_NO_SEAL_WINDOW = 1 << 30  # a window no position reaches: exact causal attention


@triton.jit
def _chunked_kv_seal(t, window, origin, CHUNK_SIZE: tl.constexpr, HOP: tl.constexpr):
    """For query position(s) ``t``: (number of sealed chunks, first position of
    the raw tail) on a grid starting at ``origin`` (DESIGN.md §3, §10)."""
    slack = t - window - (origin + CHUNK_SIZE - 1)
    sealed = tl.where(slack >= 0, tl.maximum(slack, 0) // HOP + 1, 0)
    raw_from = tl.where(sealed > 0, origin + (sealed - 1) * HOP + CHUNK_SIZE, origin)
    return sealed, raw_from


@triton.jit
def _chunked_kv_mm(a, b, USE_DOT: tl.constexpr):
    """``a [M, K] @ b [K, N]`` in fp32 (tensor cores need every dim >= 16)."""
    if USE_DOT:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.sum(a[:, :, None] * b[None, :, :], axis=1)


@triton.jit
def _chunked_kv_online_update(m_i, l_i, acc, logits, visible, values, USE_DOT: tl.constexpr):
    """Fold a block of scores ``[ROWS, N]`` with its values ``[N, DV_P2]`` into
    the running softmax. ``m_i`` starts finite, so hidden scores (-inf) give
    exactly 0 even before a row has seen anything."""
    logits = tl.where(visible, logits, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, axis=1))  # [ROWS]
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(logits - m_new[:, None])  # [ROWS, N]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _chunked_kv_mm(p, values, USE_DOT)  # [ROWS, DV_P2]
    return m_new, l_i, acc


@triton.jit
def _chunked_kv_load_rows(kv_ptr, block_table_row, pos, ok, head, block_size, stride_kb, stride_kh, stride_ks,
                          COL0: tl.constexpr, WIDTH: tl.constexpr, W_P2: tl.constexpr):
    """Stored rows at positions ``pos`` (any shape S) of one request and KV
    head, columns ``[COL0, COL0 + WIDTH)``, as fp32 ``[*S, W_P2]`` (0 where masked)."""
    page = tl.load(block_table_row + pos // block_size, mask=ok, other=0).to(tl.int64)
    offset = page * stride_kb + head * stride_kh + (pos % block_size).to(tl.int64) * stride_ks
    col = tl.arange(0, W_P2)
    ptrs = kv_ptr + tl.expand_dims(offset, -1) + COL0 + col
    mask = tl.expand_dims(ok, -1) & (col < WIDTH)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _chunked_kv_attention_kernel(
    q_ptr, kv_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    block_table_ptr, work_req_ptr, work_first_ptr, query_start_ptr, seq_lens_ptr, origins_ptr, gains_ptr,
    scale, log_weight, window, sink_tokens, block_size, num_tokens,
    stride_qt, stride_qh, stride_kb, stride_kh, stride_ks, stride_bt, stride_ot, stride_oh,
    NUM_Q_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr,
    HEAD_D: tl.constexpr, D_P2: tl.constexpr, HEAD_DV: tl.constexpr, DV_P2: tl.constexpr,
    CHUNK_SIZE: tl.constexpr, CS_P2: tl.constexpr, HOP: tl.constexpr,
    POOL_LO: tl.constexpr, POOL_HI: tl.constexpr, KEY_NORM: tl.constexpr, KEEP_BOUNDARY: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
):
    work, head, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    req = tl.load(work_req_ptr + work)
    first = tl.load(work_first_ptr + work)  # index of this tile's first query within its request
    q_begin = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    count = tl.minimum(q_len - first, BLOCK_M)
    t_lo = seq_len - q_len + first  # position of the tile's first query
    t_hi = t_lo + count - 1
    origin = tl.load(origins_ptr + head)
    block_table_row = block_table_ptr + req.to(tl.int64) * stride_bt

    # Query rows: row r is query token r // GROUP_P2, query head head * GROUP + r % GROUP_P2.
    r = tl.arange(0, ROWS)
    m_idx = r // GROUP_P2
    g = r % GROUP_P2
    row_ok = (m_idx < count) & (m_idx < BLOCK_M) & (g < GROUP)
    token = (q_begin + first + m_idx).to(tl.int64)  # [ROWS]
    q_head = head * GROUP + g
    d = tl.arange(0, D_P2)
    q_ptrs = q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (d < HEAD_D)[None, :], other=0.0).to(tl.float32) * scale  # [ROWS, D_P2]
    t = t_lo + m_idx  # [ROWS] query positions
    sealed, raw_from = _chunked_kv_seal(t, window, origin, CHUNK_SIZE, HOP)  # [ROWS], [ROWS]
    sealed_hi, _ = _chunked_kv_seal(t_hi, window, origin, CHUNK_SIZE, HOP)
    _, raw_lo = _chunked_kv_seal(t_lo, window, origin, CHUNK_SIZE, HOP)
    prefix_end = tl.maximum(sink_tokens, origin)  # raw for every row: sinks, positions before the origin
    below_sinks = sink_tokens - origin - CHUNK_SIZE  # chunks with end <= sink_tokens get no row
    c_first = tl.where(below_sinks >= 0, tl.maximum(below_sinks, 0) // HOP + 1, 0)

    m_i = tl.zeros([ROWS], dtype=tl.float32) + _NEG_BIG
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, DV_P2], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # 1. raw prefix [0, pre_end): disjoint from the tail, which starts at raw_lo
    pre_end = tl.minimum(prefix_end, raw_lo)
    for i in range(split, tl.cdiv(pre_end, BLOCK_N), NUM_SPLITS):
        j = i * BLOCK_N + n  # [BLOCK_N]
        ok = j < pre_end
        keys = _chunked_kv_load_rows(kv_ptr, block_table_row, j, ok, head, block_size, stride_kb, stride_kh, stride_ks, 0, HEAD_D, D_P2)
        vals = _chunked_kv_load_rows(kv_ptr, block_table_row, j, ok, head, block_size, stride_kb, stride_kh, stride_ks, HEAD_D, HEAD_DV, DV_P2)
        visible = ok[None, :] & (j[None, :] <= t[:, None])  # [ROWS, BLOCK_N]
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, _chunked_kv_mm(q, tl.trans(keys), USE_DOT), visible, vals, USE_DOT)

    # 2. sealed chunks c_first .. sealed_hi - 1, pooled on the fly
    slot = tl.arange(0, CS_P2)
    cb = tl.arange(0, BLOCK_C)
    for i in range(split, tl.cdiv(tl.maximum(sealed_hi - c_first, 0), BLOCK_C), NUM_SPLITS):
        c = c_first + i * BLOCK_C + cb  # [BLOCK_C] chunk index
        c_ok = c < sealed_hi
        start = origin + c * HOP  # [BLOCK_C] first position of each chunk
        pos = start[:, None] + slot[None, :]  # [BLOCK_C, CS_P2]
        ok = c_ok[:, None] & (slot < CHUNK_SIZE)[None, :]
        keys = _chunked_kv_load_rows(kv_ptr, block_table_row, pos, ok, head, block_size, stride_kb, stride_kh, stride_ks, 0, HEAD_D, D_P2)
        vals = _chunked_kv_load_rows(kv_ptr, block_table_row, pos, ok, head, block_size, stride_kb, stride_kh, stride_ks, HEAD_D, HEAD_DV, DV_P2)
        weights = _chunked_kv_slot_weights(keys, slot, gains_ptr, CHUNK_SIZE, POOL_LO, POOL_HI, KEY_NORM)
        key_rows = _chunked_kv_pool_rows(weights, keys)  # [BLOCK_C, D_P2]
        val_rows = _chunked_kv_pool_rows(weights, vals)  # [BLOCK_C, DV_P2]
        sealed_for_row = c_ok[None, :] & (c[None, :] < sealed[:, None])  # [ROWS, BLOCK_C]
        logits = _chunked_kv_mm(q, tl.trans(key_rows), USE_DOT) + log_weight
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, logits, sealed_for_row, val_rows, USE_DOT)
        if KEEP_BOUNDARY:  # first and last token of a sealed chunk stay raw (hop == chunk_size)
            for edge in tl.static_range(2):
                b_pos = start + edge * (CHUNK_SIZE - 1)  # [BLOCK_C]
                b_keys = _chunked_kv_load_rows(kv_ptr, block_table_row, b_pos, c_ok, head, block_size, stride_kb, stride_kh, stride_ks, 0, HEAD_D, D_P2)
                b_vals = _chunked_kv_load_rows(kv_ptr, block_table_row, b_pos, c_ok, head, block_size, stride_kb, stride_kh, stride_ks, HEAD_D, HEAD_DV, DV_P2)
                b_visible = sealed_for_row & (b_pos >= prefix_end)[None, :]  # the prefix counted them already
                m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, _chunked_kv_mm(q, tl.trans(b_keys), USE_DOT), b_visible, b_vals, USE_DOT)

    # 3. raw tail [raw_lo, t_hi]; a row sees j >= its own raw_from (or j in the prefix)
    for i in range(split, tl.cdiv(t_hi + 1 - raw_lo, BLOCK_N), NUM_SPLITS):
        j = raw_lo + i * BLOCK_N + n
        ok = j <= t_hi
        keys = _chunked_kv_load_rows(kv_ptr, block_table_row, j, ok, head, block_size, stride_kb, stride_kh, stride_ks, 0, HEAD_D, D_P2)
        vals = _chunked_kv_load_rows(kv_ptr, block_table_row, j, ok, head, block_size, stride_kb, stride_kh, stride_ks, HEAD_D, HEAD_DV, DV_P2)
        raw = (j[None, :] >= raw_from[:, None]) | (j[None, :] < prefix_end)
        visible = ok[None, :] & (j[None, :] <= t[:, None]) & raw  # [ROWS, BLOCK_N]
        m_i, l_i, acc = _chunked_kv_online_update(m_i, l_i, acc, _chunked_kv_mm(q, tl.trans(keys), USE_DOT), visible, vals, USE_DOT)

    dv = tl.arange(0, DV_P2)
    store_ok = row_ok[:, None] & (dv < HEAD_DV)[None, :]
    if NUM_SPLITS == 1:
        out_ptrs = out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + dv[None, :]
        tl.store(out_ptrs, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=store_ok)
    else:  # partials [NUM_SPLITS, num_tokens, NUM_Q_HEADS, HEAD_DV] and [2, NUM_SPLITS, num_tokens, NUM_Q_HEADS]
        flat = (split * num_tokens + token) * NUM_Q_HEADS + q_head  # [ROWS]
        tl.store(part_acc_ptr + flat[:, None] * HEAD_DV + dv[None, :], acc, mask=store_ok)
        tl.store(part_ml_ptr + flat, m_i, mask=row_ok)
        tl.store(part_ml_ptr + NUM_SPLITS * num_tokens * NUM_Q_HEADS + flat, l_i, mask=row_ok)


# ------------------------------------------------------------------ host side


def _work_list(batch: PagedBatch, reqs: list[int], block_m: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, first query index) of every tile of ``block_m`` query tokens."""
    pairs = [
        (r, first)
        for r in reqs
        for first in range(0, batch.query_start[r + 1] - batch.query_start[r], block_m)
    ]
    table = torch.tensor(pairs, dtype=torch.int32).view(-1, 2).to(device)  # [W, 2]
    return table[:, 0].contiguous(), table[:, 1].contiguous()


def default_splits(num_tiles: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Programs per (tile, head): enough to fill the device when few tiles
    cover a long context, never more than one per 1024 positions."""
    if device.type != "cuda" or num_tiles == 0:
        return 1
    programs = num_tiles * num_kv_heads
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(target, programs), triton.cdiv(max_seq_len, 1024), 32))


def launch_constants(cfg: ChunkedKVConfig, *, num_heads: int, num_kv_heads: int, head_d: int, head_dv: int,
                     tile_m: int, splits: int, on_gpu: bool = True) -> dict:
    """The constexpr parameters (and num_warps) of one attention launch."""
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    rows = max(16 if on_gpu else 1, triton.next_power_of_2(tile_m * group_p2))  # tl.dot on a GPU wants >= 16 rows
    return dict(
        NUM_Q_HEADS=num_heads, GROUP=group, GROUP_P2=group_p2, BLOCK_M=tile_m, ROWS=rows,
        HEAD_D=head_d, D_P2=triton.next_power_of_2(head_d), HEAD_DV=head_dv, DV_P2=triton.next_power_of_2(head_dv),
        HOP=cfg.hop, KEEP_BOUNDARY=bool(cfg.keep_boundary),
        BLOCK_N=16 if INTERPRETED else 64, BLOCK_C=16, NUM_SPLITS=splits,
        USE_DOT=rows >= 16 and head_d >= 16 and head_dv >= 16,
        num_warps=4 if rows <= 32 else 8,
        **pooling_constants(cfg),
    )


def attend(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    batch: PagedBatch,
    scale: float,
    cfg: ChunkedKVConfig | None = None,
    origins: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_m: int | None = None,
) -> torch.Tensor:
    """Attention of every query token over its request's stored rows, as
    `paged.attend`: query ``[n, Hq, D]``, kv_cache ``[num_blocks, Hkv,
    block_size, D + Dv]`` -> ``[n, Hq, Dv]`` in the query dtype (fp32 math).
    Without ``cfg``: exact causal attention. ``origins``: grid origin of each
    KV head (None: all 0). ``out``: where to write (every element of the
    batch's query tokens is written). ``num_splits``: programs per tile and
    head (None: enough to fill the device). ``block_m``: query tokens per
    prefill tile (None: 64 query rows per tile)."""
    n, num_heads, head_d = query.shape
    num_kv_heads, head_dv = kv_cache.shape[1], kv_cache.shape[-1] - head_d
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if out is None:
        out = query.new_empty(n, num_heads, head_dv)
    if n == 0:
        return out
    device = query.device
    if cfg is None:
        cfg = ChunkedKVConfig(chunk_size=1, window=_NO_SEAL_WINDOW)
        origins = None
    if origins is None:
        origins = torch.zeros(num_kv_heads, dtype=torch.int32, device=device)
    group = num_heads // num_kv_heads
    group_p2 = triton.next_power_of_2(group)
    block_m = block_m or max(1, 64 // group_p2)
    q_lens = [b - a for a, b in zip(batch.query_start[:-1], batch.query_start[1:])]
    # Decode tokens get tiles of one token, prefill pieces tiles of block_m.
    launches = [
        (1, [r for r, q in enumerate(q_lens) if q == 1]),
        (block_m, [r for r, q in enumerate(q_lens) if q > 1]),
    ]
    tiles = {tile_m: _work_list(batch, reqs, tile_m, device) for tile_m, reqs in launches if reqs}
    splits = num_splits or default_splits(
        sum(len(w[0]) for w in tiles.values()), num_kv_heads, max(batch.seq_lens), device
    )
    part_acc = part_ml = out  # unused placeholders when there is one split
    if splits > 1:
        part_acc = torch.empty(splits, n, num_heads, head_dv, dtype=torch.float32, device=device)
        part_ml = torch.empty(2, splits, n, num_heads, dtype=torch.float32, device=device)
    common = dict(
        query_start=torch.tensor(batch.query_start, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int32, device=device),
        origins=origins.to(device=device, dtype=torch.int32).contiguous(),
        gains=gains_tensor(cfg, device),
    )
    for tile_m, (work_req, work_first) in tiles.items():
        consts = launch_constants(cfg, num_heads=num_heads, num_kv_heads=num_kv_heads, head_d=head_d, head_dv=head_dv,
                                  tile_m=tile_m, splits=splits, on_gpu=device.type != "cpu")
        _chunked_kv_attention_kernel[(len(work_req), num_kv_heads, splits)](
            query, kv_cache, out, part_acc, part_ml,
            batch.block_table, work_req, work_first, common["query_start"], common["seq_lens"],
            common["origins"], common["gains"],
            float(scale), cfg.log_weight, cfg.window, cfg.sink_tokens, kv_cache.shape[2], n,
            query.stride(0), query.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
            batch.block_table.stride(0), out.stride(0), out.stride(1),
            **consts,
        )
    if splits > 1:
        _combine(part_acc, part_ml, out)
    return out


def _combine(part_acc: torch.Tensor, part_ml: torch.Tensor, out: torch.Tensor) -> None:
    """Merge split partials: acc ``[S, n, Hq, Dv]``, (max, sum) ``[2, S, n, Hq]``."""
    m, l = part_ml[0], part_ml[1]  # [S, n, Hq] each
    weight = torch.exp(m - m.max(dim=0, keepdim=True).values)  # [S, n, Hq]
    total = (weight * l).sum(dim=0)  # [n, Hq]
    merged = (weight.unsqueeze(-1) * part_acc).sum(dim=0) / total.unsqueeze(-1)  # [n, Hq, Dv]
    out.copy_(merged.to(out.dtype))
