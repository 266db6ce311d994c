"""Fresh vLLM engine processes without paying vLLM's import each time.

Importing vLLM takes 15-20 s of one CPU core; starting a tiny in-process
engine after that takes 2-5 s. A test that starts an engine per
configuration spent most of its time importing. A *zygote* is a Python
process that imports vLLM once and then forks one child per run: each run
gets a process of its own (vLLM keeps global state per process, so runs
must not share one) whose imports are already done.

    result = run_forked("my_module:engine_main", spec, timeout=600, env={"X": "1"})

calls ``engine_main(spec)`` in a forked child with exactly the caller's
environment plus `env`, its stdout and stderr (vLLM's log) captured, and
returns the dict it returned plus ``log``. A zygote is started per distinct
environment (some settings, e.g. ``TRITON_INTERPRET`` or ``HF_HUB_OFFLINE``,
are read when a module is imported), ``CHUNKED_KV_*`` and ``PYTEST_*``
variables aside (read when used), and lives until the calling process
exits. The zygote runs nothing but imports before it forks: no OpenMP
region is open then.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path

PRELOAD = (  # what an in-process engine of a Llama or Qwen2 model imports, and this backend
    "vllm.entrypoints.llm", "vllm.engine.arg_utils", "vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker", "vllm.model_executor.models.llama", "vllm.model_executor.models.qwen2",
    "vllm_chunked_kv.backend.attention",
)
_PRELOAD_ENV = "CHUNKED_KV_ZYGOTE_PRELOAD"
MAX_ZYGOTES = 2  # each holds vLLM's imports (~0.5 GB)

_zygotes: dict[tuple, subprocess.Popen] = {}
_lock = threading.Lock()  # one run at a time per calling process: a zygote answers its requests in order


def run_forked(target: str, spec: dict, timeout: float | None, env: dict[str, str] | None = None,
               preload: tuple[str, ...] = PRELOAD) -> dict:
    """``module:function`` called with `spec` in a fresh child of a zygote that
    imported `preload`; the dict it returns plus ``log`` (its stdout and stderr)."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **(env or {}),
                _PRELOAD_ENV: ",".join(preload)}
    with _lock:
        return _run(target, spec, timeout, full_env)


def _run(target: str, spec: dict, timeout: float | None, full_env: dict[str, str]) -> dict:
    zygote = _zygote(full_env)
    with tempfile.TemporaryDirectory(prefix="chunked-kv-run-") as tmp:
        log, result = Path(tmp) / "log", Path(tmp) / "result.json"
        request = {"target": target, "spec": spec, "env": full_env, "log": str(log), "result": str(result)}
        try:
            zygote.stdin.write(json.dumps(request) + "\n")
            zygote.stdin.flush()
        except BrokenPipeError:  # it died importing
            reply = ""
        else:
            ready, _, _ = select.select([zygote.stdout], [], [], timeout)
            if not ready:
                _stop(full_env)
                raise subprocess.TimeoutExpired(target, timeout, output=_read(log))
            reply = zygote.stdout.readline()
        text = _read(log)
        if not reply:
            _stop(full_env)
            zygote.errors.seek(0)
            own = zygote.errors.read().decode(errors="replace")
            raise RuntimeError(f"the zygote died running {target}:\n{own[-3000:]}\n{text[-3000:]}")
        code = json.loads(reply)["exit_code"]
        if code != 0 or not result.exists():
            raise RuntimeError(f"engine run failed ({code}):\n{text[-7000:]}")
        return {**json.loads(result.read_text()), "log": text}


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


_RUNTIME_ONLY = ("CHUNKED_KV_", "PYTEST_")  # read when used (PYTEST_CURRENT_TEST changes every test)


def _key(env: dict[str, str]) -> tuple:
    return env[_PRELOAD_ENV], tuple(sorted((k, v) for k, v in env.items() if not k.startswith(_RUNTIME_ONLY)))


def _zygote(env: dict[str, str]) -> subprocess.Popen:
    key = _key(env)
    proc = _zygotes.get(key)
    if proc is not None and proc.poll() is None:
        return proc
    while len(_zygotes) >= MAX_ZYGOTES:
        _stop_key(next(iter(_zygotes)))
    errors = tempfile.TemporaryFile()  # the zygote's own stderr: why it died, if it does
    proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=errors, env=env, text=True, start_new_session=True)
    proc.errors = errors
    _zygotes[key] = proc
    return proc


def _stop(env: dict[str, str]) -> None:
    _stop_key(_key(env))


def _stop_key(key: tuple) -> None:
    proc = _zygotes.pop(key, None)
    if proc is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the zygote and a child still running
    except ProcessLookupError:
        pass
    proc.wait()


@atexit.register
def _stop_all() -> None:
    for key in list(_zygotes):
        _stop_key(key)


# ------------------------------------------------------------- the zygote


def _serve() -> None:
    replies = os.fdopen(os.dup(1), "w")  # requests on stdin, replies on the original stdout
    os.dup2(2, 1)  # anything the imports print stays out of the replies
    for module in filter(None, os.environ[_PRELOAD_ENV].split(",")):
        importlib.import_module(module)
    gc.freeze()  # the imports' objects: vLLM's many gc.collect() calls in a child skip them (3 s a run)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"exit_code": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


def _child(request: dict) -> None:
    code = 1
    try:
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        sys.stdin.close()
        os.environ.clear()
        os.environ.update(request["env"])
        module, name = request["target"].split(":")
        result = getattr(importlib.import_module(module), name)(request["spec"])
        Path(request["result"]).write_text(json.dumps(result))
        code = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _serve()
