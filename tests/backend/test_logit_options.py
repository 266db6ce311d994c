"""Models whose attention caps its logits (Gemma 2's `attn_logit_softcapping`)
are served, the cap applied in CHUNKED_KV's attention as in vLLM's own:

- tiny-gemma2 (cap 2, global layers only), every token raw (window 1024):
  greedy tokens equal vLLM's default CPU backend under chunked prefill and
  prefix-cache hits; the cap matters there (the same weights without it
  answer differently on the default backend).
- at chunk 4, window 16, for mitigations none, boundary and stagger: greedy
  tokens equal transformers running the reference chunked attention with
  the cap (`hf.attention`), and compression matters (full attention answers
  differently).
"""

from __future__ import annotations

import json
import shutil

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.engine import generate

from .test_attention_equivalence import make_rounds
from .test_attention_reference import MAX_TOKENS, WINDOW, prompts, reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.engine]


@pytest.fixture(scope="module")
def uncapped_gemma2(tiny_gemma2, tmp_path_factory):
    """tiny-gemma2's weights without its logit cap."""
    path = tmp_path_factory.mktemp("uncapped") / "tiny-gemma2-uncapped"
    shutil.copytree(tiny_gemma2, path)
    config = json.loads((path / "config.json").read_text())
    assert config["attn_logit_softcapping"] == 2.0
    config["attn_logit_softcapping"] = None
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_raw_window_matches_default_backend(tiny_gemma2, uncapped_gemma2):
    rounds = make_rounds()
    engine = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    default = generate(tiny_gemma2, engine, rounds)
    chunked = generate(tiny_gemma2, {**engine, "attention_backend": "chunked_kv",
                                     "additional_config": {"chunked_kv": {"window": 1024}}}, rounds)
    assert "Using CHUNKED_KV attention backend" in chunked["log"]
    assert chunked["outputs"] == default["outputs"]
    assert generate(uncapped_gemma2, engine, rounds)["outputs"] != default["outputs"]


@pytest.mark.parametrize("mitigation", ["none", "boundary", "stagger"])
def test_vllm_equals_reference(tiny_gemma2, mitigation):
    settings = {"window": WINDOW, "mitigation": mitigation}
    cfg = ChunkedKVConfig.from_additional_config({"chunked_kv": settings})
    batch = prompts(seed=len(mitigation))
    expected = reference_greedy(tiny_gemma2, cfg, batch)
    result = generate(tiny_gemma2, dict(attention_backend="chunked_kv", additional_config={"chunked_kv": settings},
                                        max_num_batched_tokens=32, enable_prefix_caching=True), [batch],
                      max_tokens=MAX_TOKENS)
    assert result["outputs"][0] == expected
    assert reference_greedy(tiny_gemma2, None, batch) != expected
