"""Start and stop a real `vllm serve` subprocess on 127.0.0.1 (quickstart, demo, tests, benchmarks).

The server runs in its own process group and is stopped by PID (the whole
group, so the spawned engine goes too). Its log is kept in a file so tests
can read what the server itself said.

It serves the whole product, as the Docker setup does: unless the caller's
environment sets `VLLM_PLUGINS`, it names the project's three plugins there
(the backend, the metrics logger and the `/v1/chunked_kv/*` routes). vLLM
loads endpoint plugins only when that allowlist names them, and without the
config route a scan cannot learn the server's window and places its needles
for an assumed long one (scan/placement.py).

`ONE_PROCESS` (``--distributed-executor-backend uni``) runs the model in the
engine's own process instead of a worker process of its own: one Python
process fewer to import vLLM at start (docs/serving.md, Tests), for servers
whose test or benchmark does not depend on the process layout users get;
`ONE_PROCESS_ARGS` is `DEFAULT_ARGS` with it. On CPU, vLLM keeps "uni" only
with VLLM_ENABLE_V1_MULTIPROCESSING=0 (otherwise it switches to "mp" without
a word), so a server given it gets that variable too; the API server and the
engine stay separate processes.

    with VllmServer(model_dir, ["--attention-backend", "chunked_kv"]) as server:
        client = server.openai_client()
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

# Small, CPU-friendly defaults: no compile, a fixed KV budget (the CPU
# platform otherwise reserves a fraction of a NUMA node's memory).
DEFAULT_ARGS = ["--enforce-eager", "--dtype", "float32", "--max-model-len", "1024",
                "--kv-cache-memory-bytes", str(64 << 20)]
ONE_PROCESS = ["--distributed-executor-backend", "uni"]  # the model runs in the engine's process
ONE_PROCESS_ARGS = [*DEFAULT_ARGS, *ONE_PROCESS]
# The entry points of pyproject.toml: backend, stat logger, endpoint routes.
PROJECT_PLUGINS = "chunked_kv,chunked_kv_metrics,chunked_kv_feedback"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def vllm_executable() -> str:
    """The `vllm` command next to this interpreter (the project's venv)."""
    candidate = Path(sys.executable).with_name("vllm")
    return str(candidate) if candidate.exists() else "vllm"


def start_group(command: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start ``command`` in its own process group, output to ``log_path``."""
    with Path(log_path).open("wb") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_ready(proc: subprocess.Popen, url: str, timeout: float, name: str, log_tail: Callable[[], str],
               poll: float = 0.3) -> None:
    """Poll ``url`` until it answers 200. If the process exits first, or
    ``timeout`` passes (the process group is then stopped), raise with the
    server's ``name`` and ``log_tail()``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} before it was ready:\n{log_tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, ValueError):  # refused, reset, timed out, HTTP errors (URLError is an OSError)
            pass
        time.sleep(poll)
    stop_group(proc)
    raise TimeoutError(f"{name} not ready after {timeout:.0f}s:\n{log_tail()}")


def stop_group(proc: subprocess.Popen | None) -> None:
    """Stop a process started by `start_group` and its whole group by PID:
    SIGTERM, then SIGKILL if it has not exited in 20 s."""
    if proc is None or proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def one_process_env(command: list[str]) -> dict[str, str]:
    """The environment `ONE_PROCESS` needs when `command` asks for it (see the module docstring)."""
    pairs = zip(command, command[1:])
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if ("--distributed-executor-backend", "uni") in pairs else {}


class VllmServer:
    """`vllm serve MODEL ARGS` on a free 127.0.0.1 port, as a context manager."""

    def __init__(self, model: str | Path, args: list[str] = (), *, env: dict[str, str] | None = None,
                 defaults: list[str] = DEFAULT_ARGS, timeout: float = 240.0):
        self.model = str(model)
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.command = [vllm_executable(), "serve", self.model, "--host", "127.0.0.1",
                        "--port", str(self.port), *defaults, *args]
        self.env = {"VLLM_PLUGINS": PROJECT_PLUGINS, **os.environ, **one_process_env(self.command), **(env or {})}
        self.timeout = timeout
        self.log_path = Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        self.proc: subprocess.Popen | None = None

    def start(self) -> VllmServer:
        self.proc = start_group(self.command, self.log_path, env=self.env)
        wait_ready(self.proc, f"{self.base_url}/v1/models", self.timeout, "vllm serve", self.log_tail, poll=1.0)
        return self

    def stop(self) -> None:
        stop_group(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log().splitlines()[-lines:])

    def openai_client(self):
        from openai import OpenAI

        return OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    def __enter__(self) -> VllmServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# What `vllm serve` imports before it parses its arguments, and the backend:
# the zygote that runs failing servers holds them (`run_serve_expecting_failure`).
CLI_PRELOAD = ("vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve", "vllm.entrypoints.openai.api_server",
               "vllm.engine.arg_utils", "vllm_chunked_kv.backend.attention")


def run_serve_expecting_failure(model: str | Path, args: list[str], timeout: float = 240,
                                env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `vllm serve` that should fail at startup (with `env` added to the
    environment); returns the finished run, its whole log as stdout.

    It runs vLLM's command line (`vllm.entrypoints.cli.main`, what the `vllm`
    command calls) in a fresh child of a process that imported vLLM once
    (`runner.zygote`), ending as the interpreter ends a script: an uncaught
    exception goes to `sys.excepthook` (where the backend prints its one
    `error:` line) with exit status 1, `SystemExit` with its code. A run that
    does not fail is stopped at `timeout` (subprocess.TimeoutExpired)."""
    from vllm_chunked_kv.runner import zygote

    argv = [vllm_executable(), "serve", str(model), "--host", "127.0.0.1", "--port", str(free_port()),
            *DEFAULT_ARGS, *args]
    result = zygote.run_forked(f"{__name__}:serve_command", {"argv": argv}, timeout, env, preload=CLI_PRELOAD)
    done = subprocess.CompletedProcess(argv, result["returncode"], stdout=result["log"], stderr="")
    done.zygote = result["zygote"]  # the pid of the process it was forked from
    return done


def serve_command(spec: dict) -> dict:
    """In a zygote's child: vLLM's command line run with `spec["argv"]`; its exit status."""
    from vllm.entrypoints.cli.main import main

    sys.argv = list(spec["argv"])
    try:
        main()
        code = 0
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    except BaseException:  # noqa: BLE001 - the interpreter's own handling of an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    return {"returncode": code, "zygote": os.getppid()}
