"""A sliding-window KV cache spec that also keeps the first tokens forever.

`SinkSlidingWindowSpec` is vLLM's `SlidingWindowSpec` plus ``sink_tokens``:
the pages holding positions ``[0, sink_tokens)`` stay with the request for
its whole life, and a prefix-cache hit brings them along. CHUNKED_KV uses it
for the raw pages when sinks (DESIGN.md §3) or staggered grid origins
(§10, positions before a head's origin stay raw) need leading rows.

`SinkSlidingWindowManager` changes vLLM's `SlidingWindowManager` in exactly
those places: pages before the window are dropped from the first page after
the sinks on; a cache hit must find the sink pages cached as well (else it
shrinks to the cached prefix); sink pages are always cacheable; admission
and pool sizing count them. Both are registered with vLLM's
`KVCacheSpecRegistry` when this module is imported (the engine process
imports it when it unpickles a spec).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHashList, KVCacheBlock, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry


@dataclass(frozen=True, kw_only=True)
class SinkSlidingWindowSpec(SlidingWindowSpec):
    sink_tokens: int
    """Leading positions whose pages are never dropped."""

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size)

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        window = super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        return min(window + self.sink_blocks, cdiv(max_model_len, self.block_size) + 1)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(
            isinstance(spec, SinkSlidingWindowSpec)
            and (spec.sliding_window, spec.sink_tokens) == (self.sliding_window, self.sink_tokens)
            for spec in kv_cache_specs.values()
        )


class SinkSlidingWindowManager(SlidingWindowManager):
    def __init__(self, kv_cache_spec: SinkSlidingWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_blocks = cdiv(kv_cache_spec.sink_tokens, self.block_size)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        skipped = self.get_num_skipped_tokens(processed_computed_tokens) // self.block_size
        if request_id in self.req_to_blocks:
            skipped = min(skipped, len(self.req_to_blocks[request_id]))
            self._remove_blocks_in_range(request_id, self.sink_blocks, skipped)

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        needed = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, apply_admission_cap, prefill_end)
        if request_id in self.num_cached_block or not new_computed_blocks:
            return needed
        # The base class counts hit pages before the window as dropped; the
        # sink pages among them are kept, and may be eviction candidates too.
        skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        skipped_hits = max(0, skipped - len(self.req_to_blocks.get(request_id, ())))
        return needed + self._get_num_evictable_blocks(new_computed_blocks[: min(self.sink_blocks, skipped_hits)])

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        computed = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(computed) // self.block_size
        blocks = list(new_computed_blocks)
        if skipped > self.sink_blocks:
            assert len(blocks) >= self.sink_blocks, "a cache hit past the window must include the sink pages"
            blocks = blocks[: self.sink_blocks] + [self._null_block] * (skipped - self.sink_blocks) + blocks[skipped:]
        kept = [block for block in blocks if not block.is_null]
        if self.enable_caching:
            self.block_pool.touch(kept)
        else:
            assert not kept, "Computed blocks should be empty when prefix caching is disabled"
        req_blocks.extend(blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        assert not self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens), (
            "sliding-window hits end on a page boundary")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        computed, _ = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
            alignment_tokens, dcp_world_size, pcp_world_size)
        assert isinstance(kv_cache_spec, SinkSlidingWindowSpec)
        block_size = kv_cache_spec.block_size
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, block_size,
                                      alignment_tokens=alignment_tokens)
        for j in range(min(kv_cache_spec.sink_blocks, len(computed[0]))):
            if not computed[0][j].is_null:
                continue
            cached = block_pool.get_cached_block(hashes[j], kv_cache_group_ids)
            if cached is None:  # the hit can only be a wholly cached prefix [0, j)
                for blocks in computed:
                    del blocks[j:]
                while computed[0] and len(computed[0]) * block_size % alignment_tokens:
                    for blocks in computed:
                        blocks.pop()
                break
            for blocks, block in zip(computed, cached):
                blocks[j] = block
        return computed, len(computed[0]) * block_size

    @classmethod
    def reachable_block_mask(cls, start_block: int, end_block: int, alignment_tokens: int | None,
                             kv_cache_spec: KVCacheSpec, use_eagle: bool, retention_interval: int | None = None,
                             reachable_boundaries: Sequence[int] = (), dcp_world_size: int = 1,
                             final_segment_end_block: int | None = None) -> list[bool] | None:
        mask = super().reachable_block_mask(
            start_block, end_block, alignment_tokens, kv_cache_spec, use_eagle, retention_interval,
            reachable_boundaries, dcp_world_size, final_segment_end_block)
        if mask is None:
            return None
        assert isinstance(kv_cache_spec, SinkSlidingWindowSpec)
        for i in range(start_block, min(end_block, kv_cache_spec.sink_blocks)):
            mask[i - start_block] = True  # every hit needs the sink pages
        return mask


def register() -> None:
    """Add the spec to vLLM's registry (vLLM's own specs first: the registry
    fills itself only while empty)."""
    KVCacheSpecRegistry._ensure_registered()
    KVCacheSpecRegistry.register(SinkSlidingWindowSpec, SinkSlidingWindowManager,
                                 uniform_type_base_spec=SinkSlidingWindowSpec)


register()
