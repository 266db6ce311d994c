"""Contract of the KV-head index under tensor parallelism (backend.layer_grid.global_kv_heads).

Staggered grid origins are defined per model-wide KV head (`h mod n`), so a
rank must look them up by the global index of the heads it holds:

- heads split across ranks: rank r holds heads r*local .. r*local+local-1,
  and the ranks' origins, concatenated, are the single-rank origins;
- fewer KV heads than ranks: vLLM replicates each head on world/total
  consecutive ranks (QKVParallelLinear: shard rank = tp_rank //
  num_kv_head_replicas), and each rank uses that head's origin.
"""

from __future__ import annotations

import pytest

from vllm_chunked_kv.backend.layer_grid import global_kv_heads
from vllm_chunked_kv.core.config import ChunkedKVConfig


@pytest.mark.parametrize("total, world", [(8, 1), (8, 2), (8, 4), (6, 2), (3, 3)])
def test_split_heads_concatenate_to_the_single_rank_origins(total, world):
    cfg = ChunkedKVConfig(mitigation="stagger", chunk_size=4)
    local = total // world
    whole = cfg.origins(0, total)
    ranks = [global_kv_heads(rank, world, local, total) for rank in range(world)]
    assert [h for heads in ranks for h in heads] == list(range(total))
    assert [whole[h] for heads in ranks for h in heads] == whole


@pytest.mark.parametrize("total, world", [(1, 2), (2, 4), (2, 8), (4, 8)])
def test_replicated_heads_follow_vllms_shard_rank(total, world):
    replicas = world // total
    assert [global_kv_heads(rank, world, 1, total) for rank in range(world)] == [
        [rank // replicas] for rank in range(world)
    ]
