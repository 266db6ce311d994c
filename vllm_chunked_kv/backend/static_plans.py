"""Step plans at fixed addresses, for CUDA graphs.

A full CUDA graph of a decode step (vLLM captures one per batch size when a
backend declares `UNIFORM_SINGLE_TOKEN_DECODE`) replays the attention
kernels on the tensors they read at capture. The metadata builder plans
each step before the graph runs, in fresh tensors; `StaticPlans.hold`
copies a plan's tensors into buffers that keep their address from step to
step (one set per grid and raw group, sized for `max_num_seqs` requests),
so that a replay reads this step's plan. Eager steps (CPU, prefill pieces)
use the plan as built.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass, replace

import torch

from vllm_chunked_kv.ops.plans.step_plan import StepPlan


class StaticPlans:
    def __init__(self, max_requests: int) -> None:
        self.max_requests = max_requests
        self._buffers: dict[tuple, torch.Tensor] = {}

    def hold(self, key, plan: StepPlan, num_requests: int) -> StepPlan:
        """`plan` with each tensor copied into its buffer for (`key`, its place
        in the plan); a tensor of ``k * num_requests`` rows gets a buffer of
        ``k * max_requests`` rows, of which it fills the first."""
        return self._hold((key,), plan, num_requests)

    def _hold(self, path: tuple, value, num_requests: int):
        if isinstance(value, torch.Tensor):
            return self._copy(path, value, num_requests)
        if isinstance(value, list):
            return [self._hold(path + (i,), item, num_requests) for i, item in enumerate(value)]
        if is_dataclass(value) and not isinstance(value, type):
            changed = {f.name: self._hold(path + (f.name,), getattr(value, f.name), num_requests)
                       for f in fields(value) if f.init}
            return replace(value, **changed)  # memo and derived fields start empty
        return value

    def _copy(self, path: tuple, tensor: torch.Tensor, num_requests: int) -> torch.Tensor:
        if tensor.dim() == 0:
            rows = None
        else:
            per_request = tensor.shape[0] // num_requests if num_requests and tensor.shape[0] % num_requests == 0 else 0
            rows = max(tensor.shape[0], per_request * self.max_requests)
        key = path + (tensor.dtype, tuple(tensor.shape[1:]), tensor.device)
        buffer = self._buffers.get(key)
        if buffer is None or (rows is not None and buffer.shape[0] < tensor.shape[0]):
            shape = tensor.shape if rows is None else (rows, *tensor.shape[1:])
            buffer = self._buffers[key] = torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
        held = buffer if rows is None else buffer[: tensor.shape[0]]
        return held.copy_(tensor, non_blocking=True)
