"""Contract of `ops.plans.policy`: `plan_step` takes the device-side decode
plan when the sequence lengths stay on the device, the mixed plan when
leading decodes are counted, else the host plan (each checked by the
builder that ran, and by the plan equalling that builder's own);
`decode_plan_on_device` follows ``CHUNKED_KV_DECODE_PLAN`` and refuses a
bad value, and never plans dynamic boundaries on the device."""

from __future__ import annotations

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans import policy
from vllm_chunked_kv.ops.plans.step_plan import PagedBatch

CFG = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2)


def _batch(query_lens: list[int], seq_lens: list[int]) -> PagedBatch:
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    rows = max(len(seq_lens), len(query_lens))
    table = torch.arange(1, 8 * rows + 1).view(rows, 8)  # 8 compressed pages of 16 tokens
    raw_table = torch.arange(1, 16 * rows + 1).view(rows, 16)  # 16 raw pages of 4 rows (a page's states)
    return PagedBatch(query_start=starts, seq_lens=seq_lens, block_table=table, block_size=16,
                      raw_block_table=raw_table, raw_block_size=4)


@pytest.mark.parametrize("case, expected", [("device", "build_decode_plan"), ("mixed", "build_mixed_plan"),
                                            ("host", "build_plan")])
def test_each_step_gets_its_plan(monkeypatch, case, expected):
    ran = []
    for name in ("build_decode_plan", "build_mixed_plan", "build_plan"):
        original = getattr(policy, name)
        monkeypatch.setattr(policy, name, lambda *a, _f=original, _n=name, **k: ran.append(_n) or _f(*a, **k))
    if case == "device":
        batch = _batch([1, 1], [])
        plan = policy.plan_step(batch, CFG, [0, 0], bias=False, device_seq_lens=torch.tensor([40, 9]))
    elif case == "mixed":
        plan = policy.plan_step(_batch([1, 5], [40, 12]), CFG, [0, 0], bias=False, num_decodes=1)
    else:
        plan = policy.plan_step(_batch([1, 5], [40, 12]), CFG, [0, 0], bias=False)
    assert ran[0] == expected and plan.key_sets


def test_decode_plan_on_device_follows_the_setting(monkeypatch):
    assert policy.decode_plan_on_device(torch.device("cuda"))
    assert policy.decode_plan_on_device(torch.device("cpu"), "cpp")
    assert not policy.decode_plan_on_device(torch.device("cpu"), "torch")
    assert not policy.decode_plan_on_device(torch.device("cuda"), cfg=ChunkedKVConfig(boundaries="dynamic",
                                                                                      chunk_size=4, min_chunk=2))
    monkeypatch.setenv(policy.DECODE_PLAN_ENV, "python")
    assert not policy.decode_plan_on_device(torch.device("cuda"))
    monkeypatch.setenv(policy.DECODE_PLAN_ENV, "device")
    assert policy.decode_plan_on_device(torch.device("cpu"), "torch")
    monkeypatch.setenv(policy.DECODE_PLAN_ENV, "often")
    with pytest.raises(ValueError, match=policy.DECODE_PLAN_ENV):
        policy.decode_plan_on_device(torch.device("cpu"))
