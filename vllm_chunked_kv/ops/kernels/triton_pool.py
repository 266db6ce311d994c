"""Triton pooling of the chunks a step completes into the compressed pages (docs/design.md §3-4).

`write_chunks` has the signature and semantics of `compressed.write_chunks`:
one program pools ``BLOCK_C`` chunks of the step's `ChunkWrites`, each
gathering its ``chunk_size`` rows from the step's own K/V or the stored raw
pages, and stores the pooled row (and, with boundary retention, the chunk's
first and last raw rows) at its compressed slots (`core/layout.py`).

Every pooling mode is one code path: fixed gains (``mean``, ``gated``) come
from `shared.fixed_gains` as a small tensor, ``key_norm`` is a softmax of
the keys' L2 norms over the pooled slots; ``keep_boundary`` only narrows the
pooled slots to ``[1, chunk_size - 1)``.

FP8 pages (``FP8``, `triton_fp8`): the step's rows arrive as their stored
bytes, like the pages; every row is read as the pages hold it (``byte *
scale``: k_scale for keys, v_scale for values), pooled in fp32, and the
pooled row (and the boundary rows, which come back to their own bytes) is
quantised once, as `compressed.write_chunks` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels import shared, triton_fp8
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites

# A finite "minus infinity": masked slots get weight exp(-1e30 - max) == 0
# without the NaN that exp(-inf - -inf) gives on a fully masked row.
BOUNDARY_SLOTS = tl.constexpr(grid.BOUNDARY_SLOTS)  # slots per group with boundary retention
_NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _chunked_kv_slot_weights(
    keys,  # [BLOCK_C, CS_P2, D_P2] fp32, zeros where masked
    slot,  # [CS_P2] slot index within the chunk
    gains_ptr,  # [CHUNK_SIZE] fp32 normalised gains (unused for key_norm)
    CHUNK_SIZE: tl.constexpr,
    POOL_LO: tl.constexpr,
    POOL_HI: tl.constexpr,
    KEY_NORM: tl.constexpr,
):
    """Pooling weight of each slot: ``[BLOCK_C, CS_P2]`` for key_norm,
    ``[1, CS_P2]`` (broadcastable) for fixed gains; 0 on unpooled slots."""
    pooled = (slot >= POOL_LO) & (slot < POOL_HI)  # [CS_P2]
    if KEY_NORM:
        norms = tl.sqrt(tl.sum(keys * keys, axis=2))  # [BLOCK_C, CS_P2, D_P2] -> [BLOCK_C, CS_P2]
        norms = tl.where(pooled[None, :], norms, _NEG_BIG)
        e = tl.exp(norms - tl.max(norms, axis=1)[:, None])  # [BLOCK_C, CS_P2]
        weights = e / tl.sum(e, axis=1)[:, None]
    else:
        gains = tl.load(gains_ptr + slot, mask=pooled & (slot < CHUNK_SIZE), other=0.0)  # [CS_P2]
        weights = gains[None, :]  # [1, CS_P2]
    return weights


@triton.jit
def _chunked_kv_pool_rows(weights, rows):
    """Weighted sum over slots: weights ``[BLOCK_C | 1, CS_P2]``, rows
    ``[BLOCK_C, CS_P2, D]`` -> ``[BLOCK_C, D]``."""
    return tl.sum(weights[:, :, None] * rows, axis=1)


@triton.jit
def _chunked_kv_gather_chunk(step_ptr, raw_ptr, src_step, src_block, src_offset, ok, head, scale,
                             stride_st, stride_sh, stride_rb, stride_rh, stride_rs,
                             COL0: tl.constexpr, WIDTH: tl.constexpr, W_P2: tl.constexpr, FP8: tl.constexpr):
    """Columns ``[COL0, COL0 + WIDTH)`` of the rows of chunks ``[BLOCK_C,
    CS_P2]``: the step's own row where ``src_step >= 0``, else the stored raw
    row, rounded to the cache dtype (FP8: both bytes, times ``scale``) and
    returned as fp32 ``[BLOCK_C, CS_P2, W_P2]``."""
    col = tl.arange(0, W_P2)[None, None, :]
    col_ok = col < WIDTH
    own = ok & (src_step >= 0)  # [BLOCK_C, CS_P2]
    stored = ok & (src_step < 0)
    own_off = src_step.to(tl.int64) * stride_st + head[:, None].to(tl.int64) * stride_sh  # [BLOCK_C, CS_P2]
    raw_off = src_block.to(tl.int64) * stride_rb + head[:, None].to(tl.int64) * stride_rh + src_offset.to(tl.int64) * stride_rs
    own_rows = triton_fp8.load(step_ptr, own_off[:, :, None] + COL0 + col, own[:, :, None] & col_ok, FP8)
    raw_rows = triton_fp8.load(raw_ptr, raw_off[:, :, None] + COL0 + col, stored[:, :, None] & col_ok, FP8)
    if FP8 == 0:
        own_rows = own_rows.to(raw_ptr.dtype.element_ty).to(tl.float32)
    rows = tl.where(own[:, :, None], own_rows, raw_rows)
    if FP8 != 0:
        rows = rows * scale
    return rows


@triton.jit
def _chunked_kv_pick_slot(rows, pick):
    """The row of one slot per chunk: rows ``[BLOCK_C, CS_P2, W]``, pick ``[1, CS_P2, 1]`` (one
    slot) -> ``[BLOCK_C, W]``, bit for bit (a sum of its bits and zeros: -0.0 stays -0.0)."""
    return tl.sum(tl.where(pick, rows.to(tl.int32, bitcast=True), 0), axis=1).to(tl.float32, bitcast=True)


@triton.jit
def _chunked_kv_store_row(comp_ptr, dst_block, dst_offset, head, ok, key_row, value_row, k_scale, v_scale,
                          stride_cb, stride_ch, stride_cs, HEAD_D: tl.constexpr, D_P2: tl.constexpr,
                          HEAD_DV: tl.constexpr, DV_P2: tl.constexpr, FP8: tl.constexpr):
    """Store one row per chunk (keys ``[BLOCK_C, D_P2]``, values ``[BLOCK_C,
    DV_P2]``, fp32) at its compressed slot (block, offset) ``[BLOCK_C]``: in
    the cache dtype, or as FP8 bytes of the keys / k_scale, values / v_scale."""
    base = dst_block.to(tl.int64) * stride_cb + head.to(tl.int64) * stride_ch + dst_offset.to(tl.int64) * stride_cs
    d = tl.arange(0, D_P2)
    dv = tl.arange(0, DV_P2)
    triton_fp8.store(comp_ptr, base[:, None] + d[None, :], key_row, k_scale, ok[:, None] & (d < HEAD_D)[None, :], FP8)
    triton_fp8.store(comp_ptr, base[:, None] + HEAD_D + dv[None, :], value_row, v_scale,
                     ok[:, None] & (dv < HEAD_DV)[None, :], FP8)


@triton.jit
def _chunked_kv_write_chunks_kernel(
    step_ptr,  # [n, Hkv, HEAD_D + HEAD_DV] the step's K/V rows (FP8: their stored bytes)
    raw_ptr,  # [num_raw_blocks, Hkv, raw_block_size, HEAD_D + HEAD_DV]
    comp_ptr,  # [num_blocks, Hkv, states_per_block, HEAD_D + HEAD_DV]
    gains_ptr,  # [CHUNK_SIZE] fp32
    heads_ptr,  # [M]
    src_blocks_ptr, src_offsets_ptr, src_step_ptr,  # [M, CHUNK_SIZE] each, contiguous
    dst_blocks_ptr, dst_offsets_ptr,  # [M, SPG] each, contiguous
    num_chunks,
    k_scale, v_scale,  # FP8 pages' scales (unused otherwise)
    stride_st, stride_sh,
    stride_rb, stride_rh, stride_rs,
    stride_cb, stride_ch, stride_cs,
    CHUNK_SIZE: tl.constexpr, CS_P2: tl.constexpr,
    HEAD_D: tl.constexpr, D_P2: tl.constexpr, HEAD_DV: tl.constexpr, DV_P2: tl.constexpr,
    POOL_LO: tl.constexpr, POOL_HI: tl.constexpr, KEY_NORM: tl.constexpr,
    SPG: tl.constexpr, BLOCK_C: tl.constexpr, FP8: tl.constexpr,
):
    chunk = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C]
    slot = tl.arange(0, CS_P2)  # [CS_P2]
    chunk_ok = chunk < num_chunks
    ok = chunk_ok[:, None] & (slot < CHUNK_SIZE)[None, :]  # [BLOCK_C, CS_P2]
    src = chunk.to(tl.int64)[:, None] * CHUNK_SIZE + slot[None, :]  # [BLOCK_C, CS_P2]
    src_step = tl.load(src_step_ptr + src, mask=ok, other=-1)
    src_block = tl.load(src_blocks_ptr + src, mask=ok, other=0)
    src_offset = tl.load(src_offsets_ptr + src, mask=ok, other=0)
    head = tl.load(heads_ptr + chunk, mask=chunk_ok, other=0)  # [BLOCK_C]
    keys = _chunked_kv_gather_chunk(step_ptr, raw_ptr, src_step, src_block, src_offset, ok, head, k_scale, stride_st,
                                    stride_sh, stride_rb, stride_rh, stride_rs, 0, HEAD_D, D_P2,
                                    FP8)  # [BLOCK_C, CS_P2, D_P2]
    values = _chunked_kv_gather_chunk(step_ptr, raw_ptr, src_step, src_block, src_offset, ok, head, v_scale,
                                      stride_st, stride_sh, stride_rb, stride_rh, stride_rs, HEAD_D, HEAD_DV, DV_P2,
                                      FP8)  # [BLOCK_C, CS_P2, DV_P2]
    dst = chunk.to(tl.int64) * SPG  # [BLOCK_C] first slot of each chunk's group
    dst_block = tl.load(dst_blocks_ptr + dst, mask=chunk_ok, other=0)
    dst_offset = tl.load(dst_offsets_ptr + dst, mask=chunk_ok, other=0)
    weights = _chunked_kv_slot_weights(keys, slot, gains_ptr, CHUNK_SIZE, POOL_LO, POOL_HI, KEY_NORM)
    key_row = _chunked_kv_pool_rows(weights, keys)  # [BLOCK_C, D_P2]
    value_row = _chunked_kv_pool_rows(weights, values)  # [BLOCK_C, DV_P2]
    _chunked_kv_store_row(comp_ptr, dst_block, dst_offset, head, chunk_ok, key_row, value_row, k_scale, v_scale,
                          stride_cb, stride_ch, stride_cs, HEAD_D, D_P2, HEAD_DV, DV_P2, FP8)
    if SPG == BOUNDARY_SLOTS:  # boundary retention: the first and last raw rows follow the pooled row
        for edge in tl.static_range(2):
            pick = (slot == edge * (CHUNK_SIZE - 1))[None, :, None]  # [1, CS_P2, 1]
            e_block = tl.load(dst_blocks_ptr + dst + 1 + edge, mask=chunk_ok, other=0)
            e_offset = tl.load(dst_offsets_ptr + dst + 1 + edge, mask=chunk_ok, other=0)
            _chunked_kv_store_row(comp_ptr, e_block, e_offset, head, chunk_ok, _chunked_kv_pick_slot(keys, pick),
                                  _chunked_kv_pick_slot(values, pick), k_scale, v_scale,
                                  stride_cb, stride_ch, stride_cs, HEAD_D, D_P2, HEAD_DV, DV_P2, FP8)


# ------------------------------------------------------------------ host side


def pooling_constants(cfg: ChunkedKVConfig) -> dict:
    """The constexpr parameters that describe a config's pooling."""
    slots = cfg.pooled_slots
    return {
        "CHUNK_SIZE": cfg.chunk_size,
        "CS_P2": triton.next_power_of_2(cfg.chunk_size),
        "POOL_LO": slots.start,
        "POOL_HI": slots.stop,
        "KEY_NORM": cfg.pooling == "key_norm",
    }


