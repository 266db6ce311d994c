"""Contract of `backend.static_plans.StaticPlans`: a decode plan held for CUDA
graphs keeps every tensor at the same address from step to step for the same
batch size (what a replayed graph reads), holds this step's values (equal to
the plan as built), and starts its memo empty; a smaller batch reads the
front of the same buffers."""

from __future__ import annotations

import torch

from vllm_chunked_kv.backend.static_plans import StaticPlans
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan

CFG = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2, mitigation="boundary")


def _plan(seq_lens: list[int]):
    b = len(seq_lens)
    table = torch.arange(1, 8 * b + 1).view(b, 8)
    raw = torch.arange(1, 32 * b + 1).view(b, 32)
    return build_decode_plan(torch.tensor(seq_lens), table, 16, raw, 4, CFG, [0, 2], bias=False)


def _tensors(plan) -> list[torch.Tensor]:
    keys = plan.key_sets[0]
    return [plan.raw_writes, plan.writes.heads, plan.writes.dst_blocks, keys.query_positions, keys.raw_blocks,
            keys.num_raw, keys.comp_blocks, keys.num_slots, keys.origins]


def test_same_addresses_this_steps_values():
    static = StaticPlans(max_requests=8)
    first_plan, second_plan = _plan([40, 9, 77]), _plan([41, 10, 78])
    first = static.hold("grid", first_plan, 3)
    first_ptrs = [t.data_ptr() for t in _tensors(first)]
    second = static.hold("grid", second_plan, 3)
    assert [t.data_ptr() for t in _tensors(second)] == first_ptrs
    for held, built in zip(_tensors(second), _tensors(second_plan)):
        assert torch.equal(held, built)
    assert second.memo == {} and second.writes.memo == {}
    smaller = static.hold("grid", _plan([12, 5]), 2)
    assert [t.data_ptr() for t in _tensors(smaller)] == first_ptrs  # the front of the same buffers
