"""Contract of vllm_chunked_kv.ops.host_sync: inside `no_host_sync()` every
call that would wait for the device or copy host data to it raises
`HostSyncError` naming the function and the caller's file and line, on any
device (CPU-only CI sees the calls themselves): ``torch.tensor(...,
device=...)``, ``torch.as_tensor``, ``.item()``, ``.tolist()``, ``.cpu()``,
a truth value, ``nonzero``. Tensor arithmetic on the device is allowed.
Outside the block nothing is checked."""

from __future__ import annotations

import pytest
import torch

from vllm_chunked_kv.ops.host_sync import HostSyncError, no_host_sync

FORBIDDEN = {
    "tensor": lambda x: torch.tensor([1, 2], device=x.device),
    "as_tensor": lambda x: torch.as_tensor([3], device=x.device),
    "item": lambda x: x[0].item(),
    "tolist": lambda x: x.tolist(),
    "cpu": lambda x: x.cpu(),
    "__bool__": lambda x: bool(x[0] > 0),
    "nonzero": lambda x: x.nonzero(),
}


@pytest.mark.parametrize("name", list(FORBIDDEN))
def test_each_forbidden_call_raises_with_its_caller(name):
    x = torch.arange(4)
    with pytest.raises(HostSyncError, match=rf"{name} .*\(test_host_sync\.py:\d+\)"):
        with no_host_sync("cpu"):
            FORBIDDEN[name](x)


def test_device_arithmetic_passes_and_nothing_is_checked_outside():
    x = torch.arange(8)
    with no_host_sync("cpu"):
        y = torch.where(x % 2 == 0, x.gather(0, x.flip(0)), torch.zeros_like(x)).cumsum(0)
    assert y.tolist() == [7, 7, 12, 12, 15, 15, 16, 16]  # outside: reading is fine again
    assert torch.tensor([1]).item() == 1
