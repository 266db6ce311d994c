"""Contract of `runner.server.one_process_env`: a command asking for
`ONE_PROCESS` gets VLLM_ENABLE_V1_MULTIPROCESSING=0 (without it vLLM's CPU
platform turns "uni" back into "mp"); any other command gets nothing. That
the model then runs in the engine's process is checked on a real server in
tests/scan/test_server.py.

`run_serve_expecting_failure` runs vLLM's command line in a forked child and
returns what a `vllm serve` process would: the exit status of a `SystemExit`
(vLLM's argument parser: 2, with its message), status 1 for an uncaught
exception, shown by the backend's excepthook as one `error:` line, and no
traceback. Both runs are children of one process that imported vLLM."""

import json

import pytest

from vllm_chunked_kv.runner.server import DEFAULT_ARGS, ONE_PROCESS_ARGS, one_process_env, run_serve_expecting_failure


def test_one_process_sets_the_variable_vllm_needs_on_cpu():
    assert one_process_env(["vllm", "serve", "m", *ONE_PROCESS_ARGS]) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert one_process_env(["vllm", "serve", "m", *DEFAULT_ARGS]) == {}
    assert one_process_env(["vllm", "serve", "m", "--distributed-executor-backend", "mp"]) == {}


@pytest.mark.server
@pytest.mark.slow  # the startup-error tests use it in the slow tier too
def test_a_failing_start_ends_as_a_vllm_serve_process_would(tiny_llama):
    bad_flag = run_serve_expecting_failure(tiny_llama, ["--block-size", "lots"])
    assert bad_flag.returncode == 2 and "--block-size" in bad_flag.stdout and "Traceback" not in bad_flag.stdout
    bad_setting = run_serve_expecting_failure(
        tiny_llama, ["--attention-backend", "chunked_kv", "--additional-config", json.dumps({"chunked_kv": {"window": 0}})])
    errors = [line for line in bad_setting.stdout.splitlines() if line.startswith("error: ")]
    assert bad_setting.returncode == 1 and len(errors) == 1 and "chunked_kv.window" in errors[0]
    assert "Traceback" not in bad_setting.stdout
    assert bad_flag.zygote == bad_setting.zygote  # forked from one process that imported vLLM once
