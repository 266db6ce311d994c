"""Run the Triton kernels under Triton's CPU interpreter, in a worker process.

Triton decides when ``triton.language`` is first imported (and again for each
kernel when it is decorated) whether code is interpreted, and importing vLLM
imports Triton. In a full test session Triton is loaded long before these
tests, so they cannot switch to the interpreter in-process. The `triton_ops`
fixture starts one worker process per session with ``TRITON_INTERPRET=1`` set
from its start; ``triton_ops.pool.pool_chunk(...)``,
``triton_ops.attention.attend(...)``, ``triton_ops.dispatch.<fn>(...)`` and
``triton_ops.schedule.run_schedule(..., impl="triton")`` (a whole checked
schedule, `schedule.py`) run there. Arguments and results travel pickled; an exception is raised
again here with the worker's traceback attached. A call given ``out=`` must
return that very tensor (checked in the worker), so a NaN-filled ``out``
whose elements come back unwritten fails the test.

The CUDA kernels' CPU emulation is built once a session (`cuda_build.py`'s
fixtures, registered here): test_cuda_ext.py and test_cuda_fp8.py share it
(one pytest-xdist group, so one worker).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from multiprocessing import Pipe

import pytest

from .cuda_build import emulated, emulated_module, emulated_objects  # noqa: F401 (session fixtures)

_WORKER = r"""
import importlib, pickle, sys, traceback
from multiprocessing.connection import Connection
import torch
torch.set_num_threads(1)
conn = Connection(int(sys.argv[1]))
while True:
    try:
        module, name, args, kwargs = pickle.loads(conn.recv_bytes())
    except EOFError:
        break
    try:
        result = getattr(importlib.import_module(module), name)(*args, **kwargs)
        out = kwargs.get("out")
        if out is not None:
            given = out if isinstance(out, tuple) else (out,)
            got = result if isinstance(result, tuple) else (result,)
            if [t.data_ptr() for t in given] != [t.data_ptr() for t in got]:
                raise AssertionError(f"{name} did not return the out= tensors it was given")
        reply = ("ok", result)
    except BaseException as exc:
        reply = ("error", exc, traceback.format_exc())
    conn.send_bytes(pickle.dumps(reply))
"""


class _Worker:
    def __init__(self) -> None:
        self.conn, child = Pipe()
        # The worker imports what this process can (the test helpers included).
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(child.fileno())], pass_fds=[child.fileno()], env=env
        )
        child.close()

    def call(self, module: str, name: str, *args, **kwargs):
        self.conn.send_bytes(pickle.dumps((module, name, args, kwargs)))
        reply = pickle.loads(self.conn.recv_bytes())
        if reply[0] == "error":
            exc = reply[1]
            exc.add_note("in the Triton interpreter worker:\n" + reply[2])
            raise exc
        return reply[1]

    def close(self) -> None:
        self.conn.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class _Module:
    """Calls into one module of the worker: ``proxy.fn(*args)``."""

    def __init__(self, worker: _Worker, module: str) -> None:
        self._worker, self._module = worker, module

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: self._worker.call(self._module, name, *args, **kwargs)


class TritonOps:
    def __init__(self, worker: _Worker) -> None:
        from . import schedule

        self.pool = _Module(worker, "vllm_chunked_kv.ops.kernels.triton_pool")
        self.attention = _Module(worker, "vllm_chunked_kv.ops.kernels.triton_attention")
        self.dispatch = _Module(worker, "vllm_chunked_kv.ops.dispatch")
        self.schedule = _Module(worker, schedule.__name__)


@pytest.fixture(scope="session")
def triton_ops():
    """Proxies to the kernel modules, run under Triton's CPU interpreter."""
    pytest.importorskip("triton", reason="triton is not installed")
    worker = _Worker()
    yield TritonOps(worker)
    worker.close()


@pytest.fixture(scope="session")
def compile_for_gpu():
    """``compile(kernel, pointer_types, constants, arch)``: compile a kernel
    ahead of time for an NVIDIA target with Triton's bundled ptxas (no GPU
    needed). Catches what the interpreter lets through (non-constexpr
    globals, tl.dot shape rules, type errors). Non-pointer arguments are i32,
    except the fp32 ``scale``, ``log_weight``, ``softcap`` and FP8 pages'
    ``k_scale`` and ``v_scale``."""
    triton = pytest.importorskip("triton", reason="triton is not installed")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process: kernels are not compiled")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    def compile_kernel(kernel, pointer_types: dict, constants: dict, arch: int = 90):
        constants = dict(constants)
        num_warps = constants.pop("num_warps", 4)
        signature = {
            name: "constexpr" if name in constants else pointer_types.get(name)
            or ("fp32" if name in ("scale", "log_weight", "softcap", "k_scale", "v_scale") else "i32")
            for name in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constants)
        return triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})

    return compile_kernel
