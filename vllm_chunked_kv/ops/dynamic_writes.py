"""Dynamic boundaries in a step: write each unit's slot from the pages.

`core/boundaries.py` defines the chunks on a whole sequence; here the same rule
runs on what a step has. Unit ``m`` (tokens ``[m*u, (m+1)*u)``) is written in
the step that computes position ``m*u + lag`` (``lag`` = `layout.dynamic_lag_pages`
whole pages, at least ``2 * chunk_size`` tokens: by then its chunk is
decided), into slot ``m`` of the request's compressed pages counted from
page ``lag / block_size`` on (the key sets read the same shifted page table,
`step_plan.build_plan`). The write gathers the ``3 * chunk_size + 1`` rows
of frames ``g - 1 .. g + 1`` and the next position (``g``: the unit's
frame) from the raw pages and the step's own rows, cuts those frames
(`boundaries.frame_cuts`), and stores the mean of the chunk covering the
unit. Every implementation writes this way (PyTorch, a few rows per step);
the attention kernels read the unit slots as a fixed grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_chunked_kv.core import boundaries, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.rows import gather_rows


@dataclass
class DynamicWrites:
    """Unit slots written in one step: M units of the step's requests."""

    unit: torch.Tensor  # [M] unit index m of the request
    row0: torch.Tensor  # [M] position of source row 0: (g - 1) * C, negative for the first frame
    src_blocks: torch.Tensor  # [M, 3C + 1] raw page of each row from position (g - 1) * C (stored rows)
    src_offsets: torch.Tensor  # [M, 3C + 1]
    src_step: torch.Tensor  # [M, 3C + 1] token index of each row computed in this step, -1 if stored
    dst_blocks: torch.Tensor  # [M] compressed page of the unit's slot
    dst_offsets: torch.Tensor  # [M]


def span(cfg: ChunkedKVConfig) -> int:
    """Rows a unit write reads: frames g - 1, g, g + 1 and the next position."""
    return 3 * cfg.chunk_size + 1


def build(batch, cfg: ChunkedKVConfig, slot_table: torch.Tensor) -> DynamicWrites:
    """The units whose slot position ``m*u + lag`` this step computes.
    `batch` is a `step_plan.PagedBatch`; slot_table ``[num_reqs, pages]``
    its compressed page table from the lag on (slot ``m`` at page
    ``m // rows_per_page``)."""
    unit, size = cfg.min_chunk, cfg.chunk_size
    lag = layout.dynamic_lag_pages(cfg, batch.block_size) * batch.block_size
    device = batch.block_table.device
    long = dict(dtype=torch.long, device=device)
    reqs, units = [], []
    for r, seq_len in enumerate(batch.seq_lens):
        first = batch.first_position(r)
        lo = max(0, -(-(first - lag) // unit))
        hi = (seq_len - 1 - lag) // unit + 1
        reqs += [r] * max(0, hi - lo)
        units += range(lo, hi)
    req = torch.tensor(reqs, **long)  # [M]
    m = torch.tensor(units, **long)  # [M]
    frame_from = (m * unit // size - 1) * size  # [M] position of row 0: frame g - 1
    positions = (frame_from[:, None] + torch.arange(span(cfg), **long)).clamp(min=0)  # [M, 3C + 1]
    src_blocks, src_offsets, src_step = batch.row_sources(req, positions)  # [M, 3C + 1] each
    per_page = layout.states_per_block(cfg, batch.block_size)
    return DynamicWrites(
        unit=m,
        row0=frame_from,
        src_blocks=src_blocks,
        src_offsets=src_offsets,
        src_step=src_step,
        dst_blocks=slot_table[req, m // per_page].long(),
        dst_offsets=m % per_page,
    )


def write(comp_cache: torch.Tensor, raw_cache: torch.Tensor, step_rows: torch.Tensor, writes: DynamicWrites,
          cfg: ChunkedKVConfig, head_size: int) -> None:
    """Store each unit's chunk row (fp32 mean, stored in the cache dtype) in its slot."""
    if not writes.unit.numel():
        return
    size, unit = cfg.chunk_size, cfg.min_chunk
    heads = torch.arange(raw_cache.shape[1], device=raw_cache.device)  # [Hkv]
    rows = gather_rows(raw_cache, step_rows, writes.src_blocks[:, None], writes.src_offsets[:, None],
                       writes.src_step[:, None], heads[None, :, None])  # [M, Hkv, 3C + 1, Dk + Dv]
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
    comp_cache[writes.dst_blocks[:, None], heads[None, :], writes.dst_offsets[:, None]] = (
        torch.cat([key_row, value_row], dim=-1).to(comp_cache.dtype))  # [M, Hkv, Dk + Dv]
