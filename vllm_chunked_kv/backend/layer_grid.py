"""Each layer's grid as its step plan depends on it: the grid origin of each
KV head this tensor-parallel rank holds (docs/design.md §10: origins are
set per model-wide head index), the settings it pools with, and its raw
pages' companion layer. The metadata builder reads them once for its group.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend.raw_cache import SUFFIX as RAW_SUFFIX


@dataclass(frozen=True)
class LayerGrid:
    """A layer of the group as its plan depends on it."""

    origins: tuple[int, ...]  # grid origin of each local KV head (global head index under TP)
    cfg: ChunkedKVConfig  # `ChunkedKVConfig.for_layer`
    raw_name: str  # its raw pages' companion layer


def layer_grids(cfg: ChunkedKVConfig, layer_names: list[str], local_kv_heads: int,
                total_kv_heads: int) -> dict[str, LayerGrid]:
    """Each layer's grid origins for the KV heads this tensor-parallel rank
    holds, its pooling settings and its raw pages' companion."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
    from vllm.model_executor.models.utils import extract_layer_index

    heads = global_kv_heads(get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size(),
                            local_kv_heads, total_kv_heads)
    grids = {}
    for name in layer_names:
        index = extract_layer_index(name)
        all_origins = cfg.origins(index, total_kv_heads)
        grids[name] = LayerGrid(tuple(all_origins[h] for h in heads), cfg.for_layer(index), name + RAW_SUFFIX)
    return grids


def global_kv_heads(rank: int, world: int, local: int, total: int) -> list[int]:
    """Model-wide index of each KV head a tensor-parallel rank holds: a slice of
    `local` heads when the heads split across ranks, else (fewer heads than
    ranks) the one head vLLM replicates on `world / total` consecutive ranks."""
    if total >= world:
        return [rank * local + h for h in range(local)]
    return [rank * total // world]
