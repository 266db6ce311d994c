"""`vllm.stat_logger_plugins` entry point: per-phase Prometheus metrics.

vLLM builds one `ChunkedKVStatLogger` per API server process (async serving
only) and calls `record()` after every engine step. For each finished
request it counts the request and its prompt and generated tokens under
`phase = num_prompt_tokens mod hop`, and remembers `request id -> phase` in
the phase registry so that the feedback route can label a later outcome.

The hop comes from `--additional-config '{"chunked_kv": {...}}'` (defaults
when absent), whichever attention backend serves: the phase of a request is
a property of the configured grid, so the metrics work, and compare, with
vLLM's default backend too. The metric objects are in `metric_families`.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.serving.kv_footprint import attention_backend_name, footprint_from_vllm_config
from vllm_chunked_kv.serving.metric_families import OUTCOMES, get_metrics
from vllm_chunked_kv.serving.phase_registry import PhaseRecord, get_phase_registry

logger = logging.getLogger(__name__)


def config_info_labels(cfg: ChunkedKVConfig, backend: str) -> dict[str, str]:
    """The bounded words of the configuration, as `config_info` labels."""
    return {
        "backend": backend.lower(),
        "mitigation": cfg.mitigation,
        "pooling": cfg.pooling,
        "keep_boundary": str(bool(cfg.keep_boundary)).lower(),
        "stagger": cfg.stagger if isinstance(cfg.stagger, str) else "explicit",
        "proportional": str(cfg.proportional).lower(),
    }


class ChunkedKVStatLogger(AggregateStatLoggerBase):
    """Counts finished requests by phase; exports the active configuration
    and KV compression as gauges. One instance covers every engine index."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None):
        self.vllm_config = vllm_config
        self.cfg = ChunkedKVConfig.from_vllm_config(vllm_config)
        self.hop = int(self.cfg.hop)
        self.model_name = str(vllm_config.model_config.served_model_name)
        self.engine_indexes = list(engine_indexes) if engine_indexes else [0]
        self.metrics = get_metrics()
        self.registry = get_phase_registry()
        self._by_engine = {idx: self._children(str(idx)) for idx in self.engine_indexes}
        self._set_config_gauges()
        self._set_footprint_gauges()

    def _children(self, engine: str) -> dict[str, list[Any]]:
        """Label children per phase, created now so every series starts at 0."""
        base = (self.model_name, engine)
        phases = [str(p) for p in range(self.hop)]
        children = {
            name: [self.metrics[name].labels(*base, p) for p in phases]
            for name in (
                "vllm_chunked_kv_requests_total",
                "vllm_chunked_kv_prompt_tokens_total",
                "vllm_chunked_kv_generation_tokens_total",
            )
        }
        feedback = self.metrics["vllm_chunked_kv_feedback_total"]
        for p in phases:
            for outcome in OUTCOMES:
                feedback.labels(*base, p, outcome)
        return children

    def _set_config_gauges(self) -> None:
        info = config_info_labels(self.cfg, attention_backend_name(self.vllm_config))
        for idx in self.engine_indexes:
            base = {"model_name": self.model_name, "engine": str(idx)}
            self.metrics["vllm_chunked_kv_config_info"].labels(**base, **info).set(1)
            for name, value in (
                ("vllm_chunked_kv_chunk_size_tokens", self.cfg.chunk_size),
                ("vllm_chunked_kv_hop_tokens", self.hop),
                ("vllm_chunked_kv_window_tokens", self.cfg.window),
                ("vllm_chunked_kv_sink_tokens", self.cfg.sink_tokens),
            ):
                self.metrics[name].labels(**base).set(value)

    def _set_footprint_gauges(self) -> None:
        fp = footprint_from_vllm_config(self.vllm_config, self.cfg.tokens_per_state)
        for idx in self.engine_indexes:
            base = (self.model_name, str(idx))
            self.metrics["vllm_chunked_kv_cache_uncompressed_bytes_per_token"].labels(*base).set(
                fp.uncompressed_bytes_per_token
            )
            self.metrics["vllm_chunked_kv_cache_bytes_per_token"].labels(*base).set(fp.bytes_per_token)
            self.metrics["vllm_chunked_kv_compression_ratio"].labels(*base).set(fp.compression_ratio)
            if fp.capacity_tokens is not None:
                self.metrics["vllm_chunked_kv_cache_capacity_tokens"].labels(*base).set(fp.capacity_tokens)

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        if iteration_stats is None or not iteration_stats.finished_requests:
            return
        children = self._by_engine.get(engine_idx)
        if children is None:  # an engine index vLLM did not announce
            children = self._by_engine[engine_idx] = self._children(str(engine_idx))
        records = []
        for finished in iteration_stats.finished_requests:
            phase = finished.num_prompt_tokens % self.hop
            children["vllm_chunked_kv_requests_total"][phase].inc()
            children["vllm_chunked_kv_prompt_tokens_total"][phase].inc(finished.num_prompt_tokens)
            children["vllm_chunked_kv_generation_tokens_total"][phase].inc(finished.num_generation_tokens)
            if finished.request_id:
                records.append(PhaseRecord(finished.request_id, self.model_name, str(engine_idx), phase))
        try:
            self.registry.add(records)
        except Exception:  # never let feedback bookkeeping break serving
            logger.exception("chunked_kv: could not record %d request phases", len(records))

    def log_engine_initialized(self) -> None:
        # The engine's cache figures are synced into vllm_config by now.
        self._set_footprint_gauges()
