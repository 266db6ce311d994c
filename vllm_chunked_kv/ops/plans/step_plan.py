"""One forward step's index plan over the compressed and raw pages.

Built once per step (and per set of grid origins) from vLLM's metadata of
both cache groups, then reused by every layer:

- `raw_writes`: the step's tokens whose raw page exists (the others map to
  vLLM's null page: rows leaving the window within their step and not
  kept for prefix caching are never stored, `raw_window.py`);
- `ChunkWrites`: the chunks whose last token this step computes, with the
  rows they pool from (stored raw rows before the step, the step's own K/V
  after) and the compressed slots they are written to (`core/layout.py`);
- `KeySet`s: for a set of query tokens, which stored raw rows, which of the
  step's own rows and which compressed slots to attend to, and the additive
  bias (``-inf`` hidden, ``0`` raw, ``log_weight`` on pooled rows) that turns
  plain attention over them into docs/design.md §3 attention. All single-token
  (decode) requests share one padded `KeySet`; every multi-token request
  gets its own.

With dynamic boundaries the plan is that of the storage grid of units
(`ChunkedKVConfig.storage_grid`) over the page table from the slot lag on
(`layout.dynamic_lag_pages`); its `ChunkWrites` carry the unit writes
(`dynamic_writes.py`) instead of grid chunks.

Python loops here run per request (or per request and KV head) on
metadata, never per token or per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from vllm_chunked_kv.core import grid, layout
from vllm_chunked_kv.core.grid import SlotKind
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans import dynamic_writes
from vllm_chunked_kv.ops.plans.dynamic_writes import DynamicWrites

NULL_PAGE = 0  # vLLM's null block: the first block of its pool, what never-stored pages map to


@dataclass
class PagedBatch:
    """Where each request of a step lives: its query tokens and both page tables."""

    query_start: list[int]  # [num_reqs + 1] first query token of each request
    seq_lens: list[int]  # [num_reqs] positions computed after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] compressed pages
    block_size: int  # tokens per compressed page
    raw_block_table: torch.Tensor  # [num_reqs, max_raw_blocks] raw pages
    raw_block_size: int  # tokens per raw page; entries NULL_PAGE were never stored
    grid_shifts: list[int] | None = None  # [num_reqs] each request's grid shift (`align`); None: all 0

    def first_position(self, r: int) -> int:
        """Position of request r's first token in this step."""
        return self.seq_lens[r] - (self.query_start[r + 1] - self.query_start[r])

    def request_origins(self, cfg: ChunkedKVConfig, origins: list[int]) -> list[list[int]]:
        """Grid origin of each KV head of each request: `origins` shifted by the
        request's grid shift (`grid.shifted`)."""
        shifts = self.grid_shifts or [0] * len(self.seq_lens)
        return [[grid.shifted(cfg, o, shift) for o in origins] for shift in shifts]

    def row_sources(self, req: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Where the rows at `positions` ``[M, R]`` of requests `req` ``[M]`` are: raw page and
        offset (``[M, R]`` each), and token index in this step, -1 if stored before it
        (``[M, R]``, `kernels.shared.gather_rows`)."""
        long = dict(dtype=torch.long, device=positions.device)
        firsts = torch.tensor([self.first_position(r) for r in range(len(self.seq_lens))], **long)[req, None]
        starts = torch.tensor(self.query_start[:-1], **long)[req, None]  # [M, 1] first query token
        blocks = self.raw_block_table[req[:, None], positions // self.raw_block_size].long()  # [M, R]
        in_step = positions >= firsts  # [M, R]
        return blocks, positions % self.raw_block_size, torch.where(in_step, starts + positions - firsts, -1)


@dataclass
class ChunkWrites:
    """Chunks completed in this step: pool raw rows into compressed slots."""

    heads: torch.Tensor  # [M] KV head of each chunk
    src_blocks: torch.Tensor  # [M, chunk_size] raw page of each row stored before the step
    src_offsets: torch.Tensor  # [M, chunk_size]
    src_step: torch.Tensor  # [M, chunk_size] token index of each row computed in this step, -1 if stored
    dst_blocks: torch.Tensor  # [M, slots_per_group] compressed page of each stored row
    dst_offsets: torch.Tensor  # [M, slots_per_group]
    zero_heads: torch.Tensor  # [Z] slots below a head's first group, written as zeros
    zero_blocks: torch.Tensor  # [Z]
    zero_offsets: torch.Tensor  # [Z]
    dynamic: DynamicWrites | None = None  # dynamic boundaries: the unit slots to write (no grid chunks then)
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see `derived`


@dataclass
class KeySet:
    """Rows attended by `num_queries` query tokens of each of `batch` requests.

    Column ``n`` of the compressed part is the request's slot ``n`` (valid
    below ``num_slots``); which rows a query sees follows from the positions
    and the config (`visibility_bias`), so kernels recompute it instead of reading
    ``bias``, which is only built for the PyTorch path.

    The slots' pages come in one of two forms: per slot (``comp_blocks`` and
    ``comp_offsets`` ``[batch, Nc]``), or, when ``comp_rows_per_page`` > 0,
    as the requests' page tables (``comp_blocks`` ``[batch, pages]``, slot
    ``n`` at page ``n // comp_rows_per_page``, row ``n % comp_rows_per_page``;
    ``comp_offsets`` None): the decode plan's form, which the C++ CPU kernel
    reads as it is and `slot_tables` expands for the others."""

    query_index: torch.Tensor  # [batch, L] token index of each query; its rows are the step's own raw rows
    query_positions: torch.Tensor  # [batch, L] position of each query (consecutive within a request)
    raw_blocks: torch.Tensor  # [batch, Nr] raw page of each raw row stored before the step
    raw_offsets: torch.Tensor  # [batch, Nr]
    raw_positions: torch.Tensor  # [batch, Nr] position of each stored raw row (0 on padding)
    num_raw: torch.Tensor  # [batch] stored raw rows of each request (padding follows them)
    comp_blocks: torch.Tensor  # [batch, Nc] compressed page of each slot (or [batch, pages], see above)
    comp_offsets: torch.Tensor | None  # [batch, Nc] (None with page tables)
    num_slots: torch.Tensor  # [batch] slots of the request that may be visible (the rest is padding)
    origins: torch.Tensor  # [batch, Hkv] grid origin of each request's KV heads (shifted by `align`)
    bias: torch.Tensor | None  # [batch, Hkv, L, Nr + L + Nc], fp32: stored raw rows, step rows, slots
    comp_rows_per_page: int = 0  # > 0: comp_blocks are page tables of pages this many slots each
    _slot_tables: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def num_slot_columns(self) -> int:
        """Nc: the slots addressed per request (valid or padding)."""
        return self.comp_blocks.shape[1] * max(self.comp_rows_per_page, 1)

    def slot_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, row) of every slot, ``[batch, Nc]`` each, whatever the form;
        expanded once per key set (every layer of a step shares it)."""
        if not self.comp_rows_per_page:
            return self.comp_blocks, self.comp_offsets
        if self._slot_tables is None:
            b, pages, per = self.comp_blocks.shape[0], self.comp_blocks.shape[1], self.comp_rows_per_page
            blocks = self.comp_blocks[:, :, None].expand(b, pages, per).reshape(b, pages * per)  # [b, Nc]
            rows = torch.arange(per, dtype=torch.long, device=blocks.device).repeat(b, pages)  # [b, Nc]
            self._slot_tables = (blocks, rows)
        return self._slot_tables


