"""The step plan of a uniform decode batch, built on the device with fixed shapes.

When every request of a step computes one token (vLLM's uniform decode,
what CUDA graphs capture), the plan of `step_plan.py` follows from the
sequence lengths and the two block tables by tensor arithmetic alone: no
host synchronisation and no Python loop per request, and every shape is a
function of the batch size, the block tables' widths and the config. Rows
that do not exist in a given step are padding, never read as data:

- raw rows: the kept leading rows, then the raw region before the token,
  packed first (``num_raw`` counts them), padded to ``forever_raw +
  raw_window`` columns;
- chunk writes: one entry per (request, KV head), since a token completes
  at most one chunk per head; entries that complete nothing write to vLLM's
  null page (`step_plan.NULL_PAGE`), which no plan reads;
- compressed slots: every slot the block table can address (``num_slots``
  says how many may be visible; kernels read no further), given as the
  block table itself (`KeySet.comp_rows_per_page`); for the PyTorch path,
  which gathers every column, one entry per slot, padding reading the
  request's slot 0, hidden by its bias.

`tests/ops/test_decode_plan.py` holds it to `step_plan.build_plan`.
"""

from __future__ import annotations

from dataclasses import fields, replace
from types import ModuleType

import torch

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans import constants
from vllm_chunked_kv.ops.plans.step_plan import (NULL_PAGE, ChunkWrites, KeySet, PagedBatch, StepPlan, build_plan,
                                           visibility_bias)


def build_decode_plan(seq_lens: torch.Tensor, block_table: torch.Tensor, block_size: int,
                      raw_block_table: torch.Tensor, raw_block_size: int, cfg: ChunkedKVConfig,
                      origins: list[int], *, bias: bool = True, grid_shifts: torch.Tensor | None = None,
                      native: ModuleType | None = None) -> StepPlan:
    """The plan of a step in which request ``r`` computes the one token at
    position ``seq_lens[r] - 1`` (token index ``r``). seq_lens ``[b]``,
    block tables ``[b, max_blocks]`` and ``[b, max_raw_blocks]``, and
    grid_shifts ``[b]`` (each request's `align` shift; None: all 0), all on
    the device. Padding requests (seq_len 0) read and write nothing. Not for
    dynamic boundaries, whose unit writes are planned on the host (`step_plan`).

    On CPU without `bias`, `native` (the loaded C++ extension,
    `kernels/cpu_ext.py`; None: the tensor ops) builds the same plan in one call."""
    if cfg.boundaries != "fixed":
        raise ValueError("boundaries 'dynamic' decode steps are planned in Python (step_plan.build_plan)")
    head_o = constants.ints(tuple(origins), seq_lens.device)  # [Hkv]
    if grid_shifts is None:
        o = head_o[None, :].expand(seq_lens.shape[0], -1)  # [b, Hkv]
    else:
        o = grid.shifted(cfg, head_o[None, :], grid_shifts.long()[:, None])  # [b, Hkv]
    host_origins = grid.possible_origins(cfg, origins)  # every origin a request may have (host ints)
    per_block = layout.states_per_block(cfg, block_size)
    if native is not None and not bias and seq_lens.device.type == "cpu":
        return _native_plan(native, cfg, o, host_origins, seq_lens, block_table, per_block, raw_block_table,
                            raw_block_size)
    t = seq_lens.long() - 1  # [b] the token's position (-1: padding request)
    tables = (block_table.long(), per_block, raw_block_table.long(), raw_block_size)
    return StepPlan(cfg=cfg, raw_writes=constants.arange(t.shape[0], seq_lens.device),
                    writes=_chunk_writes(cfg, o, host_origins, t, *tables),
                    key_sets=[_key_set(cfg, o, host_origins, t, *tables, bias)])


