"""Chunked attention for transformers models: the same visible set as the vLLM
backend, as an attention function a `transformers` model can run with (training,
evaluation, perplexity). Used by `adapt`, the demo, the benchmarks and the tests.
"""
