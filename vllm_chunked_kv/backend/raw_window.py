"""The KV cache spec and manager of CHUNKED_KV's raw pages.

`RawWindowSpec` is vLLM's `SlidingWindowSpec` with two changes, carried out
by `RawWindowManager` (a `SlidingWindowManager`):

- **sinks**: the pages holding positions ``[0, sink_tokens)`` stay with the
  request for its whole life, and a prefix-cache hit brings them along (a
  hit whose sink pages are not cached shrinks to the cached prefix). CHUNKED_KV
  keeps sinks (docs/design.md §3) and the positions before a staggered grid
  origin (§10) there.
- **no pages for rows that leave the window within their own step**: a step
  computing positions ``[start, end)`` needs stored rows only from ``end -
  sliding_window + 1`` on (the step reads its own rows from its K/V
  tensors), so pages wholly before that get the null block instead of a
  page. vLLM's sliding-window manager allocates pages for every token of a
  step and reserves ``max_num_batched_tokens`` more tokens per request for it;
  here a request holds at most the sink pages, the window before the step,
  and one window per step in flight.
- **prefix-cache tails**: with prefix caching on, a later request can only
  hit a prefix whose last ``sliding_window - 1`` raw rows are cached (the
  "tail" before the hit point). A step keeps the pages of the tail before
  the last aligned boundary it reaches (a prompt's replay boundary: resends
  and chat turns hit there) and, with vLLM's
  ``--prefix-cache-retention-interval N``, the tail before every N-th token
  (``None``: every row). A request whose prompt shares a prefix with an
  earlier one that the raw pages could not serve (vLLM's shared-prefix
  junction: the compressed pages hit further than the raw tails) also keeps
  the tail before that junction, so the next request sharing the prefix
  hits it. These pages are written in full, cached, and freed to the pool as
  evictable pages once they leave the window (docs/prefix-caching.md).
- **spare pages**: with prefix caching on, a step whose pages all fit while
  at least half the pool stays free keeps every raw row it computes (as with
  retention interval None), so any page-aligned prefix of a recent prompt
  hits, like full attention. These pages are not reserved (pool sizing and
  admission ignore them): under memory pressure, or with the setting
  ``prefix_spare_pages`` off, only the tails above are kept.

Both are registered with vLLM's `KVCacheSpecRegistry` when this module is
imported (the engine process imports it when it unpickles a spec).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import groupby

from vllm.utils.math_utils import cdiv
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import BlockHashList, KVCacheBlock, resolve_block_hashes
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import KVCacheSpec, SlidingWindowSpec
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

from vllm_chunked_kv.backend import compat


@dataclass(frozen=True, kw_only=True)
class RawWindowSpec(SlidingWindowSpec):
    sink_tokens: int = 0
    """Leading positions whose pages are never dropped."""
    max_step_tokens: int
    """Most tokens one step computes (vLLM's max_num_batched_tokens)."""
    prefix_caching: bool = False
    """Keep the raw tails later requests need to hit a prefix (vLLM's prefix caching is on)."""
    retention_interval: int | None = 0
    """vLLM's prefix_cache_retention_interval: 0 keeps only the tail at the end
    of each step, N also one every N tokens, None every row."""
    spare_pages: bool = True
    """With prefix caching on, keep a step's every page while the pool stays half free (not reserved)."""
    alignment_tokens: int = 1
    """vLLM's prefix-hit granularity over all cache groups (for sizing only)."""

    @property
    def sink_blocks(self) -> int:
        return cdiv(self.sink_tokens, self.block_size)

    def tail_rows_per_step(self) -> int:
        """Raw rows of one step kept for prefix hits beyond its window (see the module docstring)."""
        if not self.prefix_caching:
            return 0
        if self.retention_interval is None:
            return self.max_step_tokens
        tail = self.sliding_window - 1 + self.block_size
        periodic = cdiv(self.max_step_tokens, self.retention_interval) if self.retention_interval else 0
        return self.alignment_tokens + (periodic + 1) * tail  # + 1: a shared-prefix junction's tail

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int, max_model_len: int) -> int:
        """Sink pages, the window's pages before the oldest step in flight,
        and per step in flight the pages of its own window and its prefix-cache tails."""
        window = min(self.sliding_window - 1, max_model_len)
        steps = max(1, cdiv(max_in_flight_tokens, self.max_step_tokens))
        step_rows = min(self.max_step_tokens, window + self.tail_rows_per_step(), max_model_len)
        per_step = cdiv(step_rows, self.block_size) + 1
        held = self.sink_blocks + cdiv(window, self.block_size) + 1 + steps * per_step
        return min(held, cdiv(max_model_len, self.block_size) + 1)

    def is_uniform_with_collection(self, kv_cache_specs: dict[str, KVCacheSpec]) -> bool:
        return all(isinstance(spec, RawWindowSpec) and spec == self for spec in kv_cache_specs.values())