@dataclass
class StepPlan:
    cfg: ChunkedKVConfig
    raw_writes: torch.Tensor  # [W] token indices whose raw rows are stored
    writes: ChunkWrites
    key_sets: list[KeySet]
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # see `derived`


def derived(holder: ChunkWrites | StepPlan, key, make):
    """``make()``, computed once per `holder`: every layer of a step shares
    its plan, so an implementation builds its kernel arguments once per step,
    not per layer. Plans and what is derived from them are read only."""
    if key not in holder.memo:
        holder.memo[key] = make()
    return holder.memo[key]


def build_plan(batch: PagedBatch, cfg: ChunkedKVConfig, origins: list[int], *, bias: bool = True) -> StepPlan:
    """The plan of one step for KV heads with grid `origins` (each request's
    shifted by its `PagedBatch.grid_shifts`); without `bias`, the key sets
    carry no bias (kernels compute visibility themselves)."""
    dynamic = None
    if cfg.boundaries == "dynamic":  # the unit grid, over the pages from the slot lag on
        lag = layout.dynamic_lag_pages(cfg, batch.block_size)
        slot_table = batch.block_table[:, lag:]
        if not slot_table.shape[1]:  # no slot page yet: padding slots read the null page
            slot_table = torch.full_like(batch.block_table[:, :1], NULL_PAGE)
        dynamic = dynamic_writes.build(batch, cfg, slot_table)
        batch, cfg = replace(batch, block_table=slot_table), cfg.storage_grid()
    device = batch.block_table.device
    num_reqs = len(batch.seq_lens)
    q_lens = [batch.query_start[r + 1] - batch.query_start[r] for r in range(num_reqs)]
    req_origins = batch.request_origins(cfg, origins)  # [num_reqs][Hkv]
    decodes = [r for r in range(num_reqs) if q_lens[r] == 1]
    key_sets = [_key_set(batch, cfg, req_origins, decodes, bias)] if decodes else []
    key_sets += [_key_set(batch, cfg, req_origins, [r], bias) for r in range(num_reqs) if q_lens[r] > 1]
    writes = _chunk_writes(batch, cfg, req_origins, q_lens if dynamic is None else [0] * num_reqs, device)
    writes.dynamic = dynamic
    return StepPlan(cfg=cfg, raw_writes=_raw_writes(batch), writes=writes, key_sets=key_sets)


