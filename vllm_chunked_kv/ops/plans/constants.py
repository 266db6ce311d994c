"""Small tensors a step reuses, made once per device and values.

A decode step needs a few constant tensors: index ranges, the grid origins
of a layer's KV heads, the pooling gains. Made afresh, each costs several
microseconds on CPU (a tenth of a batch-1 plan's time, benchmarks/README.md)
and, on a GPU, a copy from the host every step, which a captured CUDA graph
cannot contain (`host_sync.py`). These functions return one shared tensor per
device and values; callers only read them.
"""

from __future__ import annotations

from functools import lru_cache

import torch


def device_key(device: torch.device | str) -> str:
    """The device with its index (``cuda`` and ``cuda:0`` name one device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return str(device)


def arange(n: int, device: torch.device | str) -> torch.Tensor:
    """``torch.arange(n)`` in int64."""
    return _shared(n, None, torch.long, device_key(device))


def ints(values: tuple[int, ...], device: torch.device | str) -> torch.Tensor:
    """``values`` as an int64 tensor."""
    return _shared(None, values, torch.long, device_key(device))


def floats(values: tuple[float, ...], device: torch.device | str) -> torch.Tensor:
    """``values`` as an fp32 tensor."""
    return _shared(None, values, torch.float32, device_key(device))


@lru_cache(maxsize=256)
def _shared(n: int | None, values: tuple | None, dtype: torch.dtype, device: str) -> torch.Tensor:
    with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
        if values is None:
            return torch.arange(n, dtype=dtype, device=device)
        return torch.tensor(values, dtype=dtype, device=device)
