"""Dynamic boundaries: store each unit's chunk row, as `plans/dynamic_writes.py` planned it.

The write gathers the ``3 * chunk_size + 1`` rows of frames ``g - 1 .. g + 1``
and the next position from the raw pages and the step's own rows, cuts
those frames (`boundaries.frame_cuts`) and stores the mean of the chunk
covering the unit. Every implementation writes unit slots with this one
PyTorch function (`dispatch.with_unit_writes`).
"""

from __future__ import annotations

import torch

from vllm_chunked_kv.core import boundaries
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.fp8 import PageFormat
from vllm_chunked_kv.ops.kernels.shared import gather_rows, store_rows
from vllm_chunked_kv.ops.plans.dynamic_writes import DynamicWrites


def write(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: DynamicWrites,
          cfg: ChunkedKVConfig, head_size: int, fmt: PageFormat | None = None) -> None:
    """Store each unit's chunk row (fp32 mean, stored in the cache dtype or as FP8 bytes) in its slot."""
    if not writes.unit.numel():
        return
    size, unit = cfg.chunk_size, cfg.min_chunk
    heads = torch.arange(raw_cache.shape[1], device=raw_cache.device)  # [Hkv]
    rows = gather_rows(raw_cache, step_rows, writes.src_blocks[:, None], writes.src_offsets[:, None],
                       writes.src_step[:, None], heads[None, :, None], fmt)  # [M, Hkv, 3C + 1, Dk + Dv]
    keys, values = rows[..., :head_size], rows[..., head_size:]  # [M, Hkv, R, Dk], [M, Hkv, R, Dv]
    row0 = writes.row0  # [M]
    cut = [row0[:, None] + j * size + boundaries.frame_cuts(cfg, keys[:, :, j * size: (j + 1) * size + 1])
           for j in range(3)]  # cuts of frames g - 1, g, g + 1: [M, Hkv] each
    before = torch.where(row0[:, None] >= 0, cut[0], -1)  # no frame before the first
    start = (writes.unit * unit)[:, None]  # [M, 1]
    in_frame_chunk = start <= cut[1]
    first = torch.where(in_frame_chunk, before, cut[1]) + 1  # [M, Hkv]
    last = torch.where(in_frame_chunk, cut[1], cut[2])  # [M, Hkv]
    key_row, value_row = boundaries.pool_span(keys, values, first, last, row0[:, None].expand_as(first))
    comp_cache[writes.dst_blocks[:, None], heads[None, :], writes.dst_offsets[:, None]] = store_rows(
        torch.cat([key_row, value_row], dim=-1), comp_cache, fmt)  # [M, Hkv, Dk + Dv]
