"""Contract of `runner.server.one_process_env`: a command asking for
`ONE_PROCESS` gets VLLM_ENABLE_V1_MULTIPROCESSING=0 (without it vLLM's CPU
platform turns "uni" back into "mp"); any other command gets nothing. That
the model then runs in the engine's process is checked on a real server in
tests/scan/test_server.py."""

from vllm_chunked_kv.runner.server import DEFAULT_ARGS, ONE_PROCESS_ARGS, one_process_env


def test_one_process_sets_the_variable_vllm_needs_on_cpu():
    assert one_process_env(["vllm", "serve", "m", *ONE_PROCESS_ARGS]) == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    assert one_process_env(["vllm", "serve", "m", *DEFAULT_ARGS]) == {}
    assert one_process_env(["vllm", "serve", "m", "--distributed-executor-backend", "mp"]) == {}
