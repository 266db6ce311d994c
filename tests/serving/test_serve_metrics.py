"""A real `vllm serve` (one API server, `--attention-backend chunked_kv`,
the three plugins allowed) on 127.0.0.1: /metrics counts each finished
request under phase = prompt tokens mod hop (usage.prompt_tokens as the
client received it); the feedback route accepts the very `id` the client
got back, for completions and chat, also one set through X-Request-Id, and
answers 409/404/422 over HTTP through vLLM's own middleware; the config
route and the gauges report the active backend and its compression."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.server import ONE_PROCESS_ARGS, VllmServer

pytestmark = [pytest.mark.server, pytest.mark.slow]

SECTION = {"chunk_size": 8, "mitigation": "overlap", "window": 32}
CFG = ChunkedKVConfig.from_additional_config({"chunked_kv": SECTION})
HOP = CFG.hop  # 4: phases follow the hop, not chunk_size


@pytest.fixture(scope="module")
def server(tiny_llama):
    args = ["--attention-backend", "chunked_kv", "--max-model-len", "256",
            "--additional-config", json.dumps({"chunked_kv": SECTION})]
    # its default VLLM_PLUGINS names the three; the model in the engine's process (no worker process)
    with VllmServer(tiny_llama, args, defaults=ONE_PROCESS_ARGS) as running:
        yield running


def _samples(server, name: str) -> dict[tuple, float]:
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


def _by_phase(server, name: str) -> dict[int, float]:
    out: dict[int, float] = {}
    for labels, value in _samples(server, name).items():
        phase = int(dict(labels)["phase"])
        out[phase] = out.get(phase, 0.0) + value
    return out


def _complete(server, prompt: str, **headers) -> dict:
    body = {"model": str(server.model), "prompt": prompt, "max_tokens": 2, "temperature": 0}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    return response.json()


def _feedback(server, request_id, correct=True) -> httpx.Response:
    return httpx.post(f"{server.base_url}/v1/chunked_kv/feedback",
                      json={"request_id": request_id, "correct": correct}, timeout=30)


def test_finished_requests_counted_by_phase(server):
    before = _by_phase(server, "vllm_chunked_kv_requests_total")
    tokens_before = _by_phase(server, "vllm_chunked_kv_prompt_tokens_total")
    assert sorted(before) == list(range(HOP))  # every phase series exists from the start
    expected_requests = dict(before)
    expected_tokens = dict(tokens_before)
    for words in (1, 2, 3, 4, 5, 6, 9):
        usage = _complete(server, " ".join(f"w{i}" for i in range(words)))["usage"]
        phase = usage["prompt_tokens"] % HOP
        expected_requests[phase] += 1
        expected_tokens[phase] += usage["prompt_tokens"]
    assert _by_phase(server, "vllm_chunked_kv_requests_total") == expected_requests
    assert _by_phase(server, "vllm_chunked_kv_prompt_tokens_total") == expected_tokens


def test_feedback_with_the_ids_the_client_received(server):
    client = server.openai_client()
    completion = client.completions.create(model=str(server.model), prompt="w7 w8 w9 w10 w11", max_tokens=1)
    chat = client.chat.completions.create(
        model=str(server.model), messages=[{"role": "user", "content": "w1 w2"}], max_tokens=1
    )
    tagged = _complete(server, "w3 w4", **{"X-Request-Id": "client-chosen-id"})
    assert tagged["id"] == "cmpl-client-chosen-id"
    cases = [(completion.id, completion.usage.prompt_tokens, False),
             (chat.id, chat.usage.prompt_tokens, True),
             (tagged["id"], tagged["usage"]["prompt_tokens"], False)]
    for request_id, prompt_tokens, correct in cases:
        before = _samples(server, "vllm_chunked_kv_feedback_total")
        response = _feedback(server, request_id, correct)
        assert response.status_code == 200, response.text
        phase = prompt_tokens % HOP
        assert response.json()["phase"] == phase
        outcome = "correct" if correct else "incorrect"
        key = tuple(sorted({"model_name": str(server.model), "engine": "0", "phase": str(phase),
                            "outcome": outcome}.items()))
        after = _samples(server, "vllm_chunked_kv_feedback_total")
        assert after[key] == before[key] + 1
        assert sum(after.values()) == sum(before.values()) + 1
        assert _feedback(server, request_id).status_code == 409


def test_feedback_errors_over_http(server):
    before = _samples(server, "vllm_chunked_kv_feedback_total")
    assert _feedback(server, "cmpl-does-not-exist").status_code == 404
    bad = httpx.post(f"{server.base_url}/v1/chunked_kv/feedback", json={"request_id": "x", "correct": "no"}, timeout=30)
    assert bad.status_code == 422
    assert httpx.post(f"{server.base_url}/v1/chunked_kv/feedback", content=b"{", timeout=30).status_code == 422
    assert _samples(server, "vllm_chunked_kv_feedback_total") == before


def test_config_route_and_gauges_report_the_active_backend(server, tiny_llama):
    view = httpx.get(f"{server.base_url}/v1/chunked_kv/config", timeout=10).json()
    assert view["attention_backend"] == "chunked_kv" and view["compression_active"] is True
    assert view["phase_hop"] == HOP
    assert view["chunked_kv"]["chunk_size"] == 8 and view["chunked_kv"]["hop"] == HOP
    assert view["feedback_store"]["kind"] == "memory"
    model_cfg = json.loads((tiny_llama / "config.json").read_text())
    head_size = model_cfg["hidden_size"] // model_cfg["num_attention_heads"]
    uncompressed = 2 * model_cfg["num_hidden_layers"] * model_cfg["num_key_value_heads"] * head_size * 4  # float32
    ratio = 8 / 2  # overlap: 2 rows per chunk_size tokens (docs/design.md §4)
    assert view["kv_cache"]["uncompressed_bytes_per_token"] == uncompressed
    assert view["kv_cache"]["compression_ratio"] == ratio
    base = (("engine", "0"), ("model_name", str(server.model)))
    assert _samples(server, "vllm_chunked_kv_compression_ratio") == {base: ratio}
    assert _samples(server, "vllm_chunked_kv_cache_bytes_per_token") == {base: uncompressed / ratio}
    assert _samples(server, "vllm_chunked_kv_hop_tokens") == {base: HOP}
    capacity = _samples(server, "vllm_chunked_kv_cache_capacity_tokens")[base]
    assert capacity == view["kv_cache"]["capacity_tokens"] > 0
    (info,) = _samples(server, "vllm_chunked_kv_config_info")
    assert dict(info)["backend"] == "chunked_kv" and dict(info)["mitigation"] == "overlap"
