"""Hybrid attention models: a model's sliding-window layers keep exactly their
window on vLLM's default backend, its global layers are compressed, and a
model's logit cap (Gemma 2) and learned sink logits (GPT-OSS) are applied
in CHUNKED_KV's attention as in vLLM's own. Three tiny families, built
locally: tiny-gemma2 (cap 2, a sliding layer then a global one),
tiny-gemma3 (two sliding layers then a global one), tiny-gptoss (sinks, a
sliding layer then a global one); windows of 16.

- Every token raw in the global layers (window 1024): greedy tokens equal
  vLLM's default CPU backend under chunked prefill, with round 2's prompts
  hitting round 1's cached prefixes (counted); the family's feature matters
  there (the same weights without the cap, with a window wider than every
  prompt, or with every sink at -30, answer differently on the default
  backend). The log says which layers run where.
- At chunk 4, window 16, for mitigations none, boundary and stagger: greedy
  tokens equal transformers running the reference chunked attention in the
  global layers and the exact window in the sliding ones (`hf.attention`),
  and compression matters (full attention in the global layers answers
  differently).

With `sliding_window_layers: compress` the sliding-window layers are
compressed too, each query reading within its layer's window; tiny-mistral
(a window of 16 on both layers, refused without the setting) and
tiny-gemma3 (two compressed sliding layers and a global one):

- at chunk 1 (every row exact) greedy tokens equal the default backend's,
  with prefix hits counted, and the log says the sliding layers are
  compressed;
- at chunk 4 with a raw window of 4 (smaller than the model's 16, so
  compressed rows are read inside it), for none, boundary and stagger
  (tiny-gemma3: boundary): greedy tokens equal the reference with the layer's window
  (`reference.visible_set`, ``lookback``), and differ from full attention;
- vLLM frees the compressed pages behind each layer's window: at 1,024-token
  requests it admits more of them than the default backend does.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from vllm_chunked_kv.runner.engine import generate

from .test_attention_equivalence import make_rounds
from .test_attention_reference import WINDOW, check_vllm_equals_reference

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODELS = ["tiny_gemma2", "tiny_gemma3", "tiny_gptoss"]


def without_feature(model_dir, out_dir):
    """A copy of the model without what its family adds: tiny-gemma2 without
    its logit cap, tiny-gemma3 with a window wider than every prompt,
    tiny-gptoss with every sink logit at -30 (no weight)."""
    from safetensors.torch import load_file, save_file

    path = out_dir / f"{model_dir.name}-without"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "gpt_oss":
        weights = load_file(path / "model.safetensors")
        sinks = [name for name in weights if name.endswith(".sinks")]
        assert len(sinks) == config["num_hidden_layers"]
        weights.update({name: torch.full_like(weights[name], -30.0) for name in sinks})
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
        return path
    if config["model_type"] == "gemma2":
        assert config["attn_logit_softcapping"] == 2.0
        config["attn_logit_softcapping"] = None
    else:
        config["sliding_window"] = 4096
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("model_fixture", MODELS)
def test_raw_window_matches_default_backend(model_fixture, request, tmp_path):
    model = request.getfixturevalue(model_fixture)
    rounds = make_rounds()
    engine = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    default = generate(model, engine, rounds)
    chunked = generate(model, {**engine, "attention_backend": "chunked_kv",
                               "additional_config": {"chunked_kv": {"window": 1024}}}, rounds)
    assert "Using CHUNKED_KV attention backend" in chunked["log"]
    assert "sliding-window layers keep their window uncompressed on CPUAttentionBackend" in chunked["log"]
    assert chunked["outputs"] == default["outputs"]
    assert chunked["cached_tokens"][0] == 0 and chunked["cached_tokens"][1] >= 32
    assert generate(without_feature(model, tmp_path), engine, rounds)["outputs"] != default["outputs"]


@pytest.mark.parametrize("mitigation", ["none", "boundary", "stagger"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_vllm_equals_reference(model_fixture, mitigation, request):
    check_vllm_equals_reference(request.getfixturevalue(model_fixture), {"window": WINDOW, "mitigation": mitigation},
                                seed=len(mitigation))


COMPRESS = {"sliding_window_layers": "compress"}
SLIDING_MODELS = ["tiny_mistral", "tiny_gemma3"]


@pytest.mark.parametrize("model_fixture", SLIDING_MODELS)
def test_compressed_windows_at_chunk_1_match_default_backend(model_fixture, request):
    model = request.getfixturevalue(model_fixture)
    rounds = make_rounds()
    engine = dict(max_num_batched_tokens=32, enable_prefix_caching=True)
    default = generate(model, engine, rounds)
    settings = {"chunk_size": 1, "window": 16, "sink_tokens": 0, **COMPRESS}
    chunked = generate(model, {**engine, "attention_backend": "chunked_kv", "additional_config": {"chunked_kv": settings}},
                       rounds)
    assert "sliding-window layers are compressed too" in chunked["log"]
    assert chunked["outputs"] == default["outputs"]
    assert chunked["cached_tokens"][0] == 0 and chunked["cached_tokens"][1] >= 32


@pytest.mark.parametrize("model_fixture, mitigation", [("tiny_mistral", "none"), ("tiny_mistral", "boundary"),
                                                        ("tiny_mistral", "stagger"), ("tiny_gemma3", "boundary")])
def test_compressed_windows_equal_reference(model_fixture, mitigation, request):
    check_vllm_equals_reference(request.getfixturevalue(model_fixture),
                                {"window": 4, "mitigation": mitigation, **COMPRESS}, seed=len(mitigation))


def test_compressed_windows_free_their_pages(tiny_mistral):
    def concurrency(engine: dict) -> float:
        log = generate(tiny_mistral, {"max_model_len": 1024, **engine}, [[[2, 20, 21]]], max_tokens=1)["log"]
        return float(re.search(r"Maximum concurrency for 1,024 tokens per request: ([\d.,]+)x", log)[1].replace(",", ""))

    chunked = {"attention_backend": "chunked_kv",
               "additional_config": {"chunked_kv": {"chunk_size": 4, "window": 4, **COMPRESS}}}
    assert concurrency(chunked) > concurrency({})
