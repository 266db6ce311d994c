"""Catching host synchronisation on the decode step path.

A decode step that CUDA graphs capture must not wait for the device and must
not copy host data to it: reading a device tensor on the host (``.item()``,
``.tolist()``, ``.cpu()``, a truth value, ``nonzero``) waits for every kernel
before it, and ``torch.tensor(values, device=...)`` is a host-to-device copy
that stream capture rejects and that, in eager mode, synchronises every step.

`no_host_sync()` makes each of those an error inside its block, on any
device: a torch function mode sees the calls themselves, so the check runs
in CPU-only CI, where nothing would ever wait. On a CUDA device it also sets
``torch.cuda.set_sync_debug_mode("error")``, which catches what the mode
cannot see (a synchronising op inside an extension's Python wrapper is a
call the mode sees; one inside a compiled kernel launch is not).

Constants a step needs (an index range, the grid origins, pooling gains)
are made once per device and reused (`ops/constants.py`): run one step
before guarding the next.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

# Reading a tensor on the host: on a device, each waits for the kernels before it.
READS = {torch.Tensor.cpu, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__,
         torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.nonzero,
         torch.nonzero}
# Making a tensor from host data: on a device, a copy from the host.
FROM_HOST = {torch.tensor, torch.as_tensor, torch.from_numpy, torch.Tensor.new_tensor}


class HostSyncError(AssertionError):
    """A call on the step path that would wait for the device or copy from the host."""


class _NoHostSync(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in READS or func in FROM_HOST:
            kind = "reads a tensor on the host" if func in READS else "copies host data to the device"
            raise HostSyncError(f"host synchronisation on the step path: {getattr(func, '__name__', func)} "
                                f"{kind} ({_caller()})")
        return func(*args, **(kwargs or {}))


def _caller() -> str:
    """file:line of the innermost frame outside torch and this module."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and frame.filename != __file__:
            return f"{Path(frame.filename).name}:{frame.lineno}"
    return "unknown"


@contextlib.contextmanager
def no_host_sync(device: torch.device | str | None = None) -> Iterator[None]:
    """Inside: every host read of a tensor and every tensor made from host
    data raises `HostSyncError`; on a CUDA `device`, every synchronising
    CUDA call too (`torch.cuda.set_sync_debug_mode`)."""
    cuda = device is not None and torch.device(device).type == "cuda"
    previous = torch.cuda.get_sync_debug_mode() if cuda else None
    if cuda:
        torch.cuda.set_sync_debug_mode("error")
    try:
        with _NoHostSync():
            yield
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(previous)
