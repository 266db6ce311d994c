"""Contract of `vllm_chunked_kv.serving.metrics.ChunkedKVStatLogger`, driven through
vLLM's own plugin loader and StatLoggerManager with a real VllmConfig:
every finished request is counted (requests, prompt and generated tokens)
under phase = prompt tokens mod hop, hop taken from the configuration (not
chunk_size); its id is remembered with that phase and engine for the
feedback route; all phase series exist from the start at 0; configuration
and footprint gauges carry the configured values."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from vllm_chunked_kv.serving import phase_registry
from vllm_chunked_kv.serving.metric_families import OUTCOMES
from vllm_chunked_kv.serving.metrics import ChunkedKVStatLogger
from vllm_chunked_kv.serving.phase_registry import Claim, MemoryPhaseRegistry

# chunk 12 with 50% overlap: hop 6, so a phase is prompt tokens mod 6, not mod 12.
SECTION = {"chunk_size": 12, "mitigation": "overlap", "window": 48, "sink_tokens": 2}
HOP = 6


@pytest.fixture
def registry(monkeypatch):
    store = MemoryPhaseRegistry(1000)
    monkeypatch.setattr(phase_registry, "_registry", store)
    return store


@pytest.fixture
def vllm_config(make_vllm_config):
    return make_vllm_config({"chunked_kv": SECTION})


def _value(name: str, **labels) -> float:
    value = REGISTRY.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _finished(request_id, prompt_tokens, generation_tokens):
    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats

    return FinishedRequestStats(
        finish_reason=FinishReason.LENGTH, request_id=request_id,
        num_prompt_tokens=prompt_tokens, num_generation_tokens=generation_tokens,
    )


def _iteration(*finished):
    from vllm.v1.metrics.stats import IterationStats

    stats = IterationStats()
    stats.finished_requests.extend(finished)
    return stats


def test_vllm_loads_the_entry_point(monkeypatch):
    from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories

    monkeypatch.setenv("VLLM_PLUGINS", "chunked_kv_metrics")
    assert load_stat_logger_plugin_factories() == [ChunkedKVStatLogger]


def test_counts_by_phase_through_vllms_manager(vllm_config, registry):
    from vllm.v1.metrics.loggers import StatLoggerManager

    model = vllm_config.model_config.served_model_name
    requests = [("cmpl-a-0", 13, 3, 0), ("chatcmpl-b", 18, 1, 0), ("cmpl-c-0", 7, 2, 1), ("cmpl-d-0", 12, 5, 1)]
    keys = [(str(engine), str(prompt % HOP)) for _, prompt, _, engine in requests]
    before = {
        (name, key): _value(name, model_name=model, engine=key[0], phase=key[1])
        for key in keys
        for name in ("vllm_chunked_kv_requests_total", "vllm_chunked_kv_prompt_tokens_total",
                     "vllm_chunked_kv_generation_tokens_total")
    }
    manager = StatLoggerManager(vllm_config, engine_idxs=[0, 1], custom_stat_loggers=[ChunkedKVStatLogger],
                                enable_default_loggers=False)
    for rid, prompt, generated, engine in requests:
        manager.record(scheduler_stats=None, iteration_stats=_iteration(_finished(rid, prompt, generated)),
                       engine_idx=engine)

    expected: dict[tuple, float] = {}
    for (rid, prompt, generated, engine), key in zip(requests, keys):
        for name, amount in (("vllm_chunked_kv_requests_total", 1), ("vllm_chunked_kv_prompt_tokens_total", prompt),
                             ("vllm_chunked_kv_generation_tokens_total", generated)):
            expected[(name, key)] = expected.get((name, key), before[(name, key)]) + amount
    for (name, key), value in expected.items():
        assert _value(name, model_name=model, engine=key[0], phase=key[1]) == value, (name, key)

    for rid, prompt, _, engine in requests:
        claim, record = registry.claim(rid)
        assert claim is Claim.CLAIMED
        assert (record.phase, record.engine, record.model_name) == (prompt % HOP, str(engine), model)


def test_every_phase_series_exists_from_the_start(vllm_config, registry):
    model = vllm_config.model_config.served_model_name
    ChunkedKVStatLogger(vllm_config, engine_indexes=[3])
    for phase in range(HOP):
        labels = dict(model_name=model, engine="3", phase=str(phase))
        assert REGISTRY.get_sample_value("vllm_chunked_kv_requests_total", labels) is not None
        for outcome in OUTCOMES:
            assert REGISTRY.get_sample_value("vllm_chunked_kv_feedback_total", {**labels, "outcome": outcome}) == 0
    assert REGISTRY.get_sample_value(
        "vllm_chunked_kv_requests_total", dict(model_name=model, engine="3", phase=str(HOP))
    ) is None


def test_configuration_and_footprint_gauges(vllm_config, registry, tiny_llama):
    model = vllm_config.model_config.served_model_name
    ChunkedKVStatLogger(vllm_config, engine_indexes=[0])
    base = dict(model_name=model, engine="0")
    assert _value("vllm_chunked_kv_chunk_size_tokens", **base) == 12
    assert _value("vllm_chunked_kv_hop_tokens", **base) == HOP
    assert _value("vllm_chunked_kv_window_tokens", **base) == 48
    assert _value("vllm_chunked_kv_sink_tokens", **base) == 2
    info = dict(base, backend="auto", mitigation="overlap", pooling="mean", keep_boundary="false",
                stagger="none", proportional="true")
    assert _value("vllm_chunked_kv_config_info", **info) == 1
    # Default attention backend: nothing is compressed.
    assert _value("vllm_chunked_kv_compression_ratio", **base) == 1
    assert _value("vllm_chunked_kv_cache_bytes_per_token", **base) == _value(
        "vllm_chunked_kv_cache_uncompressed_bytes_per_token", **base) > 0


def test_request_without_id_is_counted_not_remembered(vllm_config, registry):
    model = vllm_config.model_config.served_model_name
    logger = ChunkedKVStatLogger(vllm_config, engine_indexes=[0])
    labels = dict(model_name=model, engine="0", phase=str(9 % HOP))
    before = _value("vllm_chunked_kv_requests_total", **labels)
    logger.record(None, _iteration(_finished(None, 9, 1)))
    logger.record(None, None)  # steps without finished requests are no-ops
    assert _value("vllm_chunked_kv_requests_total", **labels) == before + 1
    assert len(registry) == 0


def test_registry_failure_does_not_break_counting(vllm_config, registry, monkeypatch):
    model = vllm_config.model_config.served_model_name
    logger = ChunkedKVStatLogger(vllm_config, engine_indexes=[0])

    def broken(records):
        raise OSError("disk full")

    monkeypatch.setattr(registry, "add", broken)
    labels = dict(model_name=model, engine="0", phase=str(20 % HOP))
    before = _value("vllm_chunked_kv_requests_total", **labels)
    logger.record(None, _iteration(_finished("cmpl-x-0", 20, 1)))
    assert _value("vllm_chunked_kv_requests_total", **labels) == before + 1


def test_unannounced_engine_index_gets_its_own_series(vllm_config, registry):
    model = vllm_config.model_config.served_model_name
    logger = ChunkedKVStatLogger(vllm_config, engine_indexes=[0])
    logger.record(None, _iteration(_finished("cmpl-y-0", 5, 1)), engine_idx=7)
    assert _value("vllm_chunked_kv_requests_total", model_name=model, engine="7", phase="5") >= 1
    assert registry.claim("cmpl-y-0")[1].engine == "7"
