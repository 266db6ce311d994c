"""Contract of `vllm_chunked_kv.serving.feedback`, mounted the way vLLM mounts it
(its plugin loader, its exception handlers): POST /v1/chunked_kv/feedback
answers 200 with the phase and counts the outcome under the phase, engine
and model the stat logger recorded; 404 for an unknown id, 409 for a second
rating, 422 for any malformed body, none of which touch a counter; the
client-visible completion id `cmpl-X` finds the engine-side `cmpl-X-0`; a
record that lands shortly after the post is waited for. GET
/v1/chunked_kv/config answers the resolved configuration. The plugin loads
only when VLLM_PLUGINS names it."""

from __future__ import annotations

import asyncio
import threading
from argparse import Namespace
from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from prometheus_client import REGISTRY

from vllm_chunked_kv.serving import phase_registry
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.serving.feedback import CONFIG_PATH, ENV_WAIT, FEEDBACK_PATH, ChunkedKVFeedbackPlugin
from vllm_chunked_kv.serving.metric_families import get_metrics
from vllm_chunked_kv.serving.phase_registry import MemoryPhaseRegistry, PhaseRecord

SECTION = {"chunk_size": 8, "mitigation": "boundary", "window": 32}
MODEL = "feedback-test-model"


@pytest.fixture
def registry(monkeypatch):
    store = MemoryPhaseRegistry(100)
    monkeypatch.setattr(phase_registry, "_registry", store)
    return store


@pytest.fixture
def client(monkeypatch, make_vllm_config, registry):
    from vllm.entrypoints.serve.exception_handling.register import init_exception_handler
    from vllm.plugins.endpoint_plugins.interface import attach_endpoint_plugins, init_endpoint_plugins_state

    monkeypatch.setenv("VLLM_PLUGINS", "chunked_kv_feedback")
    monkeypatch.setenv(ENV_WAIT, "0")
    app = FastAPI()
    attach_endpoint_plugins(app, ("generate",))
    init_exception_handler(app)  # vLLM's: turns FastAPI validation errors into 400
    engine_client = SimpleNamespace(vllm_config=make_vllm_config({"chunked_kv": SECTION}))
    asyncio.run(init_endpoint_plugins_state(engine_client, app.state, Namespace()))
    with TestClient(app) as test_client:
        yield test_client


def _feedback(phase: str, outcome: str, engine: str = "0") -> float:
    labels = dict(model_name=MODEL, engine=engine, phase=phase, outcome=outcome)
    return REGISTRY.get_sample_value("vllm_chunked_kv_feedback_total", labels) or 0.0


def _all_feedback() -> float:
    get_metrics()
    return sum(
        sample.value
        for family in REGISTRY.collect() if family.name == "vllm_chunked_kv_feedback"
        for sample in family.samples if sample.name == "vllm_chunked_kv_feedback_total"
    )


def test_plugin_loads_only_when_allowlisted(monkeypatch):
    from vllm.plugins import load_endpoint_plugins

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    assert load_endpoint_plugins(("generate",)) == []
    monkeypatch.setenv("VLLM_PLUGINS", "chunked_kv_feedback")
    (plugin,) = load_endpoint_plugins(("generate",))
    assert isinstance(plugin, ChunkedKVFeedbackPlugin)
    assert load_endpoint_plugins(("render",)) == []  # needs an engine


def test_completion_id_maps_to_engine_id_and_counts(client, registry):
    registry.add([PhaseRecord("cmpl-abc-0", MODEL, "1", 5)])
    before = _feedback("5", "incorrect", engine="1")
    response = client.post(FEEDBACK_PATH, json={"request_id": "cmpl-abc", "correct": False})
    assert response.status_code == 200, response.text
    assert response.json() == {"request_id": "cmpl-abc", "phase": 5, "outcome": "incorrect"}
    assert _feedback("5", "incorrect", engine="1") == before + 1


def test_chat_id_is_looked_up_as_given(client, registry):
    registry.add([PhaseRecord("chatcmpl-xyz", MODEL, "0", 2)])
    before = _feedback("2", "correct")
    response = client.post(FEEDBACK_PATH, json={"request_id": "chatcmpl-xyz", "correct": True})
    assert response.status_code == 200 and response.json()["phase"] == 2
    assert _feedback("2", "correct") == before + 1


def test_second_rating_is_a_conflict(client, registry):
    registry.add([PhaseRecord("chatcmpl-twice", MODEL, "0", 1)])
    assert client.post(FEEDBACK_PATH, json={"request_id": "chatcmpl-twice", "correct": True}).status_code == 200
    total = _all_feedback()
    response = client.post(FEEDBACK_PATH, json={"request_id": "chatcmpl-twice", "correct": False})
    assert response.status_code == 409
    assert _all_feedback() == total


def test_unknown_id_is_404_and_counts_nothing(client):
    total = _all_feedback()
    response = client.post(FEEDBACK_PATH, json={"request_id": "cmpl-never-served", "correct": True})
    assert response.status_code == 404
    assert "cmpl-never-served" in response.json()["error"]["message"]
    assert _all_feedback() == total


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        b'{"request_id": "cmpl-abc"}',
        b'{"correct": true}',
        b'{"request_id": "cmpl-abc", "correct": "yes"}',
        b'{"request_id": "cmpl-abc", "correct": 1}',
        b'{"request_id": 42, "correct": true}',
        b'{"request_id": "", "correct": true}',
        b'{"request_id": "cmpl-abc", "correct": true, "phase": 3}',
        b'{"request_id": "' + b"x" * 600 + b'", "correct": true}',
    ],
)
def test_bad_body_is_422(client, registry, body):
    registry.add([PhaseRecord("cmpl-abc-0", MODEL, "0", 3)])
    total = _all_feedback()
    response = client.post(FEEDBACK_PATH, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == 422
    assert _all_feedback() == total


def test_waits_for_a_record_that_lands_late(client, registry, monkeypatch):
    monkeypatch.setenv(ENV_WAIT, "5")
    timer = threading.Timer(0.3, registry.add, args=([PhaseRecord("chatcmpl-late", MODEL, "0", 4)],))
    timer.start()
    try:
        response = client.post(FEEDBACK_PATH, json={"request_id": "chatcmpl-late", "correct": True})
    finally:
        timer.join()
    assert response.status_code == 200 and response.json()["phase"] == 4


def test_config_route_answers_the_resolved_configuration(client):
    response = client.get(CONFIG_PATH)
    assert response.status_code == 200
    view = response.json()
    expected = ChunkedKVConfig.from_additional_config({"chunked_kv": SECTION})
    assert view["chunked_kv"]["mitigation"] == "boundary"
    assert view["chunked_kv"]["keep_boundary"] is True
    assert view["phase_hop"] == expected.hop == 8
    assert view["attention_backend"] == "auto" and view["compression_active"] is False
    assert view["kv_cache"]["compression_ratio"] == 1.0
    assert view["feedback_store"] == {"kind": "memory", "capacity": 100}


def test_config_route_without_engine_is_503():
    app = FastAPI()
    ChunkedKVFeedbackPlugin().attach_router(app)
    asyncio.run(ChunkedKVFeedbackPlugin().init_state(None, app.state, Namespace()))
    with TestClient(app) as test_client:
        assert test_client.get(CONFIG_PATH).status_code == 503