# ------------------------------------------------------------------- writes


def _raw_writes(batch: PagedBatch) -> torch.Tensor:
    """Tokens whose raw page exists, i.e. is not vLLM's null page (`NULL_PAGE`):
    the sinks, the window at the end of the step, the prefix-cache tails, the
    rest of a page begun before the step (`RawWindowManager` decides). Every
    existing page is written in full, so prefix caching may share it."""
    device = batch.block_table.device
    kept = []
    for r, seq_len in enumerate(batch.seq_lens):
        first = batch.first_position(r)
        positions = torch.arange(first, seq_len, device=device)  # [q] this step's positions
        pages = batch.raw_block_table[r, positions // batch.raw_block_size]  # [q]
        kept.append(batch.query_start[r] + (positions - first)[pages != NULL_PAGE])
    return torch.cat(kept) if kept else torch.zeros(0, dtype=torch.long, device=device)


def _chunk_writes(batch: PagedBatch, cfg: ChunkedKVConfig, req_origins: list[list[int]], q_lens: list[int],
                  device) -> ChunkWrites:
    spg = grid.slots_per_group(cfg)
    per_block = layout.states_per_block(cfg, batch.block_size)
    reqs, heads, firsts, counts = [], [], [], []
    zero_reqs, zero_heads, zero_slots = [], [], []
    for r, seq_len in enumerate(batch.seq_lens):
        start = seq_len - q_lens[r]
        for h, origin in enumerate(req_origins[r]):
            chunks = grid.completed_chunks(cfg, start, seq_len, origin)
            if not chunks:
                continue
            reqs.append(r), heads.append(h), firsts.append(chunks.start), counts.append(len(chunks))
            unused = grid.first_group(cfg, origin) * spg
            if chunks.start == 0 and unused:
                zero_reqs += [r] * unused
                zero_heads += [h] * unused
                zero_slots += list(range(unused))
    long = dict(dtype=torch.long, device=device)
    count_t = torch.tensor(counts, **long)  # [E] chunk runs
    run = torch.repeat_interleave(torch.arange(len(counts), **long), count_t)  # [M] run of each chunk
    run_start = torch.cumsum(count_t, 0) - count_t  # [E]
    k = torch.tensor(firsts, **long)[run] + torch.arange(len(run), **long) - run_start[run]  # [M] chunk index
    req = torch.tensor(reqs, **long)[run]  # [M]
    head = torch.tensor(heads, **long)[run]  # [M]
    origin = torch.tensor(req_origins, **long).view(len(req_origins), -1)[req, head]  # [M]
    positions = grid.chunk_start(cfg, k, origin)[:, None] + torch.arange(cfg.chunk_size, **long)  # [M, chunk_size]
    src_blocks, src_offsets, src_step = batch.row_sources(req, positions)  # [M, chunk_size] each
    group = k + grid.first_group(cfg, origin)  # [M] slot group
    slots = (group * spg)[:, None] + torch.arange(spg, **long)  # [M, spg]
    dst_blocks = batch.block_table[req[:, None], slots // per_block]  # [M, spg]
    zero_req = torch.tensor(zero_reqs, **long)  # [Z]
    zero_slot = torch.tensor(zero_slots, **long)  # [Z]
    return ChunkWrites(
        heads=head,
        src_blocks=src_blocks,
        src_offsets=src_offsets,
        src_step=src_step,
        dst_blocks=dst_blocks.long(),
        dst_offsets=slots % per_block,
        zero_heads=torch.tensor(zero_heads, **long),
        zero_blocks=batch.block_table[zero_req, zero_slot // per_block].long(),
        zero_offsets=zero_slot % per_block,
    )


# ----------------------------------------------------------------- key sets


def _key_set(batch: PagedBatch, cfg: ChunkedKVConfig, req_origins: list[list[int]], reqs: list[int],
             with_bias: bool) -> KeySet:
    """Gather indices and bias for the queries of `reqs` (all decodes, or one
    request), padded to the longest request."""
    device = batch.block_table.device
    long = dict(dtype=torch.long, device=device)
    raw_pos, num_slots, queries = [], [], []
    for r in reqs:
        origins = req_origins[r]
        keep = grid.forever_raw(cfg, origins)
        seq_len, first = batch.seq_lens[r], batch.first_position(r)
        window_from = min(grid.raw_from(cfg, first, o) for o in origins)
        # Stored raw rows: kept leading rows and the raw region before the step.
        raw_pos.append(list(range(min(keep, first))) + list(range(min(max(keep, window_from), first), first)))
        num_slots.append(max((grid.visible_slots(cfg, seq_len - 1, o) for o in origins
                              if grid.num_sealed(cfg, seq_len - 1, o)), default=0))
        queries.append(list(range(first, seq_len)))
    num_raw = max(map(len, raw_pos))
    req_t = torch.tensor(reqs, **long)[:, None]  # [b, 1]
    raw_t = torch.tensor([p + [0] * (num_raw - len(p)) for p in raw_pos], **long).view(len(reqs), num_raw)  # [b, Nr]
    raw_padding = torch.arange(num_raw, **long)[None, :] >= torch.tensor([len(p) for p in raw_pos], **long)[:, None]
    # Padding slots read the request's slot 0 and are masked; like every row a
    # request can read, it is finite (vLLM zero-fills its caches, and every row
    # written is a K/V row).
    num_comp = max(num_slots)
    slot_t = torch.arange(num_comp, **long)[None, :].expand(len(reqs), -1)  # [b, Nc]
    slot_valid = slot_t < torch.tensor(num_slots, **long)[:, None]  # [b, Nc]
    slot_t = slot_t.masked_fill(~slot_valid, 0)
    t = torch.tensor(queries, **long)  # [b, L]: one query each, or one request's queries
    q_index = t - t[:, :1] + torch.tensor([batch.query_start[r] for r in reqs], **long)[:, None]  # [b, L]
    per_block = layout.states_per_block(cfg, batch.block_size)
    origins_t = torch.tensor([req_origins[r] for r in reqs], **long).view(len(reqs), -1)  # [b, Hkv]
    bias = visibility_bias(cfg, origins_t, t, raw_t, ~raw_padding, slot_t, slot_valid) if with_bias else None
    return KeySet(
        query_index=q_index,
        query_positions=t,
        raw_blocks=batch.raw_block_table[req_t, raw_t // batch.raw_block_size].long(),
        raw_offsets=raw_t % batch.raw_block_size,
        raw_positions=raw_t,
        num_raw=torch.tensor([len(p) for p in raw_pos], **long),
        comp_blocks=batch.block_table[req_t, slot_t // per_block].long(),
        comp_offsets=slot_t % per_block,
        num_slots=torch.tensor(num_slots, **long),
        origins=origins_t,
        bias=bias,
    )


def visibility_bias(cfg: ChunkedKVConfig, origins: torch.Tensor, t: torch.Tensor, raw_pos: torch.Tensor,
          raw_valid: torch.Tensor, slots: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """Additive mask ``[b, Hkv, L, Nr + L + Nc]`` for queries at positions ``t
    [b, L]`` of requests whose KV heads have grid ``origins [b, Hkv]``, over
    stored raw rows at ``raw_pos [b, Nr]``, the queries' own rows, and
    compressed ``slots [b, Nc]``."""
    q = t[:, None, :, None]  # [b, 1, L, 1]
    o = origins[:, :, None, None]  # [b, Hkv, 1, 1]
    j = torch.cat([raw_pos, t], dim=1)[:, None, None, :]  # [b, 1, 1, Nr + L] stored rows, then the step's
    valid = torch.cat([raw_valid, torch.ones_like(t, dtype=torch.bool)], dim=1)[:, None, None, :]
    raw_vis = ((j < cfg.sink_tokens) | (j < o) | (j >= grid.raw_from(cfg, q, o))) & (j <= q) & valid  # [b, Hkv, L, Nr + L]
    s = slots[:, None, None, :]  # [b, 1, 1, Nc]
    kind = grid.slot_kind(cfg, s)  # [b, 1, 1, Nc]
    k = grid.slot_chunk(cfg, s, o)  # [b, Hkv, 1, Nc]
    # What does not depend on the query: a row exists (a pooled row unless the
    # chunk lies wholly in the sinks; a kept boundary token that is also a sink
    # is attended once, as a sink) ...
    exists = (k >= 0) & slot_valid[:, None, None, :] & torch.where(
        kind == SlotKind.FIRST, grid.chunk_start(cfg, k, o) >= cfg.sink_tokens,
        grid.chunk_last(cfg, k, o) >= cfg.sink_tokens)
    # ... and what does: the chunk is sealed for the query.
    slot_vis = exists & (s < grid.visible_slots(cfg, q, o))  # [b, Hkv, L, Nc]
    row_bias = torch.where(kind == SlotKind.POOLED, cfg.log_weight, 0.0).to(torch.float32)  # [b, 1, 1, Nc]
    num_raw = raw_vis.shape[-1]
    bias = torch.empty((*slot_vis.shape[:-1], num_raw + slot_vis.shape[-1]), dtype=torch.float32, device=t.device)
    hidden = torch.full((), float("-inf"), dtype=torch.float32, device=t.device)
    torch.where(raw_vis, torch.zeros((), dtype=torch.float32, device=t.device), hidden, out=bias[..., :num_raw])
    torch.where(slot_vis, row_bias, hidden, out=bias[..., num_raw:])
    return bias  # [b, Hkv, L, Nr + L + Nc]
