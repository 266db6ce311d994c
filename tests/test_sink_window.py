"""Contract of vllm_chunked_kv.sink_window, driven through vLLM's own BlockPool:

- pages before the sliding window are dropped, the sink pages never are;
- a prefix-cache hit past the window brings the cached sink pages along (a
  hit whose sink pages are not cached shrinks to the cached prefix);
- a new request adopting such a hit holds the sink pages, nulls, then the
  window pages, and the blocks it must take from the pool are counted;
- pool sizing and admission count the sink pages;
- the spec is in vLLM's registry with its manager.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHash
from vllm.v1.kv_cache_interface import SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_chunked_kv.sink_window import SinkSlidingWindowManager, SinkSlidingWindowSpec

BLOCK = 4
SPEC = SinkSlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=7,
                             sink_tokens=6)  # 2 sink pages; hits need 2 window pages


def make_manager(pool: BlockPool) -> SinkSlidingWindowManager:
    return SinkSlidingWindowManager(SPEC, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                    scheduler_block_size=BLOCK)


def request(name: str, hashes: list[bytes]):
    return SimpleNamespace(request_id=name, block_hashes=[BlockHash(h) for h in hashes], shared_prefix_boundary=0,
                           lora_request=None, mm_features=[], cache_salt=None, prompt_embeds=None)


def run_prefill(manager: SinkSlidingWindowManager, req, num_tokens: int) -> None:
    assert manager.get_num_blocks_to_allocate(req.request_id, num_tokens, [], 0, 0, num_tokens) == num_tokens // BLOCK
    manager.allocate_new_blocks(req.request_id, num_tokens, num_tokens)
    manager.cache_blocks(req, num_tokens, replay_boundaries=[])


def test_window_drops_all_but_sink_pages():
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    req = request("a", [bytes([i]) for i in range(10)])
    run_prefill(manager, req, 40)
    ids = [b.block_id for b in manager.req_to_blocks["a"]]
    manager.remove_skipped_blocks("a", 40)  # window keeps positions >= 34: pages 8, 9
    blocks = manager.req_to_blocks["a"]
    assert [b.block_id for b in blocks[:2]] == ids[:2]
    assert all(b.is_null for b in blocks[2:8])
    assert [b.block_id for b in blocks[8:]] == ids[8:]


def test_hit_brings_sink_pages_and_is_adopted():
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    hashes = [bytes([i]) for i in range(10)]
    run_prefill(manager, request("a", hashes), 40)
    ids = [b.block_id for b in manager.req_to_blocks["a"]]
    manager.remove_skipped_blocks("a", 40)
    manager.free("a")

    (hit,), length = SinkSlidingWindowManager.find_longest_cache_hit(
        [BlockHash(h) for h in hashes], 40, [0], pool, SPEC, False, BLOCK)
    assert length == 40
    assert [b.block_id for b in hit[:2]] == ids[:2]
    assert all(b.is_null for b in hit[2:8])
    assert [b.block_id for b in hit[8:]] == ids[8:]

    free_before = pool.get_num_free_blocks()
    # 12 tokens need 11 pages: 2 sinks + 2 window pages are hits (all evictable), 1 page is new.
    needed = manager.get_num_blocks_to_allocate("b", 44, hit, 40, 40, 44)
    assert needed == 1 + 4
    manager.add_local_computed_blocks("b", hit, 40, 0)
    manager.allocate_new_blocks("b", 44, 44)
    held = manager.req_to_blocks["b"]
    assert [b.block_id for b in held[:2]] == ids[:2] and [b.block_id for b in held[8:10]] == ids[8:]
    assert all(b.is_null for b in held[2:8]) and not held[10].is_null
    assert pool.get_num_free_blocks() == free_before - needed


def test_hit_without_cached_sink_pages_shrinks():
    pool = BlockPool(64, enable_caching=True, hash_block_size=BLOCK)
    manager = make_manager(pool)
    hashes = [bytes([i]) for i in range(10)]
    run_prefill(manager, request("a", hashes), 40)
    manager.remove_skipped_blocks("a", 40)
    manager.free("a")
    other = [BlockHash(bytes([0]))] + [BlockHash(bytes([100 + i])) for i in range(1, 8)] + [
        BlockHash(h) for h in hashes[8:]]  # second sink page differs, window pages match
    (hit,), length = SinkSlidingWindowManager.find_longest_cache_hit(other, 40, [0], pool, SPEC, False, BLOCK)
    assert length == BLOCK and len(hit) == 1  # only the cached first page remains


def test_sizing_counts_sink_pages():
    plain = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=1, head_size=8, dtype=torch.float32, sliding_window=7)
    assert SPEC.max_admission_blocks_per_request(8, 4096) == plain.max_admission_blocks_per_request(8, 4096) + 2
    assert KVCacheSpecRegistry.get_manager_class(SPEC) is SinkSlidingWindowManager
