"""The K/V rows a write reads: stored in the raw pages, or computed in this step.

A chunk (or a dynamic-boundary unit) completed in a step can span tokens
stored by earlier steps and tokens of the step itself, whose rows are in
`step_rows` and, for tokens the cache does not keep, nowhere else. The plan
names every row's raw page and offset and its token index in the step
(-1 when stored before it: `step_plan.PagedBatch.row_sources`); this gather
takes each row from the right place.
"""

from __future__ import annotations

import torch


def gather_rows(raw_cache: torch.Tensor, step_rows: torch.Tensor, blocks: torch.Tensor, offsets: torch.Tensor,
                src_step: torch.Tensor, heads: torch.Tensor) -> torch.Tensor:
    """Rows at (`blocks`, `heads`, `offsets`) of raw_cache ``[pages, Hkv, block, Dk + Dv]``, or row
    ``src_step`` of step_rows ``[n, Hkv, Dk + Dv]`` where ``src_step >= 0``. The four index tensors
    broadcast to one shape S; the result is ``S + [Dk + Dv]`` in the cache dtype."""
    stored = raw_cache[blocks, heads, offsets]  # S + [Dk + Dv]
    own = step_rows[src_step.clamp(min=0), heads]  # S + [Dk + Dv]
    return torch.where((src_step >= 0)[..., None], own.to(stored.dtype), stored)
