"""`vllm serve <tiny model> --attention-backend chunked_kv` runs as a real
subprocess on 127.0.0.1: /v1/completions and /v1/chat/completions answer
through the openai client, and the server's own log shows that the engine's
worker process built its layers with CHUNKED_KV."""

from __future__ import annotations

import re

import pytest

from vllm_chunked_kv.testing.server import VllmServer

pytestmark = pytest.mark.server


def test_serve_with_chunked_kv(tiny_llama):
    with VllmServer(tiny_llama, ["--attention-backend", "chunked_kv",
                                 "--additional-config", '{"chunked_kv": {"chunk_size": 4, "window": 64}}']) as server:
        client = server.openai_client()
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="w1 w2 w3 w4", max_tokens=4, temperature=0)
        assert completion.usage.prompt_tokens == 5  # <bos> + 4 words
        assert len(completion.choices[0].text.split()) == 4
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=3, temperature=0
        )
        assert len(chat.choices[0].message.content.split()) == 3
        log = server.log()
    worker_lines = [line for line in log.splitlines() if "Using CHUNKED_KV attention backend" in line]
    assert worker_lines, log[-3000:]
    # The layer was built in the spawned engine/worker process, not the API server.
    assert not any("APIServer" in line for line in worker_lines)
    assert re.search(r'"window": 64', worker_lines[0])
