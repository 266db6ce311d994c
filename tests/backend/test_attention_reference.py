"""CHUNKED_KV in vLLM computes docs/design.md §3-4 exactly: for every mitigation x
pooling mode (and staggered grids, slot gains per layer, per-request grid alignment, whose
prompts cover every length mod hop, and dynamic boundaries), greedy tokens from `vllm` equal those of
the same model run in transformers with the reference chunked attention, on
20 prompts longer than window + 4 * chunk_size, generated under chunked
prefill (32-token steps) with prefix caching on."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.engine import generate
from vllm_chunked_kv.models.tiny import vocabulary

pytestmark = [pytest.mark.slow, pytest.mark.engine]

WINDOW = 16
MAX_TOKENS = 6
GAINS = [0.1, 0.2, 0.3, 0.4]
CASES = {
    "none-mean": dict(mitigation="none"),
    "none-gated": dict(mitigation="none", pooling="gated", slot_gains=GAINS),
    "none-key_norm": dict(mitigation="none", pooling="key_norm", sink_tokens=3),
    "boundary-mean": dict(mitigation="boundary", sink_tokens=2),
    "boundary-gated": dict(mitigation="boundary", pooling="gated", slot_gains=GAINS),
    "boundary-key_norm": dict(mitigation="boundary", pooling="key_norm"),
    "overlap-mean": dict(mitigation="overlap"),
    "overlap-gated": dict(mitigation="overlap", pooling="gated", slot_gains=GAINS),
    "overlap-key_norm": dict(mitigation="overlap", pooling="key_norm"),
    "stride2-mean": dict(mitigation="stride2", chunk_size=2),
    "stride2-gated": dict(mitigation="stride2", chunk_size=2, pooling="gated", slot_gains=[0.3, 0.7]),
    "stride2-key_norm": dict(mitigation="stride2", chunk_size=2, pooling="key_norm"),
    "stagger-heads": dict(mitigation="stagger", sink_tokens=1),
    "stagger-gated": dict(mitigation="stagger", pooling="gated", slot_gains=GAINS),
    "per-layer-gated": dict(mitigation="stagger", pooling="gated", slot_gains=[[0.0, 0.0, 0.1, 0.9], [0.9, 0.1, 0.0, 0.0]]),
    "stagger-key_norm": dict(mitigation="stagger", pooling="key_norm", sink_tokens=2),
    "stagger-layers": dict(stagger="layers", sink_tokens=1),
    "no-proportional": dict(mitigation="none", proportional=False),
    "align-stagger": dict(mitigation="stagger", sink_tokens=1, align="prompt_end"),
    "dynamic": dict(boundaries="dynamic", min_chunk=2, sink_tokens=1),
}


def prompts(seed: int, count: int = 20) -> list[list[int]]:
    rng = random.Random(seed)
    vocab = vocabulary()
    bos, words = vocab.index("<bos>"), [i for i, w in enumerate(vocab) if w.startswith("w")]
    return [[bos] + rng.choices(words, k=rng.randint(WINDOW + 4 * 4 + 1, 150)) for _ in range(count)]


def reference_greedy(model_dir, cfg: ChunkedKVConfig, batch: list[list[int]],
                     cache_dtype: str | None = None) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    from vllm_chunked_kv.hf.attention import chunked_attention

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    for ids in batch:
        shift = cfg.grid_shift(len(ids)) if cfg else 0  # the prompt's length fixes the grid of every step
        ids, new = list(ids), []
        with torch.no_grad(), chunked_attention(model, cfg, grid_shifts=[shift], cache_dtype=cache_dtype):
            for _ in range(MAX_TOKENS):
                logits = model(torch.tensor([ids])).logits[0, -1]  # [vocab]
                new.append(int(logits.argmax()))
                ids.append(new[-1])
        outputs.append(new)
    return outputs


def check_vllm_equals_reference(model, settings: dict, seed: int) -> tuple[ChunkedKVConfig, list, list]:
    """vLLM's greedy tokens with `settings` equal the reference's on `prompts(seed)`,
    and full attention answers differently somewhere (the case compresses);
    returns (the config, the prompts, the tokens)."""
    cfg = ChunkedKVConfig.from_additional_config({"chunked_kv": settings})
    batch = prompts(seed=seed)
    expected = reference_greedy(model, cfg, batch)
    result = generate(model, dict(attention_backend="chunked_kv", additional_config={"chunked_kv": settings},
                                  max_num_batched_tokens=32, enable_prefix_caching=True), [batch],
                      max_tokens=MAX_TOKENS)
    assert result["outputs"][0] == expected
    assert reference_greedy(model, None, batch) != expected
    return cfg, batch, expected


@pytest.mark.parametrize("case", list(CASES))
def test_vllm_equals_reference(case, request):
    model = request.getfixturevalue("tiny_qwen" if case.endswith("gated") else "tiny_llama")
    settings = {"window": WINDOW, **CASES[case]}
    cfg, batch, expected = check_vllm_equals_reference(model, settings, seed=len(case))
    if cfg.per_layer_gains:  # and each layer its own gains: layer 0's everywhere answers differently
        first = ChunkedKVConfig.from_additional_config({"chunked_kv": {**settings, "slot_gains": cfg.slot_gains[0]}})
        assert reference_greedy(model, first, batch) != expected
