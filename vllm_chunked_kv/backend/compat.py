"""Every vLLM member this package relies on that is not a plugin interface.

vLLM 0.32 lets a plugin in through entry points (`vllm.general_plugins`,
stat loggers, endpoint plugins), `register_backend`, `KVCacheSpecRegistry`
and the attention-backend classes. CHUNKED_KV needs a few things beyond
them; each is reached through a function here, so a vLLM upgrade breaks in
this one file, and the list below says what to re-check
(docs/vllm-internals.md explains each in more words).

| member | used by | why |
| --- | --- | --- |
| `CpuPlatform.get_attn_backend_cls` (patched) | registration | the CPU platform ignores every selection but CPU_ATTN |
| `Platform.check_and_update_config` (patched) | registration | validate our settings in every process, before workers start |
| `AttentionBackendEnum` member `__reduce_ex__` | registration | a member added at run time must unpickle in a spawned engine |
| `KVCacheSpecRegistry._ensure_registered` | raw_window | vLLM's own specs must be in the registry before ours |
| `SingleTypeKVCacheManager._null_block` | raw_window | pages never stored map to vLLM's null block |
| `SingleTypeKVCacheManager._get_num_evictable_blocks` | raw_window | admission counts kept sink pages that are eviction candidates |
| `SingleTypeKVCacheManager._has_partial_local_hit` | raw_window | the same sanity check vLLM's sliding-window manager makes |
| `SlidingWindowManager._contiguous_blocks_for_hit` | raw_window | how many cached pages a hit needs before its end |
| `KVCacheManager.allocate_slots` (wrapped) | raw_window | managers see request ids only; the raw pages must know the shared-prefix junction when a step is allocated |
| `KVCacheManager.coordinator.single_type_managers`, `Request.shared_prefix_boundary` | raw_window | the same: where the junction is and whom to tell |
| `GPUModelRunner.__init__` (wrapped), `InputBatch.num_prompt_tokens_cpu_tensor` | alignment | `align` needs prompt lengths in the metadata builder |
| `EngineCore.preprocess_add_request` (wrapped), `EngineCoreRequest.cache_salt` | alignment | `align`: a prefix-cache salt per grid shift |
| one `CommonAttentionMetadata.query_start_loc_cpu` object for every cache group of a step, a new one each step (model runners V1 and V2) | step_link | the builder plans a layer once its raw pages' group of the same step is built |
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

TESTED_VLLM = "0.32.0"
_PATCH_MARK = "_chunked_kv_patched"


def vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def version_warning(version: str | None = None) -> str | None:
    """One line when the installed vLLM is not the release this package was tested with."""
    version = vllm_version() if version is None else version
    if version.split("+")[0] == TESTED_VLLM:
        return None
    return (f"vllm-chunked-kv was tested with vLLM {TESTED_VLLM}, this is vLLM {version}: "
            "if startup or serving fails, see docs/vllm-internals.md for what it relies on")


def check_version() -> None:
    """Log `version_warning` once per process (through vLLM's logger)."""
    message = version_warning()
    if message:
        from vllm.logger import init_logger

        init_logger("vllm.chunked_kv.compat").warning_once(message)


# ------------------------------------------------------------- class patches


def patch_classmethod(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace classmethod `cls.name` by `make(original)` once (idempotent):
    `make` gets the original function (taking `cls` first) and returns the
    new one with the same signature."""
    _patch(cls, name, getattr(cls, name).__func__, make, classmethod)


def patch_method(cls: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace method `cls.name` by `make(original)` once (idempotent), as `patch_classmethod`."""
    _patch(cls, name, getattr(cls, name), make, lambda function: function)


def _patch(cls: type, name: str, original: Callable, make: Callable[[Callable], Callable],
           bind: Callable[[Callable], object]) -> None:
    if getattr(original, _PATCH_MARK, False):
        return
    patched = make(original)
    setattr(patched, _PATCH_MARK, True)
    setattr(cls, name, bind(patched))


def make_enum_member_picklable(member, lookup: Callable[[str], object]) -> None:
    """Pickle `member` as a call ``lookup(member.name)`` (an instance attribute
    wins over the Enum class's reducer, for this member only)."""
    member.__reduce_ex__ = (lambda protocol=None: (lookup, (member.name,)))


# ------------------------------------------------------ KV-cache manager


def ensure_spec_registry() -> None:
    """Fill vLLM's spec registry with its own specs (it fills itself only while empty)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    KVCacheSpecRegistry._ensure_registered()


def null_block(manager):
    """vLLM's null block, what a page that is never stored maps to."""
    return manager._null_block


def num_evictable_blocks(manager, blocks: Sequence) -> int:
    """How many of `blocks` are cached pages nobody holds (allocating them takes one from the free pool)."""
    return manager._get_num_evictable_blocks(blocks)


def has_partial_local_hit(manager, blocks: Sequence, num_tokens: int) -> bool:
    return manager._has_partial_local_hit(blocks, num_tokens)


def blocks_for_hit(manager, window: int, block_size: int) -> int:
    """Cached pages a sliding-window hit needs right before its end, as vLLM counts them."""
    return manager._contiguous_blocks_for_hit(window, block_size, False)


def single_type_managers(kv_cache_manager) -> Sequence:
    """The per-group managers of vLLM's KV-cache manager."""
    return kv_cache_manager.coordinator.single_type_managers


def shared_prefix_boundary(request) -> int:
    """vLLM's shared-prefix junction of a request (0: none), set when its prefix hit is looked up."""
    return getattr(request, "shared_prefix_boundary", 0) or 0
