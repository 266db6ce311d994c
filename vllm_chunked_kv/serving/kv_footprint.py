"""KV-cache footprint of a served model: bytes per token with and without
chunked compression, and the token capacity vLLM allocated.

How the numbers are computed (also in docker/README.md):

- uncompressed bytes per token = K and V (2, or 1 for MLA's shared latent)
  x global layers x KV heads (all of them, summed over tensor-parallel
  ranks) x head size x bytes of the KV-cache dtype (`--kv-cache-dtype`, or
  the model dtype for "auto"). A layer with its own sliding window (a
  hybrid model's "sliding_attention" layers) holds a fixed number of rows
  per sequence whatever its length, so it adds nothing per token;
- compressed bytes per token (chunked_kv the active attention backend) =
  uncompressed / tokens_per_state, the tokens a stored row stands for in the
  compressed region of a long sequence (`ChunkedKVConfig.tokens_per_state`:
  hop, or chunk_size/3 with boundary retention). The raw window and the sink
  tokens add a constant per sequence, not a per-token cost. With any other
  backend nothing is compressed: compressed = uncompressed, ratio 1;
- capacity in tokens = vLLM's own `kv_cache_size_tokens` (group-aware, the
  figure it logs as "KV cache size"), or `num_gpu_blocks * block_size` when
  vLLM did not report it. Both come back from the engine at start-up and are
  synced into the API server's `cache_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from vllm_chunked_kv.backend import BACKEND_NAME, serves_some_layer


@dataclass(frozen=True)
class KVFootprint:
    uncompressed_bytes_per_token: int
    bytes_per_token: float
    compression_ratio: float
    capacity_tokens: int | None


def uncompressed_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_size: int, dtype_bytes: int, *, use_mla: bool = False
) -> int:
    """Bytes one token's K and V take over all layers and KV heads."""
    tensors = 1 if use_mla else 2  # MLA stores one latent row, not K and V
    heads = 1 if use_mla else num_kv_heads
    return tensors * num_layers * heads * head_size * dtype_bytes


def footprint(
    uncompressed: int, tokens_per_state: Fraction | int | None, capacity_tokens: int | None
) -> KVFootprint:
    """tokens_per_state None: compression is not active."""
    ratio = Fraction(1) if tokens_per_state is None else Fraction(tokens_per_state)
    return KVFootprint(
        uncompressed_bytes_per_token=uncompressed,
        bytes_per_token=float(uncompressed / ratio),
        compression_ratio=float(ratio),
        capacity_tokens=capacity_tokens,
    )


def attention_backend_name(vllm_config: Any) -> str:
    """The selected attention backend's name: CHUNKED_KV when it serves some
    layer (also through `backend_per_kind`), else `--attention-backend`, or
    "auto" when none was asked for."""
    if serves_some_layer(vllm_config):
        return BACKEND_NAME
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    if backend is None:
        return "auto"
    return str(getattr(backend, "name", backend))


def chunked_backend_active(vllm_config: Any) -> bool:
    """CHUNKED_KV serves some layer, by `--attention-backend` or `backend_per_kind`."""
    return serves_some_layer(vllm_config)


def kv_dtype_bytes(vllm_config: Any) -> int:
    from vllm.utils.torch_utils import get_dtype_size, kv_cache_dtype_str_to_dtype

    dtype = kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype, vllm_config.model_config)
    return get_dtype_size(dtype)


def capacity_tokens(cache_config: Any) -> int | None:
    reported = getattr(cache_config, "kv_cache_size_tokens", None)
    if reported:
        return int(reported)
    blocks, block_size = getattr(cache_config, "num_gpu_blocks", None), getattr(cache_config, "block_size", None)
    if blocks and block_size:
        return int(blocks) * int(block_size)
    return None


def global_layers(model_config: Any) -> int:
    """Layers whose cache grows with the sequence: all but those the model's
    `layer_types` name "sliding_attention" (hybrid models: Gemma 2/3, GPT-OSS)."""
    layer_types = getattr(getattr(model_config, "hf_text_config", None), "layer_types", None)
    if layer_types:
        return sum(kind != "sliding_attention" for kind in layer_types)
    return model_config.get_total_num_hidden_layers()


def footprint_from_vllm_config(vllm_config: Any, tokens_per_state: Fraction | int) -> KVFootprint:
    """The footprint of the served model; compression counted only when
    chunked_kv is the selected attention backend."""
    model = vllm_config.model_config
    uncompressed = uncompressed_bytes_per_token(
        num_layers=global_layers(model),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype_bytes=kv_dtype_bytes(vllm_config),
        use_mla=bool(getattr(model, "use_mla", False)),
    )
    active = chunked_backend_active(vllm_config)
    return footprint(uncompressed, tokens_per_state if active else None, capacity_tokens(vllm_config.cache_config))
