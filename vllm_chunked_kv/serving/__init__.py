"""What a running server shows beyond vLLM's own: per-phase Prometheus metrics
(`metrics`, a `vllm.stat_logger_plugins` entry point), the feedback and config
routes (`feedback`, a `vllm.endpoint_plugins` entry point) and the KV footprint.
"""
