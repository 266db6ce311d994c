"""Models whose attention caps its logits (Gemma 2's `attn_logit_softcapping`)
or learns sink logits (GPT-OSS's `sinks`, one per query head, in every
softmax's denominator) are served, each applied in CHUNKED_KV's attention as
in vLLM's own. On tiny-gemma2 (cap 2), global layers only (vLLM's GPT-OSS
puts a sliding window on every other layer, so tiny-gptoss's sinks are
checked here once sliding-window layers are served; the kernels' sinks are
checked on the schedule harness, transformers' in tests/hf):

- every token raw (window 1024): greedy tokens equal vLLM's default CPU
  backend under chunked prefill and prefix-cache hits; the option matters
  there (the same weights without the cap, or with every sink at -30, answer
  differently on the default backend);
- at chunk 4, window 16, for mitigations none, boundary and stagger: greedy
  tokens equal transformers running the reference chunked attention with
  the option (`hf.attention`), and compression matters (full attention
  answers differently).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.engine import generate

from .test_attention_equivalence import make_rounds
from .test_attention_reference import MAX_TOKENS, WINDOW, prompts, reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.engine]

MODELS = ["tiny_gemma2"]  # tiny_gptoss joins when sliding-window layers are served: vLLM's GPT-OSS always has them


def without_option(model_dir, out_dir):
    """A copy of tiny-gemma2 without its logit cap, or of tiny-gptoss with every sink logit at -30 (no weight)."""
    from safetensors.torch import load_file, save_file

    path = out_dir / f"{model_dir.name}-without"
    shutil.copytree(model_dir, path)
    config = json.loads((path / "config.json").read_text())
    if config["model_type"] == "gemma2":
        assert config["attn_logit_softcapping"] == 2.0
        config["attn_logit_softcapping"] = None
        (path / "config.json").write_text(json.dumps(config))
    else:
        weights = load_file(path / "model.safetensors")
        sinks = [name for name in weights if name.endswith(".sinks")]
        assert len(sinks) == config["num_hidden_layers"]
        weights.update({name: torch.full_like(weights[name], -30.0) for name in sinks})
        save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
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
    assert chunked["outputs"] == default["outputs"]
    assert generate(without_option(model, tmp_path), engine, rounds)["outputs"] != default["outputs"]


@pytest.mark.parametrize("mitigation", ["none", "boundary", "stagger"])
@pytest.mark.parametrize("model_fixture", MODELS)
def test_vllm_equals_reference(model_fixture, mitigation, request):
    model = request.getfixturevalue(model_fixture)
    settings = {"window": WINDOW, "mitigation": mitigation}
    cfg = ChunkedKVConfig.from_additional_config({"chunked_kv": settings})
    batch = prompts(seed=len(mitigation))
    expected = reference_greedy(model, cfg, batch)
    result = generate(model, dict(attention_backend="chunked_kv", additional_config={"chunked_kv": settings},
                                  max_num_batched_tokens=32, enable_prefix_caching=True), [batch],
                      max_tokens=MAX_TOKENS)
    assert result["outputs"][0] == expected
    assert reference_greedy(model, None, batch) != expected