def _chunk_writes(cfg: ChunkedKVConfig, o: torch.Tensor, origins: list[int], t: torch.Tensor,
                  block_table: torch.Tensor, per_block: int, raw_block_table: torch.Tensor,
                  raw_block_size: int) -> ChunkWrites:
    b, hkv, spg = t.shape[0], o.shape[1], grid.slots_per_group(cfg)
    p = t[:, None].expand(b, hkv)  # [b, Hkv] the step's one position
    rel = p - grid.chunk_last(cfg, 0, o)  # [b, Hkv] = k * hop when the token ends chunk k
    done = (rel >= 0) & (rel % cfg.hop == 0)  # [b, Hkv] a chunk completes
    k = torch.where(done, rel // cfg.hop, 0)  # [b, Hkv]
    req = constants.arange(b, t.device)[:, None].expand(b, hkv)  # [b, Hkv]
    positions = grid.chunk_start(cfg, k, o)[..., None] + constants.arange(cfg.chunk_size, t.device)  # [b, Hkv, cs]
    positions = torch.where(done[..., None], positions, 0)
    src_blocks = raw_block_table[req[..., None], positions // raw_block_size]  # [b, Hkv, cs]
    src_step = torch.where(positions == p[..., None], req[..., None], -1)  # [b, Hkv, cs] own row, else stored
    slots = ((k + grid.first_group(cfg, o)) * spg)[..., None] + constants.arange(spg, t.device)  # [b, Hkv, spg]
    last_page = block_table.shape[1] - 1  # empty entries may point past the table: gather in range
    dst_blocks = torch.where(done[..., None], block_table[req[..., None], (slots // per_block).clamp(max=last_page)],
                             NULL_PAGE)
    # Slots below a head's first group are zeroed when its chunk 0 completes.
    width = _zero_width(cfg, origins)  # from the host's origins
    zs = constants.arange(width, t.device)  # [Z0]
    zero = (done & (k == 0))[..., None] & (zs < grid.first_group(cfg, o)[..., None] * spg)  # [b, Hkv, Z0]
    zero_blocks = torch.where(zero, block_table[req[..., None], (zs // per_block).clamp(max=last_page)],
                              NULL_PAGE)  # [b, Hkv, Z0]
    heads = constants.arange(hkv, t.device)
    return ChunkWrites(
        heads=heads.expand(b, hkv).reshape(-1),  # [M = b * Hkv]
        src_blocks=src_blocks.reshape(-1, cfg.chunk_size),  # [M, cs]
        src_offsets=(positions % raw_block_size).reshape(-1, cfg.chunk_size),
        src_step=src_step.reshape(-1, cfg.chunk_size),
        dst_blocks=dst_blocks.reshape(-1, spg),  # [M, spg]
        dst_offsets=(slots % per_block).reshape(-1, spg),
        zero_heads=heads[:, None].expand(b, hkv, width).reshape(-1),  # [b * Hkv * Z0]
        zero_blocks=zero_blocks.reshape(-1),
        zero_offsets=(zs % per_block).expand(b, hkv, width).reshape(-1),
    )


def _key_set(cfg: ChunkedKVConfig, o: torch.Tensor, origins: list[int], t: torch.Tensor, block_table: torch.Tensor,
             per_block: int, raw_block_table: torch.Tensor, raw_block_size: int, with_bias: bool) -> KeySet:
    long = dict(dtype=torch.long, device=t.device)
    b = t.shape[0]
    req = constants.arange(b, t.device)[:, None]  # [b, 1]
    first = t.clamp(min=0)  # [b] the stored rows lie before the token
    keep = o.amax(dim=1).clamp(min=cfg.sink_tokens)  # [b] kept leading rows (`grid.forever_raw`)
    window_from = grid.raw_from(cfg, first[:, None], o).amin(dim=1)  # [b] over the heads' grids
    leading = torch.minimum(first, keep)  # [b]
    start = torch.minimum(torch.maximum(window_from, keep), first)  # [b] first stored row of the raw region
    num_raw = leading + (first - start)  # [b]
    i = constants.arange(_raw_columns(cfg, origins), t.device)[None, :]  # [1, Nr] bounds num_raw
    raw_t = torch.where(i < leading[:, None], i, start[:, None] + i - leading[:, None])  # [b, Nr]
    raw_valid = i < num_raw[:, None]  # [b, Nr] valid rows first, padding after
    raw_t = torch.where(raw_valid, raw_t, 0)
    to = t[:, None]  # [b, 1]
    visible = torch.where(grid.num_sealed(cfg, to, o) > 0, grid.visible_slots(cfg, to, o), 0)  # [b, Hkv]
    num_slots = visible.amax(dim=1)  # [b] slots that may be visible
    width = block_table.shape[1]
    positions = first[:, None]  # [b, 1]
    bias = None
    if with_bias:  # the PyTorch path gathers every column: padding reads the request's slot 0, hidden by the bias
        slot_t = torch.arange(width * per_block, **long)[None, :].expand(b, -1)  # [b, Nc] all addressable
        slot_valid = slot_t < num_slots[:, None]
        slot_t = slot_t.masked_fill(~slot_valid, 0)
        comp_blocks, comp_offsets = block_table[req, slot_t // per_block], slot_t % per_block
        bias = visibility_bias(cfg, o, positions, raw_t, raw_valid, slot_t, slot_valid)
    else:  # kernels read slots below num_slots only: the page tables as they are (KeySet.slot_tables)
        comp_blocks, comp_offsets = block_table, None  # [b, width]
    return KeySet(
        query_index=req,
        query_positions=positions,
        raw_blocks=raw_block_table[req, raw_t // raw_block_size],
        raw_offsets=raw_t % raw_block_size,
        raw_positions=raw_t,
        num_raw=num_raw,
        comp_blocks=comp_blocks,
        comp_offsets=comp_offsets,
        num_slots=num_slots,
        origins=o,
        bias=bias,
        comp_rows_per_page=0 if with_bias else per_block,
    )



def build_mixed_plan(batch: PagedBatch, num_decodes: int, cfg: ChunkedKVConfig, origins: list[int], *,
                     bias: bool = True, native: ModuleType | None = None) -> StepPlan:
    """The plan of a step whose first `num_decodes` requests each compute one
    token (their token indices are then their request indices; vLLM puts
    decodes first when a backend asks, `reorder_batch_threshold`) and whose
    other requests are prefill pieces: the decodes planned as a uniform
    batch (`build_decode_plan`, one C++ call on CPU), the rest by
    `step_plan.build_plan`, joined (`native` as for `build_decode_plan`).
    Fixed boundaries; host block tables."""
    d = num_decodes
    if not 0 < d < len(batch.seq_lens) or batch.query_start[d] != d:
        raise ValueError(f"{d} leading decodes do not fit query_start {batch.query_start[:d + 1]}")
    shifts = batch.grid_shifts
    decodes = build_decode_plan(torch.tensor(batch.seq_lens[:d]), batch.block_table[:d], batch.block_size,
                                batch.raw_block_table[:d], batch.raw_block_size, cfg, origins, bias=bias,
                                grid_shifts=None if shifts is None else torch.tensor(shifts[:d]), native=native)
    rest = build_plan(replace(batch, query_start=batch.query_start[d:], seq_lens=batch.seq_lens[d:],
                              block_table=batch.block_table[d:], raw_block_table=batch.raw_block_table[d:],
                              grid_shifts=None if shifts is None else shifts[d:]), cfg, origins, bias=bias)
    names = [f.name for f in fields(ChunkWrites) if f.name not in ("dynamic", "memo")]
    writes = ChunkWrites(**{n: torch.cat([getattr(decodes.writes, n), getattr(rest.writes, n)]) for n in names})
    return StepPlan(cfg=cfg, raw_writes=torch.cat([decodes.raw_writes, rest.raw_writes]), writes=writes,
                    key_sets=decodes.key_sets + rest.key_sets)


def _raw_columns(cfg: ChunkedKVConfig, origins: list[int]) -> int:
    """Nr: stored raw rows a request may read, over every possible origin (kept leading rows + raw window)."""
    return grid.forever_raw(cfg, origins) + layout.raw_window(cfg)


def _zero_width(cfg: ChunkedKVConfig, origins: list[int]) -> int:
    """Z0: the most slots below a head's first group, over every possible origin."""
    return max((grid.first_group(cfg, x) * grid.slots_per_group(cfg) for x in origins), default=0)


def _native_plan(module, cfg: ChunkedKVConfig, o: torch.Tensor, origins: list[int], seq_lens: torch.Tensor,
                 block_table: torch.Tensor, per_block: int, raw_block_table: torch.Tensor,
                 raw_block_size: int) -> StepPlan:
    """`build_decode_plan` (no bias) in one call of the C++ extension."""
    (heads, src_blocks, src_offsets, src_step, dst_blocks, dst_offsets, zero_heads, zero_blocks, zero_offsets,
     positions, raw_blocks, raw_offsets, raw_positions, num_raw, comp_blocks, num_slots) = module.decode_plan(
        seq_lens, block_table, per_block, raw_block_table, raw_block_size, o, cfg.chunk_size, cfg.hop, cfg.window,
        cfg.sink_tokens, grid.slots_per_group(cfg), _raw_columns(cfg, origins), _zero_width(cfg, origins))
    b = seq_lens.shape[0]
    writes = ChunkWrites(heads=heads, src_blocks=src_blocks, src_offsets=src_offsets, src_step=src_step,
                         dst_blocks=dst_blocks, dst_offsets=dst_offsets, zero_heads=zero_heads,
                         zero_blocks=zero_blocks, zero_offsets=zero_offsets)
    keys = KeySet(query_index=constants.arange(b, seq_lens.device)[:, None], query_positions=positions,
                  raw_blocks=raw_blocks, raw_offsets=raw_offsets, raw_positions=raw_positions, num_raw=num_raw, comp_blocks=comp_blocks,
                  comp_offsets=None, num_slots=num_slots, origins=o, bias=None, comp_rows_per_page=per_block)
    return StepPlan(cfg=cfg, raw_writes=constants.arange(b, seq_lens.device), writes=writes, key_sets=[keys])