class RawWindowManager(SlidingWindowManager):
    def __init__(self, kv_cache_spec: RawWindowSpec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self.sink_blocks = cdiv(kv_cache_spec.sink_tokens, self.block_size)
        self._dropped_until: dict[str, int] = {}  # per request: pages [sink_blocks, n) are null
        self._junctions: dict[str, int] = {}  # per request: vLLM's shared-prefix junction, in tokens
        self._spare: set[str] = set()  # requests whose counted step keeps every page (see `_has_room`)
        self._cache_every_page: set[str] = set()  # requests whose step kept every page, until it is cached

    def note_junction(self, request_id: str, boundary: int) -> None:
        """Record the request's shared-prefix junction (0: none) before its step is allocated."""
        if boundary:
            self._junctions[request_id] = boundary
        else:
            self._junctions.pop(request_id, None)

    def _dead_until(self, num_tokens_main_model: int) -> int:
        """Pages wholly before the window at the end of a step are never stored."""
        return max(0, num_tokens_main_model - self.sliding_window + 1) // self.block_size

    def _live(self, request_id: str, lo: int, hi: int, num_tokens_main_model: int,
              spare: bool = False) -> list[bool]:
        """Which of the pages [lo, hi) of a step ending at `num_tokens_main_model` get a page:
        the sinks, the window at the end of the step and the prefix-cache tails (every page if `spare`)."""
        spec: RawWindowSpec = self.kv_cache_spec
        keep_from = self._dead_until(num_tokens_main_model)
        interval = 0  # no periodic tails without prefix caching
        junction_tail = range(0)  # pages of the tail before the request's shared-prefix junction
        if spec.prefix_caching:
            interval = spec.retention_interval
            if interval is None or spare:
                return [True] * (hi - lo)
            align = self.cache_hit_alignment_tokens
            replay = (num_tokens_main_model - 1) // align * align // self.block_size  # page of the last boundary
            keep_from = min(keep_from, max(0, replay - self._tail_blocks()))
            junction = self._junctions.get(request_id, 0) // align * align // self.block_size
            junction_tail = range(max(0, junction - self._tail_blocks()), junction)
        return [p < self.sink_blocks or p >= keep_from or p in junction_tail or self._in_tail(p, interval)
                for p in range(lo, hi)]

    def _tail_blocks(self) -> int:
        """Cached pages a prefix hit needs right before its (page-aligned) end, as vLLM counts them."""
        return compat.blocks_for_hit(self, self.sliding_window, self.block_size)

    def _in_tail(self, page: int, interval: int) -> bool:
        """Whether `page` lies in the tail before a multiple of `interval` tokens (0: never)."""
        if not interval:
            return False
        boundary = cdiv((page + 1) * self.block_size, interval) * interval  # first boundary at or after the page
        return page >= boundary // self.block_size - self._tail_blocks()

    # ------------------------------------------------------------ dropping

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        skipped = min(self.get_num_skipped_tokens(processed_computed_tokens) // self.block_size, len(blocks))
        start = max(self.sink_blocks, self._dropped_until.get(request_id, 0))
        freed = [blocks[i] for i in range(skipped - 1, start - 1, -1) if not blocks[i].is_null]
        for i in range(start, skipped):
            blocks[i] = compat.null_block(self)
        if freed:
            self.block_pool.free_blocks(freed)
        self._dropped_until[request_id] = max(start, skipped)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        self._dropped_until.pop(request_id, None)
        self._junctions.pop(request_id, None)
        self._spare.discard(request_id)
        self._cache_every_page.discard(request_id)
        return super().pop_blocks_for_free(request_id)

    # ---------------------------------------------------------- allocating

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: Sequence[KVCacheBlock], total_computed_tokens: int,
                                   num_local_computed_tokens: int, num_tokens_main_model: int,
                                   apply_admission_cap: bool = False, prefill_end: int = 0) -> int:
        needed = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
            num_tokens_main_model, apply_admission_cap, prefill_end)
        held = len(self.req_to_blocks.get(request_id, ()))
        running = request_id in self.num_cached_block
        if not running and new_computed_blocks:
            # The base class counts hit pages before the window as dropped; the
            # sink pages among them are kept, and may be eviction candidates.
            skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
            kept_sinks = new_computed_blocks[: min(self.sink_blocks, max(0, skipped - held))]
            needed += compat.num_evictable_blocks(self, kept_sinks)
        if apply_admission_cap:
            return needed  # the whole-sequence admission gate: bounded by the spec's cap
        if not running:
            skipped = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
            held = max(skipped if skipped > self.sink_blocks else 0, held + len(new_computed_blocks))
        dead = self._live(request_id, held, cdiv(num_tokens, self.block_size), num_tokens_main_model).count(False)
        self._spare.discard(request_id)
        if dead and self._has_room(needed):
            self._spare.add(request_id)  # `allocate_new_blocks` gives this step every page, as counted here
            return needed
        return needed - dead

    def _has_room(self, pages: int) -> bool:
        """Whether a step may keep all its `pages` as spare prefix-cache pages:
        prefix caching and spare pages are on and at least half the pool stays free after them."""
        spec: RawWindowSpec = self.kv_cache_spec
        pool = self.block_pool
        return (spec.prefix_caching and spec.spare_pages
                and pool.get_num_free_blocks() - pages >= pool.num_gpu_blocks // 2)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        req_blocks = self.req_to_blocks[request_id]
        held = len(req_blocks)
        spare = request_id in self._spare
        self._spare.discard(request_id)
        if spare:
            self._cache_every_page.add(request_id)
        live = self._live(request_id, held, cdiv(num_tokens, self.block_size), num_tokens_main_model, spare)
        if all(live):
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        # The worker appends the returned ids to its block table: nulls included, in order.
        new: list[KVCacheBlock] = []
        page = held
        for is_live, run in groupby(live):
            count = len(list(run))
            if is_live:
                end = min((page + count) * self.block_size, num_tokens)
                new += super().allocate_new_blocks(request_id, end, num_tokens_main_model)
            else:
                nulls = [compat.null_block(self)] * count
                req_blocks.extend(nulls)
                new += nulls
            page += count
        return new

    # -------------------------------------------------------- prefix cache

    def cache_blocks(self, request, num_tokens: int, retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        """vLLM caches only the pages its retention interval can reach; a step
        that kept spare pages has them all cached (as with interval None)."""
        if request.request_id in self._cache_every_page:
            self._cache_every_page.discard(request.request_id)
            retention_interval = None
        super().cache_blocks(request, num_tokens, retention_interval, replay_boundaries=replay_boundaries)

    def add_local_computed_blocks(self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int, num_external_computed_tokens: int) -> None:
        req_blocks = self.req_to_blocks[request_id]
        assert not req_blocks
        computed = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(computed) // self.block_size
        blocks = list(new_computed_blocks)
        if skipped > self.sink_blocks:
            assert len(blocks) >= self.sink_blocks, "a cache hit past the window must include the sink pages"
            blocks = blocks[: self.sink_blocks] + [compat.null_block(self)] * (skipped - self.sink_blocks) + blocks[skipped:]
            self._dropped_until[request_id] = skipped
        kept = [block for block in blocks if not block.is_null]
        if self.enable_caching:
            self.block_pool.touch(kept)
        else:
            assert not kept, "Computed blocks should be empty when prefix caching is disabled"
        req_blocks.extend(blocks)
        self.num_cached_block[request_id] = len(req_blocks)
        assert not compat.has_partial_local_hit(self, new_computed_blocks, num_local_computed_tokens), (
            "sliding-window hits end on a page boundary")

    @classmethod
    def find_longest_cache_hit(cls, block_hashes: BlockHashList, max_length: int, kv_cache_group_ids: list[int],
                               block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
                               alignment_tokens: int, dcp_world_size: int = 1,
                               pcp_world_size: int = 1) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        computed, _ = super().find_longest_cache_hit(
            block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec, drop_eagle_block,
            alignment_tokens, dcp_world_size, pcp_world_size)
        assert isinstance(kv_cache_spec, RawWindowSpec)
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
        assert isinstance(kv_cache_spec, RawWindowSpec)
        for i in range(start_block, min(end_block, kv_cache_spec.sink_blocks)):
            mask[i - start_block] = True  # every hit needs the sink pages
        return mask


def _tell_junctions(allocate_slots):
    """vLLM's `KVCacheManager.allocate_slots`, first telling each raw-window
    manager the request's shared-prefix junction (managers see only request ids)."""
    def allocate_slots_with_junction(kv_cache_manager, request, *args, **kwargs):
        junction = compat.shared_prefix_boundary(request)
        for manager in compat.single_type_managers(kv_cache_manager):
            if isinstance(manager, RawWindowManager):
                manager.note_junction(request.request_id, junction)
        return allocate_slots(kv_cache_manager, request, *args, **kwargs)
    return allocate_slots_with_junction


def register() -> None:
    """Add the spec to vLLM's registry (vLLM's own specs first: the registry
    fills itself only while empty), and let the managers see junctions."""
    compat.ensure_spec_registry()
    KVCacheSpecRegistry.register(RawWindowSpec, RawWindowManager, uniform_type_base_spec=RawWindowSpec)
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    compat.patch_method(KVCacheManager, "allocate_slots", _tell_junctions)


register()
