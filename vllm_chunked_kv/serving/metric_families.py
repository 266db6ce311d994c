"""Every Prometheus metric this package exports: one table (`SPECS`) that the
stat logger, the feedback route and the README's metrics table all read.

Names follow docs/design.md §6: prefix `vllm_chunked_kv_`, a unit suffix, base
labels `model_name` and `engine` as vLLM's own metrics have them, and only
closed label sets besides (`phase` in 0..hop-1, `outcome` in
correct|incorrect, a handful of configuration words). The metric objects are
created once per process, on first use, so that several stat loggers in one
process (tests, an engine restart) share them. With several API server
processes, prometheus_client's multiprocess mode (which vLLM switches on)
sums the counters across processes; gauges keep the most recent value.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Literal

BASE_LABELS = ("model_name", "engine")
OUTCOMES = ("correct", "incorrect")
CONFIG_INFO_LABELS = ("backend", "mitigation", "pooling", "keep_boundary", "stagger", "proportional")


@dataclass(frozen=True)
class MetricSpec:
    name: str  # as exposed on /metrics (counters end in _total)
    kind: Literal["counter", "gauge"]
    labels: tuple[str, ...]
    help: str


SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "vllm_chunked_kv_requests_total", "counter", BASE_LABELS + ("phase",),
        "Finished requests by phase (prompt tokens mod hop).",
    ),
    MetricSpec(
        "vllm_chunked_kv_prompt_tokens_total", "counter", BASE_LABELS + ("phase",),
        "Prompt tokens of finished requests, by phase.",
    ),
    MetricSpec(
        "vllm_chunked_kv_generation_tokens_total", "counter", BASE_LABELS + ("phase",),
        "Generated tokens of finished requests, by phase.",
    ),
    MetricSpec(
        "vllm_chunked_kv_feedback_total", "counter", BASE_LABELS + ("phase", "outcome"),
        "Client-reported outcomes (POST /v1/chunked_kv/feedback), by phase of the rated request.",
    ),
    MetricSpec(
        "vllm_chunked_kv_config_info", "gauge", BASE_LABELS + CONFIG_INFO_LABELS,
        "Active chunked_kv configuration as labels; the value is always 1.",
    ),
    MetricSpec(
        "vllm_chunked_kv_chunk_size_tokens", "gauge", BASE_LABELS,
        "Tokens pooled into one compressed row (chunk_size).",
    ),
    MetricSpec(
        "vllm_chunked_kv_hop_tokens", "gauge", BASE_LABELS,
        "Distance between chunk starts (hop); phases are prompt tokens mod hop.",
    ),
    MetricSpec(
        "vllm_chunked_kv_window_tokens", "gauge", BASE_LABELS,
        "Raw recent tokens every query sees exactly (window).",
    ),
    MetricSpec(
        "vllm_chunked_kv_sink_tokens", "gauge", BASE_LABELS,
        "First tokens kept raw forever (sink_tokens).",
    ),
    MetricSpec(
        "vllm_chunked_kv_cache_uncompressed_bytes_per_token", "gauge", BASE_LABELS,
        "KV-cache bytes one token takes without compression, summed over layers.",
    ),
    MetricSpec(
        "vllm_chunked_kv_cache_bytes_per_token", "gauge", BASE_LABELS,
        "KV-cache bytes one token of the compressed region takes with the active backend.",
    ),
    MetricSpec(
        "vllm_chunked_kv_compression_ratio", "gauge", BASE_LABELS,
        "Uncompressed over compressed bytes per token (1 when chunked_kv is not the active backend).",
    ),
    MetricSpec(
        "vllm_chunked_kv_cache_capacity_tokens", "gauge", BASE_LABELS,
        "Tokens the allocated KV cache holds, as vLLM computed it at start-up.",
    ),
)

SPEC_BY_NAME = {spec.name: spec for spec in SPECS}

_metrics: dict[str, object] | None = None
_lock = threading.Lock()


def get_metrics() -> dict[str, object]:
    """name -> prometheus_client metric, created once per process."""
    global _metrics
    with _lock:
        if _metrics is None:
            from prometheus_client import Counter, Gauge

            made: dict[str, object] = {}
            for spec in SPECS:
                if spec.kind == "counter":
                    # prometheus_client appends _total itself.
                    made[spec.name] = Counter(spec.name.removesuffix("_total"), spec.help, spec.labels)
                else:
                    made[spec.name] = Gauge(spec.name, spec.help, spec.labels, multiprocess_mode="mostrecent")
            _metrics = made
        return _metrics


def markdown_table() -> str:
    """The README's metrics table, generated from SPECS."""
    lines = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for spec in SPECS:
        labels = ", ".join(f"`{label}`" for label in spec.labels)
        lines.append(f"| `{spec.name}` | {spec.kind} | {labels} | {spec.help} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown_table())
