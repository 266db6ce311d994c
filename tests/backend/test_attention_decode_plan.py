"""The backend's decode path as CUDA graphs need it.

- `ChunkedKVMetadataBuilder.build` for a uniform decode batch, with the
  device-side plan on, and the plan built from its metadata wait for
  nothing: no ``.cpu()``, ``.item()``, ``.tolist()`` or truth value of a
  device tensor (`SyncGuard` fails on each); a mixed batch still reads its
  sequence lengths on the host, and on CPU counts its leading one-token
  requests, whose plan `build_mixed_plan` builds as a uniform batch. With `align`, the
  grid shifts come from the runner's prompt lengths (mod hop). On CPU (no graphs)
  the decode plan addresses only the pages the longest request has.
- The builder declares CUDA-graph support for uniform single-token decode
  exactly when the device-side plan is on (by default: on CUDA devices);
  the plan itself is on by default on CUDA and with the C++ CPU kernels,
  never for the PyTorch path on CPU, and ``python`` turns it off.
- In a real engine, greedy tokens with decodes planned on the device equal
  those of the Python plan for every mitigation and stagger:
  `tests/backend/test_scheduling_invariance.py`.
"""

from __future__ import annotations

import types

import pytest
import torch
from vllm.v1.attention.backend import AttentionCGSupport

from tests.ops.test_decode_plan import SyncGuard
from vllm_chunked_kv.backend import alignment
from vllm_chunked_kv.backend.attention import ChunkedKVMetadataBuilder, decode_plan_on_device
from vllm_chunked_kv.backend.layer_grid import LayerGrid
from vllm_chunked_kv.backend.raw_cache import RawPagesMetadata
from vllm_chunked_kv.backend.step_link import StepLink
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch


def _builder(device_plan: bool, cfg: ChunkedKVConfig | None = None) -> ChunkedKVMetadataBuilder:
    builder = ChunkedKVMetadataBuilder.__new__(ChunkedKVMetadataBuilder)  # no engine: only what build() reads
    builder.block_size, builder.device_decode_plan = 16, device_plan
    builder.config, builder.shift_buffer, builder.vllm_config = cfg or ChunkedKVConfig(), None, object()
    builder.ops = dispatch.Ops("cpp", None, None, None)  # reads no bias; no native planner: tensor ops
    builder.grids = {"layers.0.attn": LayerGrid((0, 2), builder.config, "layers.0.attn.chunked_kv_raw")}
    builder.link, builder.static = StepLink(), None
    return builder


def _common(seq_lens: list[int], query_lens: list[int]):
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
    guard = lambda t: t.as_subclass(SyncGuard)  # noqa: E731
    return types.SimpleNamespace(
        num_reqs=len(seq_lens), num_actual_tokens=sum(query_lens), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts, seq_lens=guard(torch.tensor(seq_lens)),
        block_table_tensor=guard(torch.arange(1, 8 * len(seq_lens) + 1).view(len(seq_lens), 8)),
    )


class _Runner:  # the model runner `alignment` reads prompt lengths from
    def __init__(self, prompt_lengths: list[int]) -> None:
        self.input_batch = types.SimpleNamespace(num_prompt_tokens_cpu_tensor=torch.tensor(prompt_lengths))


@pytest.mark.parametrize("align", ["none", "prompt_end"])
def test_uniform_decode_waits_for_nothing(align, monkeypatch):
    cfg = ChunkedKVConfig(mitigation="stagger", chunk_size=4, window=8, sink_tokens=2, align=align)
    builder = _builder(True, cfg)
    runner = _Runner([30, 7, 70])
    monkeypatch.setitem(alignment._runners, id(builder.vllm_config), runner)
    common = _common([40, 9, 77], [1, 1, 1])
    metadata = builder.build(0, common)
    assert (metadata.grid_shifts is None) == (align == "none")
    if metadata.grid_shifts is not None:
        assert metadata.grid_shifts.tolist() == [2, 3, 2]  # prompt length mod hop
    assert metadata.device_seq_lens is not None and metadata.seq_lens == []
    assert metadata.block_table.shape == (3, 5)  # on CPU, the pages of the longest request: 77 tokens / 16
    assert not metadata.layers  # planned once the raw pages' metadata of the same step is built
    raw = RawPagesMetadata(block_table=torch.arange(1, 25).view(3, 8).as_subclass(SyncGuard),
                           slot_mapping=torch.zeros(3, dtype=torch.long), block_size=16)
    builder.link.raw_built(common, ["layers.0.attn.chunked_kv_raw"], raw)  # the tensor-op plan, as on CUDA
    step = metadata.layers["layers.0.attn"]
    assert step.raw is raw and isinstance(step.plan.key_sets[0].num_slots, SyncGuard)


def test_mixed_batches_read_lengths_on_the_host():
    with pytest.raises(AssertionError, match="host synchronisation"):
        _builder(True).build(0, _common([40, 9], [1, 5]))
    builder = _builder(True)
    common = _common([40, 9, 12, 30], [1, 1, 5, 1])
    common.seq_lens = torch.tensor([40, 9, 12, 30])  # a plain tensor: the host read is allowed here
    assert builder.build(0, common).num_decodes == 2  # the leading one-token requests only
    assert _builder(False).build(0, common).num_decodes == 0  # the Python plan for the whole step
    with pytest.raises(AssertionError, match="host synchronisation"):
        _builder(False).build(0, _common([40, 9], [1, 1]))


def test_graph_support_follows_the_plan(monkeypatch):
    config = types.SimpleNamespace(device_config=types.SimpleNamespace(device="cpu"))
    assert ChunkedKVMetadataBuilder.get_cudagraph_support(config, None) == AttentionCGSupport.NEVER
    monkeypatch.setenv("CHUNKED_KV_DECODE_PLAN", "device")
    assert ChunkedKVMetadataBuilder.get_cudagraph_support(config, None) == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    monkeypatch.delenv("CHUNKED_KV_DECODE_PLAN")
    assert decode_plan_on_device(torch.device("cuda")) and not decode_plan_on_device(torch.device("cpu"))
    assert decode_plan_on_device(torch.device("cpu"), "cpp") and not decode_plan_on_device(torch.device("cpu"), "torch")
    monkeypatch.setenv("CHUNKED_KV_DECODE_PLAN", "python")
    assert not decode_plan_on_device(torch.device("cpu"), "cpp")
    monkeypatch.setenv("CHUNKED_KV_DECODE_PLAN", "sometimes")
    with pytest.raises(ValueError, match="CHUNKED_KV_DECODE_PLAN"):
        decode_plan_on_device(torch.device("cpu"))
