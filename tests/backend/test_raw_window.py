"""Contract of vllm_chunked_kv.backend.raw_window, driven through vLLM's own BlockPool:

- a step gets pages only for the sinks and for its window at the end of the
  step (the predicted count is what it takes from the pool, and the new
  pages it reports, nulls included, keep the worker's block table aligned
  with the scheduler's); pages before
  the window are dropped from the first page after the sinks on, also when
  earlier steps left never-allocated pages in between (nothing leaks);
- a prefix-cache hit past the window brings the cached sink pages along (a
  hit whose sink pages are not cached shrinks to the cached prefix), and a
  new request adopting it holds sinks, nulls, then the window pages, taking
  from the pool exactly what was predicted;
- pool sizing counts the sink pages, the window, and one window per step in
  flight, however many tokens a step may hold;
- with prefix caching on, a step also keeps the tail (the pages a hit needs
  before its end) of its last aligned boundary, and of every N-th token with
  retention interval N (every page with None); exactly those prefixes hit
  for a later request once the first is freed, and pool sizing counts the
  tails, and a request's shared-prefix junction keeps its tail too (the next
  request sharing that prefix hits it);
- while the step's pages all fit with at least half the pool free, a step
  with prefix caching on keeps and caches every page (spare pages: every
  page-aligned prefix hits); in a tighter pool only the tails above (pool
  sizing counts those, not spare pages);
- the spec is in vLLM's registry with its manager.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_chunked_kv.backend.raw_window import RawWindowManager, RawWindowSpec

BLOCK = 4


def cached_spec(interval: int | None) -> RawWindowSpec:
    """SPEC with prefix caching on and vLLM's retention interval `interval`."""
    return RawWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=7,
                         sink_tokens=6, max_step_tokens=64, prefix_caching=True, retention_interval=interval,
                         alignment_tokens=BLOCK)

SPEC = RawWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=7,
                     sink_tokens=6, max_step_tokens=64)  # 2 sink pages; the window needs 2 pages
HASHES = [bytes([i]) for i in range(16)]


def make_manager(pool: BlockPool, spec: RawWindowSpec = SPEC) -> RawWindowManager:
    return RawWindowManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                            scheduler_block_size=BLOCK)


def request(name: str, hashes: list[bytes]):
    return SimpleNamespace(request_id=name, block_hashes=[BlockHash(h) for h in hashes], shared_prefix_boundary=0,
                           lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None)


WORKER_TABLES: dict[str, list[int]] = {}  # what vLLM's worker builds from the returned new blocks


def step(manager: RawWindowManager, req, start: int, end: int, retention: int | None = None) -> None:
    """One scheduler step computing positions [start, end), as vLLM's allocate_slots does it."""
    manager.remove_skipped_blocks(req.request_id, start)
    free = manager.block_pool.get_num_free_blocks()
    predicted = manager.get_num_blocks_to_allocate(req.request_id, end, [], start, start, end)
    new = manager.allocate_new_blocks(req.request_id, end, end)
    assert free - manager.block_pool.get_num_free_blocks() == predicted
    table = WORKER_TABLES.setdefault(req.request_id, [])
    table += [block.block_id for block in new]
    assert len(table) == len(manager.req_to_blocks[req.request_id])  # page i is entry i on the worker too
    manager.cache_blocks(req, end, retention, replay_boundaries=[end - 1])  # as if the prompt ended here


def held(manager: RawWindowManager, name: str) -> list[int | None]:
    return [None if b.is_null else b.block_id for b in manager.req_to_blocks[name]]


def test_one_step_gets_sinks_and_window_pages_only():
    WORKER_TABLES.clear()
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    step(manager, request("a", HASHES), 0, 40)  # rows from 34 on outlive the step: pages 8, 9
    pages = held(manager, "a")
    assert None not in pages[:2] and pages[2:8] == [None] * 6 and None not in pages[8:]


def test_window_drops_all_but_sink_pages_without_leaks():
    WORKER_TABLES.clear()
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    req = request("a", HASHES)
    bounds = [0, 12, 16, 20, 40, 44, 45, 60]  # prefill, decode-sized steps, a long step, more
    for start, end in zip(bounds, bounds[1:]):
        step(manager, req, start, end)
    manager.remove_skipped_blocks("a", 60)  # window keeps positions >= 54: pages 13, 14
    pages = held(manager, "a")
    assert None not in pages[:2] and pages[2:13] == [None] * 11 and None not in pages[13:]
    assert pool.get_num_free_blocks() == 64 - 1 - 4  # the null page, 2 sinks, 2 window pages


def test_hit_brings_sink_pages_and_is_adopted():
    WORKER_TABLES.clear()
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    req = request("a", HASHES)
    for start, end in [(0, 12), (12, 24), (24, 32), (32, 40)]:
        step(manager, req, start, end)
    ids = held(manager, "a")
    manager.remove_skipped_blocks("a", 40)
    manager.free("a")

    (hit,), length = RawWindowManager.find_longest_cache_hit(
        [BlockHash(h) for h in HASHES[:10]], 40, [0], pool, SPEC, False, BLOCK)
    assert length == 40
    assert [b.block_id for b in hit[:2]] == ids[:2] and [b.block_id for b in hit[8:]] == ids[8:10]
    assert all(b.is_null for b in hit[2:8])

    free_before = pool.get_num_free_blocks()
    needed = manager.get_num_blocks_to_allocate("b", 44, hit, 40, 40, 44)
    assert needed == 1 + 4  # one new page; 2 sink and 2 window hits leave the free queue
    manager.add_local_computed_blocks("b", hit, 40, 0)
    manager.allocate_new_blocks("b", 44, 44)
    pages = held(manager, "b")
    assert pages[:2] == ids[:2] and pages[8:10] == ids[8:10]
    assert pages[2:8] == [None] * 6 and pages[10] is not None
    assert pool.get_num_free_blocks() == free_before - needed


