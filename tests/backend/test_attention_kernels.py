"""The backend runs the kernel `ops/dispatch.py` chooses, end to end in vLLM.

With ``CHUNKED_KV_IMPL=triton`` and ``TRITON_INTERPRET=1`` (Triton's CPU
interpreter, set before the engine process imports Triton), and with the
default choice on CPU (the C++ kernels), the engine's log names the kernels
that run and vLLM's greedy tokens equal those of the PyTorch path
(``CHUNKED_KV_IMPL=torch``), over prompts long enough to seal chunks in the
prefill and during decoding, in one batch and with a prefix-cache hit, for
boundary retention with staggered grids and for overlapping key-norm pooling
on a GQA model.
"""

from __future__ import annotations

import random

import pytest

from vllm_chunked_kv.runner.engine import generate
from vllm_chunked_kv.models.tiny import vocabulary

pytestmark = pytest.mark.engine

CONFIGS = {
    "boundary-stagger": {"chunk_size": 4, "window": 8, "sink_tokens": 2, "mitigation": "boundary", "stagger": "heads"},
    "overlap-key_norm": {"chunk_size": 4, "window": 6, "sink_tokens": 1, "mitigation": "overlap",
                         "pooling": "key_norm"},
}


def _rounds() -> list[list[list[int]]]:
    rng = random.Random(1)
    vocab = vocabulary()
    bos, words = vocab.index("<bos>"), [i for i, w in enumerate(vocab) if w.startswith("w")]
    first = [[bos] + rng.choices(words, k=n) for n in (44, 23, 5)]
    return [first, [first[0] + rng.choices(words, k=9)]]  # the second round hits the prefix cache


@pytest.mark.parametrize("name, model_fixture", [("boundary-stagger", "tiny_llama"), ("overlap-key_norm", "tiny_qwen")])
def test_cpp_and_triton_kernels_in_vllm_equal_the_torch_path(name, model_fixture, request, monkeypatch):
    model = request.getfixturevalue(model_fixture)
    engine = {"attention_backend": "chunked_kv", "block_size": 16, "enable_prefix_caching": True,
              "additional_config": {"chunked_kv": CONFIGS[name]}}
    rounds = _rounds()
    monkeypatch.setenv("CHUNKED_KV_IMPL", "torch")
    torch_run = generate(model, engine, rounds, max_tokens=12)
    assert "chunked KV kernels on cpu: torch" in torch_run["log"]
    monkeypatch.delenv("CHUNKED_KV_IMPL")
    cpp_run = generate(model, engine, rounds, max_tokens=12)
    assert "chunked KV kernels on cpu: cpp (" in cpp_run["log"]
    assert cpp_run["outputs"] == torch_run["outputs"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("CHUNKED_KV_IMPL", "triton")
    triton_run = generate(model, engine, rounds, max_tokens=12)
    assert "chunked KV kernels on cpu: triton" in triton_run["log"]
    assert triton_run["outputs"] == torch_run["outputs"]
