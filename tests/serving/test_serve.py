"""`vllm serve <tiny model> --attention-backend chunked_kv` runs as a real
subprocess on 127.0.0.1: /v1/completions and /v1/chat/completions answer
through the openai client, and the server's own log shows that the engine's
worker process built its layers with CHUNKED_KV. A long prompt sent twice
hits the prefix cache (docs/prefix-caching.md) as vLLM's own counters show
it: `usage.prompt_tokens_details.cached_tokens` and
`vllm:prefix_cache_hits_total`, with the same completion; two prompts
sharing a system prompt (its first 300 tokens) after it both hit the shared
part (the first prompt's step kept its spare raw pages: the pool had room).

The model directory carries its settings in `chunked_kv_serve.json` and the
command line gives none: the worker builds its layers with the file's window,
the API server's metrics report it, and every process that logs where the
settings came from names the file."""

from __future__ import annotations

import random
import re
import shutil
import urllib.request

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.core.serve_file import SERVE_FILE, write_serve_file
from vllm_chunked_kv.runner.server import VllmServer

pytestmark = pytest.mark.server


def test_serve_with_chunked_kv(tiny_llama, tmp_path):
    model_dir = tmp_path / "tiny-llama"
    shutil.copytree(tiny_llama, model_dir)
    write_serve_file(model_dir, ChunkedKVConfig(chunk_size=4, window=64))
    with VllmServer(model_dir, ["--attention-backend", "chunked_kv", "--enable-prompt-tokens-details"]) as server:
        client = server.openai_client()
        model = client.models.list().data[0].id
        completion = client.completions.create(model=model, prompt="w1 w2 w3 w4", max_tokens=4, temperature=0)
        assert completion.usage.prompt_tokens == 5  # <bos> + 4 words
        assert len(completion.choices[0].text.split()) == 4
        chat = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=3, temperature=0
        )
        assert len(chat.choices[0].message.content.split()) == 3
        rng = random.Random(0)
        long = " ".join(f"w{rng.randint(0, 200)}" for _ in range(600))
        first, second = (client.completions.create(model=model, prompt=long, max_tokens=4, temperature=0)
                         for _ in range(2))
        system = " ".join(long.split()[:300])  # a shared system prompt, then two different questions
        questions = [" ".join(f"q{rng.randint(0, 200)}" for _ in range(n)) for n in (300, 20)]
        siblings = [client.completions.create(model=model, prompt=f"{system} {q}", max_tokens=1, temperature=0)
                    for q in questions]
        metrics = urllib.request.urlopen(f"{server.base_url}/metrics", timeout=30).read().decode()
        log = server.log()
    assert second.choices[0].text == first.choices[0].text
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 601 - 64 - 4 - 128 <= cached < 601, cached  # 128: more than vLLM's hit alignment here
    sibling_hits = [s.usage.prompt_tokens_details.cached_tokens for s in siblings]
    assert all(n >= 301 - 64 - 4 - 128 for n in sibling_hits), sibling_hits
    hits = [float(line.split()[-1]) for line in metrics.splitlines() if line.startswith("vllm:prefix_cache_hits_total")]
    assert hits and sum(hits) >= cached
    worker_lines = [line for line in log.splitlines() if "Using CHUNKED_KV attention backend" in line]
    assert worker_lines, log[-3000:]
    # The layer was built in the spawned engine/worker process, not the API server.
    assert not any("APIServer" in line for line in worker_lines)
    assert re.search(r'"window": 64', worker_lines[0])
    assert re.search(r'^vllm_chunked_kv_window_tokens\{.*\} 64\.0$', metrics, re.M)
    sources = [line for line in log.splitlines() if "chunked_kv: settings from" in line]
    assert sources and all(f"settings from {model_dir / SERVE_FILE} (" in line for line in sources), sources