def test_hit_without_cached_sink_pages_shrinks():
    WORKER_TABLES.clear()
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    req = request("a", HASHES)
    for start, end in [(0, 12), (12, 24), (24, 40)]:
        step(manager, req, start, end)
    manager.remove_skipped_blocks("a", 40)
    manager.free("a")
    other = [HASHES[0]] + [bytes([100 + i]) for i in range(1, 8)] + HASHES[8:10]  # second sink page differs
    (hit,), length = RawWindowManager.find_longest_cache_hit(
        [BlockHash(h) for h in other], 40, [0], pool, SPEC, False, BLOCK)
    assert length == BLOCK and len(hit) == 1  # only the cached first page remains


def test_sizing_counts_sinks_window_and_steps_in_flight():
    no_sinks = RawWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=7,
                             max_step_tokens=64)
    one_step = no_sinks.max_admission_blocks_per_request(64, 4096)
    assert SPEC.max_admission_blocks_per_request(64, 4096) == one_step + 2
    assert no_sinks.max_admission_blocks_per_request(128, 4096) == one_step + 3  # async: two steps in flight
    bigger_steps = RawWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32,
                                 sliding_window=7, max_step_tokens=8192)
    assert bigger_steps.max_admission_blocks_per_request(8192, 65536) == one_step
    assert KVCacheSpecRegistry.get_manager_class(SPEC) is RawWindowManager




def _hits(pool: BlockPool, spec: RawWindowSpec, lengths) -> dict[int, int]:
    return {n: RawWindowManager.find_longest_cache_hit([BlockHash(h) for h in HASHES[: n // BLOCK]], n, [0],
                                                       pool, spec, False, BLOCK)[1] for n in lengths}


TIGHT = 20  # pool pages: one 40-position step's 10 pages would leave less than half of it free


def test_prefix_caching_keeps_the_tails_later_requests_hit():
    # 40 positions in one step, window 7 (a hit needs 2 pages before it), sink pages 0-1.
    for interval, live, hits in [
        (0, [0, 1, 7, 8, 9], {36: 36, 32: 8, 16: 8}),  # the tail of the last boundary (36) only; 8: sinks
        (16, [0, 1, 2, 3, 6, 7, 8, 9], {36: 36, 32: 32, 16: 16, 28: 16}),  # and before every 16th token
        (None, list(range(10)), {36: 36, 32: 32, 28: 28, 16: 16}),  # every page
    ]:
        WORKER_TABLES.clear()
        pool = BlockPool(TIGHT, enable_caching=True, hash_block_size=BLOCK)
        spec = cached_spec(interval)
        manager = make_manager(pool, spec)
        step(manager, request("a", HASHES), 0, 40, retention=interval)
        assert [i for i, page in enumerate(held(manager, "a")) if page is not None] == live, interval
        manager.remove_skipped_blocks("a", 40)
        manager.free("a")
        assert _hits(pool, spec, hits) == hits, interval


def test_a_shared_prefix_junction_keeps_its_tail():
    """vLLM's shared-prefix junction (set on a request whose compressed pages hit
    further than its raw pages) keeps the tail before it: the next request sharing
    that prefix hits there, with the default retention interval."""
    WORKER_TABLES.clear()
    pool = BlockPool(TIGHT, enable_caching=True, hash_block_size=BLOCK)
    spec = cached_spec(0)
    manager = make_manager(pool, spec)
    req = request("b", HASHES)
    req.shared_prefix_boundary = 24
    manager.note_junction("b", 24)
    step(manager, req, 0, 40, retention=0)
    assert [i for i, page in enumerate(held(manager, "b")) if page is not None] == [0, 1, 4, 5, 7, 8, 9]
    manager.remove_skipped_blocks("b", 40)
    manager.free("b")
    assert _hits(pool, spec, [20, 24, 32, 36]) == {20: 8, 24: 24, 32: 24, 36: 36}
    assert not manager._junctions  # forgotten with the request


def test_prefix_caching_sizing_counts_the_tails():
    base = SPEC.max_admission_blocks_per_request(64, 4096)
    # a step's window (6 rows) + the alignment (4 rows) + a junction's tail (6 + one page: 10 rows) = 5 pages, not 2
    assert cached_spec(0).max_admission_blocks_per_request(64, 4096) == base + 3
    assert cached_spec(16).max_admission_blocks_per_request(64, 4096) > base + 4  # a tail per 16 tokens
    assert cached_spec(None).max_admission_blocks_per_request(64, 4096) == base + 64 // BLOCK - 2  # every row


def test_a_step_with_room_keeps_spare_pages_every_prefix_hits():
    """With half the pool free after the step, interval 0 keeps and caches every page
    (the count predicted is what the step takes); the second request, a tighter fit, keeps only tails."""
    WORKER_TABLES.clear()
    pool = BlockPool(32, enable_caching=True, hash_block_size=BLOCK)
    spec = cached_spec(0)
    manager = make_manager(pool, spec)
    step(manager, request("a", HASHES), 0, 40, retention=0)  # 31 free - 10 pages >= 16
    assert None not in held(manager, "a")
    step(manager, request("b", [bytes([50 + i]) for i in range(10)]), 0, 40, retention=0)  # 21 - 10 < 16
    assert [i for i, page in enumerate(held(manager, "b")) if page is not None] == [0, 1, 7, 8, 9]
    for name in "ab":
        manager.remove_skipped_blocks(name, 40)
        manager.free(name)
    assert _hits(pool, spec, [16, 24, 28, 32, 36]) == {16: 16, 24: 24, 28: 28, 32: 32, 36: 36}
