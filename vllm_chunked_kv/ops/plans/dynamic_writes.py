"""Dynamic boundaries in a step: which unit slots it writes, from which rows.

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
unit (`kernels/unit_writes.py`: every implementation writes this way, in
PyTorch, a few rows per step); the attention kernels read the unit slots as
a fixed grid.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig


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
