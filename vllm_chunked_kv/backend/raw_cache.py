"""The raw pages of a CHUNKED_KV attention layer: a companion cache layer.

vLLM gives every layer registered in ``static_forward_context`` its own KV
cache spec, cache group, block table and metadata builder. Each CHUNKED_KV
attention layer registers one companion, ``<layer>.chunked_kv_raw``, whose
sliding-window spec of ``window + chunk_size - 1`` tokens holds the raw
rows (the pattern of DeepSeek-V4's compressor state caches). The spec is a
`RawWindowSpec` (`raw_window.py`): it also keeps leading rows for the whole
request (sinks, positions before staggered grid origins) and allocates no
page for rows that leave the window within their own step.

The companion's page holds as many rows as a compressed page holds states,
so both groups share vLLM's page size without padding. The attention layer
writes and reads the companion's cache itself; the companion never runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import KVCacheLayout, KVCacheSpec

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend import settings, step_link
from vllm_chunked_kv.backend.raw_window import RawWindowSpec

SUFFIX = ".chunked_kv_raw"


@dataclass
class RawPagesMetadata:
    """Per-step view of the raw pages: block table and the new tokens' slots."""

    block_table: torch.Tensor  # [num_reqs, max_raw_blocks]
    slot_mapping: torch.Tensor  # [num_tokens] flat raw slot of each new token
    block_size: int


class RawPagesMetadataBuilder(AttentionMetadataBuilder[RawPagesMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.ALWAYS  # slices only: nothing to wait for

    def __init__(self, kv_cache_spec: KVCacheSpec, layer_names: list[str], vllm_config: VllmConfig,
                 device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        assert isinstance(kv_cache_spec, RawWindowSpec)
        self.spec = kv_cache_spec

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> RawPagesMetadata:
        m = common_attn_metadata
        metadata = RawPagesMetadata(
            block_table=m.block_table_tensor[: m.num_reqs],
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            block_size=self.spec.block_size,
        )
        step_link.link_for(self.vllm_config).raw_built(m, self.layer_names, metadata)  # the plans wait for it
        return metadata


class PagedRows:
    """Capability-sheet entry shared by both page sets: the
    ``[num_blocks, num_kv_heads, rows, head_size + head_size_v]`` layout."""

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)


class RawPagesBackend(PagedRows, AttentionBackend):
    """What vLLM needs to allocate and describe the raw pages; no kernels."""

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        """Raw pages take any size of their own (asked with their spec). Asked
        about the model's block size (no spec: `Platform.update_block_size_for_backend`
        weighs every backend of the model), they follow the compressed pages'
        preference, so the two agree on it."""
        cfg = None if kv_cache_spec is not None else settings.active_config_or_none()
        return [MultipleOf(1 if cfg is None else layout.default_block_size(cfg))]

    @staticmethod
    def get_name() -> str:
        return "CHUNKED_KV_RAW"

    @staticmethod
    def get_impl_cls():
        raise NotImplementedError("the raw pages are written and read by the CHUNKED_KV layer")

    @staticmethod
    def get_builder_cls() -> type[RawPagesMetadataBuilder]:
        return RawPagesMetadataBuilder



class RawPagesLayer(torch.nn.Module, AttentionLayerBase):
    """Companion cache layer of one CHUNKED_KV attention layer."""

    def __init__(self, owner, cfg: ChunkedKVConfig, forever_raw: int, static_forward_context: dict) -> None:
        super().__init__()
        self.layer_name = owner.layer_name + SUFFIX
        self.num_kv_heads = owner.num_kv_heads
        self.head_size = owner.head_size
        self.head_size_v = owner.head_size_v
        self.dtype = owner.kv_cache_torch_dtype
        self.cfg = cfg
        self.forever_raw = forever_raw
        self.kv_cache = torch.tensor([])
        if self.layer_name in static_forward_context:
            raise ValueError(f"Duplicate layer name: {self.layer_name}")
        static_forward_context[self.layer_name] = self

    def get_attn_backend(self) -> type[AttentionBackend]:
        return RawPagesBackend

    def get_kv_cache_spec(self, vllm_config: VllmConfig) -> KVCacheSpec:
        cache = vllm_config.cache_config
        return raw_spec(self.cfg, cache.block_size, vllm_config.scheduler_config.max_num_batched_tokens,
                        bool(cache.enable_prefix_caching), cache.prefix_cache_retention_interval,
                        num_kv_heads=self.num_kv_heads, head_size=self.head_size, head_size_v=self.head_size_v,
                        dtype=self.dtype, sink_tokens=self.forever_raw)

    def forward(self):  # never called: the attention layer uses the cache
        raise NotImplementedError


def raw_spec(cfg: ChunkedKVConfig, block_size: int, max_step_tokens: int, prefix_caching: bool,
             retention_interval: int | None, **pages) -> RawWindowSpec:
    """The raw pages' spec for compressed pages of `block_size` tokens; `pages`:
    num_kv_heads, head_size, head_size_v, dtype and sink_tokens (the rows kept raw for good)."""
    states = layout.states_per_block(cfg, block_size)  # raw rows per page: the compressed page's states
    return RawWindowSpec(block_size=states, sliding_window=layout.raw_window(cfg), max_step_tokens=max_step_tokens,
                         prefix_caching=prefix_caching, retention_interval=retention_interval,
                         spare_pages=cfg.prefix_spare_pages, alignment_tokens=math.lcm(block_size, states), **pages)


def kept_tail_rows(cfg: ChunkedKVConfig, block_size: int, max_step_tokens: int, retention_interval: int | None) -> int:
    """Raw rows one step keeps for later prefix hits with prefix caching on (raw_window.py):
    what a capacity theory adds per request when prefix caching is on."""
    spec = raw_spec(cfg, block_size, max_step_tokens, True, retention_interval,
                    num_kv_heads=1, head_size=8, dtype=torch.float32)
    return spec.tail_rows_per_step()


def attach_raw_pages(impl, cfg: ChunkedKVConfig, forever_raw: int, static_forward_context: dict) -> RawPagesLayer:
    """Register the companion of the attention layer whose impl is `impl`."""
    owners = [layer for layer in list(static_forward_context.values()) if getattr(layer, "impl", None) is impl]
    if len(owners) != 1:
        raise RuntimeError(f"CHUNKED_KV: found {len(owners)} attention layers for one impl (expected 1)")
    return RawPagesLayer(owners[0], cfg, forever_raw, static_forward_context)
