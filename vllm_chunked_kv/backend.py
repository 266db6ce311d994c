"""CHUNKED_KV attention backend: vLLM's four roles in one file.

- `ChunkedKVBackend`: the capability sheet vLLM selects on.
- `ChunkedKVMetadata`: per-batch tensors every layer reads.
- `ChunkedKVMetadataBuilder`: turns vLLM's common metadata into ours.
- `ChunkedKVImpl`: writes K/V into the paged cache and computes attention.

Page layout (per layer): `kv_cache[num_blocks, num_kv_heads, block_size,
head_size + head_size_v]`, keys first, then values (vLLM's LBHNC layout).
Attention runs in plain PyTorch (`ops/paged.py`): decode rows of the batch in
one batched call, each prefill (or chunked-prefill piece) in one call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import ClassVar

import torch
from vllm.config import VllmConfig, get_current_vllm_config
from vllm.logger import init_logger
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionLayer,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from vllm_chunked_kv.ops import paged
from vllm_chunked_kv.registration import BACKEND_NAME

logger = init_logger("vllm.chunked_kv.backend")  # under "vllm" so it uses vLLM's log handler


class ChunkedKVBackend(AttentionBackend):
    """Capability sheet: what vLLM may ask of CHUNKED_KV."""

    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "float16", "bfloat16", "float32"]

    @staticmethod
    def get_name() -> str:
        return BACKEND_NAME

    @staticmethod
    def get_impl_cls() -> type[ChunkedKVImpl]:
        return ChunkedKVImpl

    @staticmethod
    def get_builder_cls() -> type[ChunkedKVMetadataBuilder]:
        return ChunkedKVMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec=None) -> list[int | MultipleOf]:
        return [MultipleOf(1)]

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def validate_selector_config(cls, selector) -> list[str]:
        """Readable reasons why this backend cannot serve `selector` (empty: it can)."""
        fields = selector._asdict()
        reasons = cls.validate_configuration(device_capability=None, **fields)
        if fields.get("kv_cache_dtype") not in (None, *cls.supported_kv_cache_dtypes):
            reasons.append(f"kv_cache_dtype {fields['kv_cache_dtype']!r} (quantised KV) is not supported")
        return reasons

    @classmethod
    def supports_compute_capability(cls, capability) -> bool:
        return True


@dataclass
class ChunkedKVMetadata:
    """Per-batch tensors, shared by every layer of the KV-cache group."""

    num_actual_tokens: int
    slot_mapping: torch.Tensor  # [num_tokens] flat slot of each new token
    batch: paged.PagedBatch  # request layout: starts, lengths, block table


class ChunkedKVMetadataBuilder(AttentionMetadataBuilder[ChunkedKVMetadata]):
    def __init__(
        self,
        kv_cache_spec: AttentionSpec,
        layer_names: list[str],
        vllm_config: VllmConfig,
        device: torch.device,
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = kv_cache_spec.block_size

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: CommonAttentionMetadata,
        fast_build: bool = False,
    ) -> ChunkedKVMetadata:
        m = common_attn_metadata
        batch = paged.PagedBatch.from_vllm(
            query_start_loc=m.query_start_loc_cpu[: m.num_reqs + 1],
            seq_lens=m.seq_lens[: m.num_reqs].cpu(),
            block_table=m.block_table_tensor[: m.num_reqs],
            block_size=self.block_size,
        )
        return ChunkedKVMetadata(
            num_actual_tokens=m.num_actual_tokens,
            slot_mapping=m.slot_mapping[: m.num_actual_tokens],
            batch=batch,
        )


class ChunkedKVImpl(AttentionImpl[ChunkedKVMetadata]):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        unsupported = {
            "ALiBi": alibi_slopes is not None,
            "a model sliding window": sliding_window is not None,
            "logit soft-capping": bool(logits_soft_cap),
            "KV sharing across layers": kv_sharing_target_layer_name is not None,
            "learned attention sinks": sinks is not None,
            f"attention type {attn_type}": attn_type != AttentionType.DECODER,
        }
        bad = [name for name, present in unsupported.items() if present]
        if bad:
            raise NotImplementedError(f"{BACKEND_NAME} does not support " + ", ".join(bad))
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        from vllm_chunked_kv.config import ChunkedKVConfig

        vllm_config = get_current_vllm_config()
        self.config = ChunkedKVConfig.from_additional_config(vllm_config.additional_config)
        self._total_kv_heads = vllm_config.model_config.get_total_num_kv_heads()
        self._origins_cache: torch.Tensor | None = None
        logger.info_once("Using %s attention backend with %s", BACKEND_NAME, json.dumps(self.config.describe()))

    def _origins(self, layer, device) -> torch.Tensor:
        """Grid origin of each local KV head (global head index under TP)."""
        if self._origins_cache is None:
            from vllm.distributed import get_tensor_model_parallel_rank
            from vllm.model_executor.models.utils import extract_layer_index

            layer_idx = extract_layer_index(layer.layer_name)
            first = get_tensor_model_parallel_rank() * self.num_kv_heads
            total = self._total_kv_heads
            all_origins = self.config.origins(layer_idx, total)
            local = [all_origins[(first + h) % total] for h in range(self.num_kv_heads)]
            self._origins_cache = torch.tensor(local, dtype=torch.long, device=device)
        return self._origins_cache

    def forward(
        self,
        layer: AttentionLayer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: ChunkedKVMetadata | None,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError(f"{BACKEND_NAME} does not support fused output quantisation")
        if attn_metadata is None:  # profiling run
            return output
        n = attn_metadata.num_actual_tokens
        query = query[:n].view(n, self.num_heads, self.head_size)  # [n, Hq, D]
        key = key[:n].view(n, self.num_kv_heads, self.head_size)  # [n, Hkv, D]
        value = value[:n].view(n, self.num_kv_heads, -1)  # [n, Hkv, Dv]
        paged.write_tokens(kv_cache, key, value, attn_metadata.slot_mapping)
        origins = self._origins(layer, query.device)
        out = paged.attend(query, kv_cache, attn_metadata.batch, self.scale, self.config, origins)  # [n, Hq, Dv]
        output[:n].view_as(out).copy_(out)
        return output
