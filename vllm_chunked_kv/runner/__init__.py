"""Running vLLM from Python: a fresh in-process engine per configuration (`engine`,
forked from a `zygote` that imported vLLM once) and a `vllm serve` subprocess on
127.0.0.1 (`server`). Used by the commands, the benchmarks and the tests.
"""