def write_chunks(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: ChunkWrites,
                 cfg: ChunkedKVConfig, head_size: int, fmt: PageFormat | None = None, *,
                 block_chunks: int = 16) -> None:
    """`compressed.write_chunks` in one launch: pool the chunks completed in
    this step into their compressed slots (caches ``[num_blocks, Hkv, rows,
    Dk + Dv]``, last dim contiguous; step_rows ``[n, Hkv, Dk + Dv]``). With
    FP8 pages (`fmt`) the caches and step_rows (the step's stored bytes) are
    bytes (``uint8``)."""
    if fmt is not None:
        comp_cache, raw_cache, step_rows = (triton_fp8.page_bytes(t, name) for t, name in (
            (comp_cache, "comp_cache"), (raw_cache, "raw_cache"), (step_rows, "step_rows")))
    shared.zero_unused_slots(comp_cache, writes)
    num = writes.heads.numel()
    if not num:
        return
    for name, t in (("comp_cache", comp_cache), ("raw_cache", raw_cache), ("step_rows", step_rows)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have contiguous rows (last-dim stride 1)")
    head_dv = comp_cache.shape[-1] - head_size
    contiguous = lambda t: t.contiguous()  # noqa: E731  [M, chunk_size] / [M, spg] index tables
    _chunked_kv_write_chunks_kernel[(triton.cdiv(num, block_chunks),)](
        step_rows, raw_cache, comp_cache, shared.step_gains(writes, cfg, comp_cache.device), contiguous(writes.heads),
        contiguous(writes.src_blocks), contiguous(writes.src_offsets), contiguous(writes.src_step),
        contiguous(writes.dst_blocks), contiguous(writes.dst_offsets),
        num, *((1.0, 1.0) if fmt is None else (float(fmt.k_scale), float(fmt.v_scale))),
        step_rows.stride(0), step_rows.stride(1),
        raw_cache.stride(0), raw_cache.stride(1), raw_cache.stride(2),
        comp_cache.stride(0), comp_cache.stride(1), comp_cache.stride(2),
        HEAD_D=head_size, D_P2=triton.next_power_of_2(head_size),
        HEAD_DV=head_dv, DV_P2=triton.next_power_of_2(head_dv),
        SPG=grid.slots_per_group(cfg), BLOCK_C=block_chunks, FP8=triton_fp8.kind(fmt), **pooling_constants(cfg),
    )
