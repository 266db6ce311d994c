"""One forward step's index plan over the compressed and raw pages.

Built once per step (and per set of grid origins) from vLLM's metadata of
both cache groups, then reused by every layer:

- `ChunkWrites`: the chunks whose last token this step computes, with the
  raw rows they pool from and the compressed slots they are written to
  (`layout.py` says where);
- `KeySet`s: for a set of query tokens, which raw rows and which compressed
  slots to gather, and the additive bias (``-inf`` hidden, ``0`` raw,
  ``log_weight`` on pooled rows) that turns plain attention over them into
  DESIGN.md §3 attention. All single-token (decode) requests share one
  padded `KeySet`; every multi-token request gets its own.

Python loops here run per request (or per request and KV head) on
metadata, never per token or per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_chunked_kv import layout
from vllm_chunked_kv.config import ChunkedKVConfig


@dataclass
class PagedBatch:
    """Where each request of a step lives: its query tokens and both page tables."""

    query_start: list[int]  # [num_reqs + 1] first query token of each request
    seq_lens: list[int]  # [num_reqs] positions computed after this step
    block_table: torch.Tensor  # [num_reqs, max_blocks] compressed pages
    block_size: int  # tokens per compressed page
    raw_block_table: torch.Tensor  # [num_reqs, max_raw_blocks] raw pages
    raw_block_size: int  # tokens per raw page


@dataclass
class ChunkWrites:
    """Chunks completed in this step: pool raw rows into compressed slots."""

    heads: torch.Tensor  # [M] KV head of each chunk
    src_blocks: torch.Tensor  # [M, chunk_size] raw page of each row of the chunk
    src_offsets: torch.Tensor  # [M, chunk_size]
    dst_blocks: torch.Tensor  # [M, slots_per_group] compressed page of each stored row
    dst_offsets: torch.Tensor  # [M, slots_per_group]
    zero_heads: torch.Tensor  # [Z] slots below a head's first group, written as zeros
    zero_blocks: torch.Tensor  # [Z]
    zero_offsets: torch.Tensor  # [Z]


@dataclass
class KeySet:
    """Rows attended by `num_queries` query tokens of each of `batch` requests."""

    query_index: torch.Tensor  # [batch, num_queries] token index into the step's queries
    raw_blocks: torch.Tensor  # [batch, Nr] raw page of each raw row
    raw_offsets: torch.Tensor  # [batch, Nr]
    comp_blocks: torch.Tensor  # [batch, Nc] compressed page of each slot
    comp_offsets: torch.Tensor  # [batch, Nc]
    comp_padding: torch.Tensor  # [batch, Nc] True where the slot is padding (zeroed)
    bias: torch.Tensor  # [batch, Hkv, num_queries, Nr + Nc], fp32


@dataclass
class StepPlan:
    writes: ChunkWrites
    key_sets: list[KeySet]


def build_plan(batch: PagedBatch, cfg: ChunkedKVConfig, origins: list[int]) -> StepPlan:
    """The plan of one step for KV heads with grid `origins`."""
    device = batch.block_table.device
    num_reqs = len(batch.seq_lens)
    q_lens = [batch.query_start[r + 1] - batch.query_start[r] for r in range(num_reqs)]
    decodes = [r for r in range(num_reqs) if q_lens[r] == 1]
    key_sets = [_key_set(batch, cfg, origins, decodes)] if decodes else []
    key_sets += [_key_set(batch, cfg, origins, [r]) for r in range(num_reqs) if q_lens[r] > 1]
    return StepPlan(writes=_chunk_writes(batch, cfg, origins, q_lens, device), key_sets=key_sets)


# ------------------------------------------------------------------- writes


def _chunk_writes(batch: PagedBatch, cfg: ChunkedKVConfig, origins: list[int], q_lens: list[int],
                  device) -> ChunkWrites:
    spg = layout.slots_per_group(cfg)
    per_block = layout.states_per_block(cfg, batch.block_size)
    reqs, heads, firsts, counts = [], [], [], []
    zero_reqs, zero_heads, zero_slots = [], [], []
    for r, seq_len in enumerate(batch.seq_lens):
        start = seq_len - q_lens[r]
        for h, origin in enumerate(origins):
            chunks = layout.completed_chunks(cfg, start, seq_len, origin)
            if not chunks:
                continue
            reqs.append(r), heads.append(h), firsts.append(chunks.start), counts.append(len(chunks))
            unused = layout.first_group(cfg, origin) * spg
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
    origin = torch.tensor(origins, **long)[head]  # [M]
    positions = (origin + k * cfg.hop)[:, None] + torch.arange(cfg.chunk_size, **long)  # [M, chunk_size]
    src_blocks = batch.raw_block_table[req[:, None], positions // batch.raw_block_size]  # [M, chunk_size]
    group = k + (origin + cfg.chunk_size - 1) // cfg.hop  # [M] slot group (layout.first_group + k)
    slots = (group * spg)[:, None] + torch.arange(spg, **long)  # [M, spg]
    dst_blocks = batch.block_table[req[:, None], slots // per_block]  # [M, spg]
    zero_req = torch.tensor(zero_reqs, **long)  # [Z]
    zero_slot = torch.tensor(zero_slots, **long)  # [Z]
    return ChunkWrites(
        heads=head,
        src_blocks=src_blocks.long(),
        src_offsets=positions % batch.raw_block_size,
        dst_blocks=dst_blocks.long(),
        dst_offsets=slots % per_block,
        zero_heads=torch.tensor(zero_heads, **long),
        zero_blocks=batch.block_table[zero_req, zero_slot // per_block].long(),
        zero_offsets=zero_slot % per_block,
    )


# ----------------------------------------------------------------- key sets


def _key_set(batch: PagedBatch, cfg: ChunkedKVConfig, origins: list[int], reqs: list[int]) -> KeySet:
    """Gather indices and bias for the queries of `reqs` (all decodes, or one
    request), padded to the longest request."""
    device = batch.block_table.device
    long = dict(dtype=torch.long, device=device)
    spg = layout.slots_per_group(cfg)
    keep = layout.forever_raw(cfg, origins)
    raw_pos, num_slots, queries = [], [], []
    for r in reqs:
        seq_len, q_start = batch.seq_lens[r], batch.query_start[r]
        first = seq_len - (batch.query_start[r + 1] - q_start)  # position of the first query
        window_from = min(layout.raw_from(cfg, first, o) for o in origins)
        tail_from = min(max(keep, window_from), seq_len)
        raw_pos.append(list(range(min(keep, seq_len))) + list(range(tail_from, seq_len)))
        groups = [layout.first_group(cfg, o) + layout.num_sealed(cfg, seq_len - 1, o)
                  for o in origins if layout.num_sealed(cfg, seq_len - 1, o)]
        num_slots.append(spg * max(groups, default=0))
        queries.append(list(range(first, seq_len)))
    num_raw, num_comp, num_q = max(map(len, raw_pos)), max(num_slots), max(map(len, queries))
    req_t = torch.tensor(reqs, **long)[:, None]  # [b, 1]
    seq_len_t = torch.tensor([batch.seq_lens[r] for r in reqs], **long)[:, None]  # [b, 1]
    # Padding raw rows read the request's newest row (always stored) and are masked.
    raw_t = torch.stack([torch.tensor(p + [p[-1]] * (num_raw - len(p)), **long) for p in raw_pos])  # [b, Nr]
    raw_valid = torch.arange(num_raw, **long)[None, :] < torch.tensor([len(p) for p in raw_pos], **long)[:, None]
    slot_t = torch.arange(num_comp, **long)[None, :].expand(len(reqs), -1)  # [b, Nc]
    comp_padding = slot_t >= torch.tensor(num_slots, **long)[:, None]  # [b, Nc]
    slot_t = slot_t.masked_fill(comp_padding, 0)
    t = torch.stack([torch.tensor(q + [q[-1]] * (num_q - len(q)), **long) for q in queries])  # [b, L]
    q_index = t - (seq_len_t - torch.tensor([batch.query_start[r + 1] for r in reqs], **long)[:, None])  # [b, L]
    per_block = layout.states_per_block(cfg, batch.block_size)
    bias = _bias(cfg, torch.tensor(origins, **long), t, raw_t, raw_valid, slot_t, ~comp_padding)
    return KeySet(
        query_index=q_index,
        raw_blocks=batch.raw_block_table[req_t, raw_t // batch.raw_block_size].long(),
        raw_offsets=raw_t % batch.raw_block_size,
        comp_blocks=batch.block_table[req_t, slot_t // per_block].long(),
        comp_offsets=slot_t % per_block,
        comp_padding=comp_padding,
        bias=bias,
    )


def _bias(cfg: ChunkedKVConfig, origins: torch.Tensor, t: torch.Tensor, raw_pos: torch.Tensor,
          raw_valid: torch.Tensor, slots: torch.Tensor, slot_valid: torch.Tensor) -> torch.Tensor:
    """Additive mask ``[b, Hkv, L, Nr + Nc]`` for queries at positions ``t [b, L]``
    over raw rows at ``raw_pos [b, Nr]`` and compressed ``slots [b, Nc]``."""
    hop, chunk_size = cfg.hop, cfg.chunk_size
    q = t[:, None, :, None]  # [b, 1, L, 1]
    o = origins[None, :, None, None]  # [1, Hkv, 1, 1]
    slack = q - cfg.window - (o + chunk_size - 1)  # [b, Hkv, L, 1]
    sealed = torch.where(slack >= 0, torch.div(slack, hop, rounding_mode="floor") + 1, 0)  # [b, Hkv, L, 1]
    raw_from = torch.where(sealed > 0, o + (sealed - 1) * hop + chunk_size, o)  # [b, Hkv, L, 1]
    j = raw_pos[:, None, None, :]  # [b, 1, 1, Nr]
    raw_vis = ((j < cfg.sink_tokens) | (j < o) | (j >= raw_from)) & (j <= q) & raw_valid[:, None, None, :]
    spg = layout.slots_per_group(cfg)
    s = slots[:, None, None, :]  # [b, 1, 1, Nc]
    kind = s % spg  # 0 pooled row, 1 first token, 2 last token
    k = torch.div(s, spg, rounding_mode="floor") - (o + chunk_size - 1) // hop  # [b, Hkv, 1, Nc] chunk index
    first = o + k * hop  # [b, Hkv, 1, Nc] first position of the chunk
    last = first + chunk_size - 1
    slot_vis = (k >= 0) & (k < sealed) & slot_valid[:, None, None, :]  # [b, Hkv, L, Nc]
    # A pooled row exists unless the chunk lies wholly in the sinks (or has no
    # interior); a kept boundary token that is also a sink is attended once, as a sink.
    slot_vis &= torch.where(kind == 1, first >= cfg.sink_tokens, last >= cfg.sink_tokens)
    if not len(cfg.pooled_slots):
        slot_vis &= kind != 0
    slot_bias = torch.where(kind == 0, cfg.log_weight, 0.0).to(torch.float32)  # [b, 1, 1, Nc]
    zeros = torch.zeros((), dtype=torch.float32, device=t.device)
    raw_bias = torch.where(raw_vis, zeros, float("-inf"))  # [b, Hkv, L, Nr]
    slot_bias = torch.where(slot_vis, slot_bias, float("-inf"))  # [b, Hkv, L, Nc]
    return torch.cat([raw_bias, slot_bias], dim=-1)  # [b, Hkv, L, Nr + Nc]
