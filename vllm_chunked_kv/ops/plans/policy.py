"""Which plan a step gets: the one branch between the three ways to plan it.

- a uniform decode batch (every request computes one token) whose sequence
  lengths stay on the device: `decode_plan.build_decode_plan`, tensor
  arithmetic without a host sync (what CUDA graphs capture), or one C++ call
  on CPU;
- a step whose leading requests are decodes and the rest prefill pieces
  (vLLM puts decodes first when a backend asks): `decode_plan.build_mixed_plan`;
- anything else: `step_plan.build_plan`, on the host.

`decode_plan_on_device` says when the first two are used; the metadata
builder asks it once, and `plan_step` once per step and grid.
"""

from __future__ import annotations

import os
from types import ModuleType

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops.plans.decode_plan import build_decode_plan, build_mixed_plan
from vllm_chunked_kv.ops.plans.step_plan import PagedBatch, StepPlan, build_plan

DECODE_PLAN_ENV = "CHUNKED_KV_DECODE_PLAN"


def decode_plan_on_device(device: torch.device, impl: str | None = None, cfg: ChunkedKVConfig | None = None) -> bool:
    """Whether uniform decode batches get the device-side plan
    (`decode_plan.py`): ``CHUNKED_KV_DECODE_PLAN`` = ``device`` |
    ``python``, or by default on CUDA devices (CUDA graphs) and with the C++
    CPU kernels (`impl` ``cpp``: it takes about half the Python plan's time
    at batch 8 and a fifth at batch 64, benchmarks/README.md, and the kernel
    reads only the visible slots; the PyTorch path would gather every
    addressable one). Never with dynamic boundaries (`cfg`), whose unit
    writes are planned in Python."""
    choice = os.environ.get(DECODE_PLAN_ENV, "auto").strip().lower()
    if choice not in ("auto", "device", "python"):
        raise ValueError(f"{DECODE_PLAN_ENV}={choice!r}: choose auto, device or python")
    if cfg is not None and cfg.boundaries == "dynamic":
        return False
    return choice == "device" or (choice == "auto" and (device.type == "cuda" or impl == "cpp"))


def plan_step(batch: PagedBatch, cfg: ChunkedKVConfig, origins: list[int], *, bias: bool,
              device_seq_lens: torch.Tensor | None = None, device_shifts: torch.Tensor | None = None,
              num_decodes: int = 0, native: ModuleType | None = None) -> StepPlan:
    """The plan of one step for KV heads with grid `origins`. `batch` holds
    the host view (its `seq_lens` empty when the lengths stay on the
    device); `device_seq_lens` ``[b]`` (and `device_shifts` ``[b]``, the
    `align` shifts) make it a uniform decode batch planned on the device;
    `num_decodes` > 0 plans that many leading decodes as one. `bias`: the
    attention reads the dense bias (the PyTorch path); `native`: the C++
    extension that builds decode plans in one call, or None."""
    if device_seq_lens is not None:
        return build_decode_plan(device_seq_lens, batch.block_table, batch.block_size, batch.raw_block_table,
                                 batch.raw_block_size, cfg, origins, bias=bias, grid_shifts=device_shifts,
                                 native=native)
    if num_decodes:
        return build_mixed_plan(batch, num_decodes, cfg, origins, bias=bias, native=native)
    return build_plan(batch, cfg, origins, bias=bias)
