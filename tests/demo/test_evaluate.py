"""Contract of the demo evaluation helpers (`demo.evaluate`), on an untrained model.

- `encode` gives <bos> + one id per word; prompts of different lengths are
  refused in one batch, and `predict` groups them by length itself;
- `predict` returns the argmax word at the last position, for full and
  chunked attention alike, independent of the batch size;
- `needle_sweep` puts `per_phase` prompts in each phase group (position mod hop).
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.demo.architecture import build_model
from vllm_chunked_kv.demo.evaluate import encode, needle_sweep, predict
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB, make_prompt


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return build_model(0).eval()


def test_encode():
    prompt = make_prompt(random.Random(0), haystack_len=20, num_records=4)
    ids = encode([prompt])
    assert ids.shape == (1, prompt.num_tokens)
    assert [VOCAB[i] for i in ids[0].tolist()] == ["<bos>"] + prompt.text.split()
    with pytest.raises(ValueError):
        encode([prompt, make_prompt(random.Random(0), haystack_len=21, num_records=4)])


@pytest.mark.parametrize("cfg", [None, ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2)])
def test_predict_is_last_position_argmax(model, cfg):
    rng = random.Random(1)
    prompts = [make_prompt(rng, haystack_len=length, num_records=4) for length in (30, 40, 30, 40, 30)]
    words = predict(model, prompts, cfg, batch_size=2)
    assert words == predict(model, prompts, cfg, batch_size=64)
    from vllm_chunked_kv.hf.attention import chunked_attention

    with torch.no_grad(), chunked_attention(model, cfg):
        for prompt, word in zip(prompts, words):
            logits = model(input_ids=encode([prompt])).logits
            assert VOCAB[int(logits[0, -1].argmax())] == word


def test_needle_sweep_groups(model):
    result = needle_sweep(model, None, hop=4, per_phase=8, haystack_len=60, num_records=10, needle_range=(4, 50))
    assert [g.label for g in result.groups] == [0, 1, 2, 3]
    assert all(g.n == 8 for g in result.groups)
