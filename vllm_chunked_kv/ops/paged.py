"""Chunked attention over an all-raw paged layout, in plain PyTorch.

Here every token's row is stored raw: `kv_cache[num_blocks, num_kv_heads,
block_size, Dk + Dv]` (keys then values per stored row), row `j` of a request
in block `block_table[j // block_size]` at offset `j % block_size`, and
sealed chunks are pooled from those rows when a query needs them. It is the
PyTorch counterpart of the kernels in `triton_attention.py` (same layout and
signature, selected through `dispatch.py`).

The backend stores the compressed layout instead (`layout.py`: compressed
pages plus a raw window); its PyTorch path is `ops/compressed.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import reference


@dataclass
class PagedBatch:
    """Where each request of a batch lives: its query tokens and its pages."""

    query_start: list[int]  # [num_reqs + 1] first query token of each request
    seq_lens: list[int]  # [num_reqs] rows stored after this step (context + new)
    block_table: torch.Tensor  # [num_reqs, max_blocks] block ids
    block_size: int
    decode_reqs: torch.Tensor  # [num_decodes] requests with exactly one query token
    prefill_reqs: list[int]  # requests with more than one query token

    @classmethod
    def from_vllm(cls, *, query_start_loc, seq_lens, block_table, block_size) -> PagedBatch:
        query_start = query_start_loc.tolist()
        q_lens = [b - a for a, b in zip(query_start[:-1], query_start[1:])]
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        return cls(
            query_start=query_start,
            seq_lens=seq_lens.tolist(),
            block_table=block_table,
            block_size=block_size,
            decode_reqs=torch.tensor(decode, dtype=torch.long, device=block_table.device),
            prefill_reqs=[i for i, q in enumerate(q_lens) if q > 1],
        )


def write_tokens(kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    """Store one row per token at flat slot `block * block_size + offset`.

    kv_cache: [num_blocks, Hkv, block_size, Dk + Dv]; key: [n, Hkv, Dk];
    value: [n, Hkv, Dv]; slots: [n] (negative slots are padding, skipped).
    """
    keep = slots >= 0
    if not bool(keep.all()):
        key, value, slots = key[keep], value[keep], slots[keep]
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size  # [n], [n]
    rows = torch.cat([key, value], dim=-1).to(kv_cache.dtype)  # [n, Hkv, Dk + Dv]
    kv_cache[blocks, :, offsets, :] = rows


def gather_rows(kv_cache: torch.Tensor, block_ids: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows 0..num_rows-1 of requests whose block-table rows are `block_ids`.

    block_ids: [R, max_blocks] -> returns [R, Hkv, num_rows, Dk + Dv].
    """
    block_size = kv_cache.shape[2]
    num_blocks = -(-num_rows // block_size)
    pages = kv_cache[block_ids[:, :num_blocks]]  # [R, nb, Hkv, bs, C]
    R, nb, Hkv, bs, C = pages.shape
    rows = pages.permute(0, 2, 1, 3, 4).reshape(R, Hkv, nb * bs, C)  # [R, Hkv, nb*bs, C]
    return rows[:, :, :num_rows]


def attend(query: torch.Tensor, kv_cache: torch.Tensor, batch: PagedBatch, scale: float,
           cfg: ChunkedKVConfig | None = None, origins: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of every query token over its request's stored rows.

    query: [n, Hq, D] -> [n, Hq, Dv]; fp32 math, output in the query dtype.
    Without `cfg`, exact causal attention. With `cfg`, DESIGN.md §3 chunked
    attention (pooled rows built from the stored raw rows), for requests
    that have anything sealed; the others take the exact path.
    """
    n, num_heads, head_size = query.shape
    head_size_v = kv_cache.shape[-1] - head_size
    out = query.new_empty(n, num_heads, head_size_v)
    compressed = set()
    if cfg is not None:
        first_seal = cfg.window + int(origins.min()) + cfg.chunk_size - 1  # earliest query position with a seal
        compressed = {r for r, length in enumerate(batch.seq_lens) if length - 1 >= first_seal}
    decodes = [r for r in batch.decode_reqs.tolist() if r not in compressed]
    if decodes:
        _attend_decodes(query, kv_cache, batch, decodes, scale, out)
    for r in batch.prefill_reqs + sorted(compressed):
        if r in compressed:
            _attend_chunked(query, kv_cache, batch, r, scale, cfg, origins, out)
        else:
            _attend_prefill(query, kv_cache, batch, r, scale, out)
    return out


def _attend_chunked(query, kv_cache, batch: PagedBatch, r: int, scale: float, cfg: ChunkedKVConfig,
                    origins: torch.Tensor, out: torch.Tensor) -> None:
    start, end = batch.query_start[r], batch.query_start[r + 1]
    seq_len = batch.seq_lens[r]
    rows = gather_rows(kv_cache, batch.block_table[r : r + 1], seq_len)[0]  # [Hkv, S, C]
    head_size = query.shape[-1]
    keys = rows[..., :head_size].transpose(0, 1)  # [S, Hkv, D]
    values = rows[..., head_size:].transpose(0, 1)  # [S, Hkv, Dv]
    positions = torch.arange(seq_len - (end - start), seq_len, device=query.device)  # [L]
    ext = reference.extended_kv(keys, values, cfg, origins, positions)
    out[start:end] = reference.attend_extended(query[start:end], ext, scale).to(out.dtype)


def _attend_decodes(query, kv_cache, batch: PagedBatch, decodes: list[int], scale: float, out: torch.Tensor) -> None:
    reqs = torch.tensor(decodes, dtype=torch.long, device=query.device)  # [Rd]
    starts = torch.tensor(batch.query_start, device=query.device)[reqs]  # [Rd]
    lens = torch.tensor(batch.seq_lens, device=query.device)[reqs]  # [Rd]
    max_len = int(lens.max())
    rows = gather_rows(kv_cache, batch.block_table[reqs], max_len).float()  # [Rd, Hkv, S, C]
    head_size = query.shape[-1]
    keys, values = rows[..., :head_size], rows[..., head_size:]  # [Rd, Hkv, S, D], [Rd, Hkv, S, Dv]
    q = query[starts].float().unsqueeze(2)  # [Rd, Hq, 1, D]
    visible = torch.arange(max_len, device=query.device)[None, :] < lens[:, None]  # [Rd, S]
    o = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=visible[:, None, None, :], scale=scale, enable_gqa=True
    )  # [Rd, Hq, 1, Dv]
    out[starts] = o.squeeze(2).to(out.dtype)


def _attend_prefill(query, kv_cache, batch: PagedBatch, r: int, scale: float, out: torch.Tensor) -> None:
    start, end = batch.query_start[r], batch.query_start[r + 1]
    seq_len = batch.seq_lens[r]
    q_len = end - start
    rows = gather_rows(kv_cache, batch.block_table[r : r + 1], seq_len).float()  # [1, Hkv, S, C]
    head_size = query.shape[-1]
    keys, values = rows[..., :head_size], rows[..., head_size:]  # [1, Hkv, S, D], [1, Hkv, S, Dv]
    q = query[start:end].float().transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    positions = torch.arange(seq_len - q_len, seq_len, device=query.device)  # [L]
    visible = torch.arange(seq_len, device=query.device)[None, :] <= positions[:, None]  # [L, S]
    o = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, scale=scale, enable_gqa=True)
    out[start:end] = o[0].transpose(0, 1).to(out.dtype)  # [L, Hq, Dv]
