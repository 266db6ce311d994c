"""With every token kept raw (window >= max_model_len), CHUNKED_KV is exact
attention: greedy tokens equal vLLM's default CPU backend, whatever the
scheduling (chunked prefill in 32-token steps, prefix-cache hits, a batch of
concurrent requests), on both tiny test models."""

from __future__ import annotations

import json
import random

import pytest

from vllm_chunked_kv.runner.engine import generate
from vllm_chunked_kv.models.tiny import vocabulary

pytestmark = pytest.mark.engine

FULL_WINDOW = json.dumps({"chunked_kv": {"window": 1024}})


def make_rounds(seed: int = 0) -> list[list[list[int]]]:
    """Round 1: 12 fresh prompts (5..400 tokens). Round 2: 12 prompts that
    extend round-1 prompts (prefix-cache hits) plus repeats of two of them."""
    rng = random.Random(seed)
    vocab = vocabulary()
    bos, words = vocab.index("<bos>"), [i for i, w in enumerate(vocab) if w.startswith("w")]
    first = [[bos] + rng.choices(words, k=rng.randint(4, 400)) for _ in range(12)]
    second = [p + rng.choices(words, k=rng.randint(1, 60)) for p in first[:10]] + [first[0], first[5]]
    return [first, second]


@pytest.mark.parametrize("model_fixture", ["tiny_llama", "tiny_qwen"])
def test_raw_window_matches_default_backend(model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    rounds = make_rounds()
    engine = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    default = generate(model, engine, rounds)
    chunked = generate(model, {**engine, "attention_backend": "chunked_kv",
                               "additional_config": json.loads(FULL_WINDOW)}, rounds)
    assert "Using CHUNKED_KV attention backend" in chunked["log"]
    assert "Using CHUNKED_KV attention backend" not in default["log"]
    assert sum(len(r) for r in rounds) >= 20
    assert chunked["outputs"] == default["outputs"]
