"""Contract of vllm_chunked_kv.ops.compressed (with ops.step_plan and layout):
stored the way the backend stores it, chunked attention equals the reference.

A small simulated pager plays vLLM's part: each request gets compressed
pages (one state per `tokens_per_state` tokens) and raw pages; a raw page
that leaves the sliding window within its own step is never allocated (it
maps to a shared NaN page) and raw rows before the window hold NaN (row by
row, stricter than vLLM's whole pages), so reading any of them, even masked,
fails the test; compressed pages start zero-filled, as vLLM's do (rows past
the last sealed chunk of a page are read, and masked). Sequences are fed in random step splits (prefill, chunked prefill,
single-token decodes, mixed batches); every step's outputs equal
`reference_chunked_attention` over the whole sequence within 1e-5, for every
mitigation, pooling mode, sinks and staggered grids.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv import layout
from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import compressed
from vllm_chunked_kv.ops.reference import reference_chunked_attention
from vllm_chunked_kv.ops.step_plan import PagedBatch, build_plan

torch.set_num_threads(1)
HEAD_SIZE, NUM_KV_HEADS, GROUP = 8, 2, 2

CONFIGS = {
    "none": dict(mitigation="none", chunk_size=4, window=6),
    "none-sinks": dict(mitigation="none", chunk_size=4, window=5, sink_tokens=6),
    "boundary-gated": dict(mitigation="boundary", chunk_size=4, window=5, pooling="gated",
                           slot_gains=[0.1, 0.2, 0.3, 0.4], sink_tokens=2),
    "boundary-key_norm": dict(mitigation="boundary", chunk_size=5, window=7, pooling="key_norm"),
    "overlap": dict(mitigation="overlap", chunk_size=4, window=4, sink_tokens=1),
    "overlap-key_norm": dict(mitigation="overlap", chunk_size=6, window=8, pooling="key_norm", proportional=False),
    "stride2": dict(mitigation="stride2", window=3),
    "stagger-heads": dict(mitigation="stagger", chunk_size=4, window=5, sink_tokens=1),
    "stagger-list": dict(mitigation="none", chunk_size=4, hop=2, window=4, stagger=[[1, 0]]),
    "hop1": dict(mitigation="none", chunk_size=1, window=1),
}


class Pager:
    """Pages of several requests, allocated and dropped the way vLLM's managers do."""

    def __init__(self, cfg: ChunkedKVConfig, origins: list[int], block_size: int, num_reqs: int):
        self.cfg, self.origins, self.block_size = cfg, origins, block_size
        self.per_block = layout.states_per_block(cfg, block_size)
        self.raw_block_size = self.per_block  # equal pages, as the backend declares them
        self.keep = layout.forever_raw(cfg, origins)
        row = 2 * HEAD_SIZE
        self.comp = torch.zeros((64 * num_reqs, NUM_KV_HEADS, self.per_block, row))  # vLLM zero-fills its caches
        self.raw = torch.full((256 * num_reqs, NUM_KV_HEADS, self.raw_block_size, row), float("nan"))
        self.free_comp = list(range(1, self.comp.shape[0]))
        self.free_raw = list(range(1, self.raw.shape[0]))  # page 0 is the null page
        self.tables = [([], []) for _ in range(num_reqs)]

    def allocate(self, r: int, seq_len: int) -> None:
        comp, raw = self.tables[r]
        while len(comp) * self.block_size < seq_len:
            comp.append(self.free_comp.pop(0))
        sink_pages = -(-self.keep // self.raw_block_size)
        dead_until = max(0, seq_len - layout.raw_window(self.cfg) + 1) // self.raw_block_size
        while len(raw) * self.raw_block_size < seq_len:
            dead = sink_pages <= len(raw) < dead_until
            raw.append(0 if dead else self.free_raw.pop(0))

    def drop_outside_window(self, r: int, computed: int) -> None:
        """Poison every raw row before the sliding window but the forever-raw
        ones (stricter than vLLM, which drops whole pages only)."""
        first_kept = max(0, computed - layout.raw_window(self.cfg) + 1)
        raw = self.tables[r][1]
        for j in range(self.keep, first_kept):
            self.raw[raw[j // self.raw_block_size], :, j % self.raw_block_size] = float("nan")

    def batch(self, steps: list[tuple[int, int, int]]) -> PagedBatch:
        """steps: (request, first position, end position) of each scheduled request."""
        width = max(max(len(t[0]), len(t[1])) for t in self.tables)
        pad = lambda ids: ids + [0] * (width - len(ids))  # noqa: E731
        starts = [0]
        for _, lo, hi in steps:
            starts.append(starts[-1] + hi - lo)
        return PagedBatch(
            query_start=starts,
            seq_lens=[hi for _, _, hi in steps],
            block_table=torch.tensor([pad(self.tables[r][0]) for r, _, _ in steps]),
            block_size=self.block_size,
            raw_block_table=torch.tensor([pad(self.tables[r][1]) for r, _, _ in steps]),
            raw_block_size=self.raw_block_size,
            raw_window=layout.raw_window(self.cfg),
            raw_sink_tokens=self.keep,
        )

    def check_pages_complete(self, r: int, start: int, end: int) -> None:
        """Every existing raw page holds all its computed rows that were not
        dropped: prefix caching may hand the page to another request."""
        first_kept = max(0, start - layout.raw_window(self.cfg) + 1)
        raw = self.tables[r][1]
        for j in [*range(self.keep), *range(first_kept, end)][:end]:
            page = raw[j // self.raw_block_size]
            if page:
                assert self.raw[page, :, j % self.raw_block_size].isfinite().all(), f"raw row {j} missing"

    def raw_slots(self, steps) -> torch.Tensor:
        slots = []
        for r, lo, hi in steps:
            raw = self.tables[r][1]
            slots += [raw[j // self.raw_block_size] * self.raw_block_size + j % self.raw_block_size
                      for j in range(lo, hi)]
        return torch.tensor(slots)


def run_schedule(cfg: ChunkedKVConfig, origins: list[int], lengths: list[int], seed: int,
                 decode_only: bool = False) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    block_size = cfg.hop * rng.choice([2, 4, 16])  # raw pages shorter and longer than the window
    pager = Pager(cfg, origins, block_size, len(lengths))
    q = [torch.randn(n, NUM_KV_HEADS * GROUP, HEAD_SIZE, generator=gen) for n in lengths]
    k = [torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen) * 2 for n in lengths]
    v = [torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for n in lengths]
    want = [reference_chunked_attention(q[r], k[r], v[r], cfg, scale=0.5, origins=origins) for r in range(len(lengths))]
    done = [0] * len(lengths)
    while any(d < n for d, n in zip(done, lengths)):
        steps = []
        for r in rng.sample(range(len(lengths)), len(lengths)):
            if done[r] < lengths[r] and rng.random() < 0.8:
                take = 1 if decode_only or rng.random() < 0.4 else rng.randint(1, 2 * cfg.window + 3)
                steps.append((r, done[r], min(lengths[r], done[r] + take)))
        if not steps:
            continue
        for r, lo, hi in steps:
            pager.drop_outside_window(r, lo)
            pager.allocate(r, hi)
        batch = pager.batch(steps)
        plan = build_plan(batch, cfg, origins)
        key = torch.cat([k[r][lo:hi] for r, lo, hi in steps])  # [n, Hkv, D]
        value = torch.cat([v[r][lo:hi] for r, lo, hi in steps])
        query = torch.cat([q[r][lo:hi] for r, lo, hi in steps])  # [n, Hq, D]
        step_rows = torch.cat([key, value], dim=-1)  # [n, Hkv, 2 * D]
        compressed.write_raw(pager.raw, step_rows, pager.raw_slots(steps), plan.raw_writes)
        assert not pager.raw[0].isfinite().any(), "a row was written to the null page"
        compressed.write_chunks(pager.comp, pager.raw, step_rows, plan.writes, cfg, HEAD_SIZE)
        out = compressed.attend(query, step_rows, pager.comp, pager.raw, plan, scale=0.5)
        got = torch.split(out, [hi - lo for _, lo, hi in steps])
        for (r, lo, hi), rows in zip(steps, got):
            pager.check_pages_complete(r, lo, hi)
            torch.testing.assert_close(rows, want[r][lo:hi], atol=1e-5, rtol=1e-5)
            done[r] = hi


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_steps_equal_reference(name, seed):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    origins = cfg.origins(0, NUM_KV_HEADS)
    lengths = [random.Random(seed).randint(1, 60) for _ in range(3)] + [4 * cfg.window + 9]
    run_schedule(cfg, origins, lengths, seed)


def test_one_token_steps_only():
    """Pure decoding from the first token on: every seal happens in a decode step."""
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=4, window=4, sink_tokens=3)
    run_schedule(cfg, cfg.origins(0, NUM_KV_HEADS), [37, 22], seed=5, decode_only=True)


def test_stored_rows_per_token():
    """Compressed pages hold exactly tokens / tokens_per_state rows (DESIGN.md §4)."""
    for name, settings in CONFIGS.items():
        cfg = ChunkedKVConfig(**settings)
        block_size = 4 * cfg.hop
        assert layout.states_per_block(cfg, block_size) * cfg.tokens_per_state == block_size, name
        assert layout.tokens_per_state(cfg) == cfg.tokens_per_state, name
