"""CHUNKED_KV's output does not depend on how vLLM schedules the work: greedy
tokens are identical with prefix caching on and off, with 32-token and
4096-token steps, with each request alone or 8 at a time, under forced
preemption (a KV budget too small for 8 at a time: the scheduler must have
preempted, or the test fails), and with uniform decode batches planned on
the device (`ops/decode_plan.py`, the default with the C++ kernels) and in
Python (`ops/step_plan.py`; the log must say which), for every mitigation and for configs
that compress (prompts far longer than the window) and use both kinds of
page sets: compressed pages written at chunk completion, and raw pages with
kept leading rows (sinks, staggered grid origins). The staggered config also
aligns each request's grid to its prompt end (`align`): the shift comes from
the prompt length alone, so preemption and recomputation must not move it,
and round 2's extended prompts (other lengths) must not hit round 1's pages
of another grid. With dynamic boundaries, a prefix hit shares unit slots
whose chunks were cut from keys of the shared prefix only.

Round 2 repeats or extends the round-1 prompts, so with caching on it starts
from prefix-cache hits of both page sets (32-token pages: hits land every
few chunks).

Each schedule generates the tokens it needs: the baseline and the preempted
run 256 (running decodes must outgrow the small budget), the others 32
(8 sealed chunks past the prompt at chunk 4) and are held to the baseline's
first 32. Each config is an xdist group of its own, so the six spread over
the workers."""

from __future__ import annotations

import random

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.runner.engine import generate
from vllm_chunked_kv.models.tiny import vocabulary

pytestmark = [pytest.mark.slow, pytest.mark.engine]

PREEMPTING_KV = 384 << 10  # bytes at 4 tokens per stored row: not all 8 prompts fit with their decodes
LONG_TOKENS = 256  # long enough that running decodes outgrow the small budget
SHORT_TOKENS = 32  # what the other schedules need: decodes across several chunk boundaries
BASELINE = "cached, 32-token steps, 8 at a time"

CONFIGS = {
    "none": dict(mitigation="none", window=16),
    "boundary-sinks": dict(mitigation="boundary", window=16, sink_tokens=5),
    "stride2": dict(mitigation="stride2", window=12, sink_tokens=2),
    "overlap-key_norm": dict(mitigation="overlap", window=12, pooling="key_norm"),
    "stagger-align": dict(mitigation="stagger", window=16, sink_tokens=1, align="prompt_end"),
    # 32-token pages: unit slots lag their tokens by one page (`layout.dynamic_lag_pages`), so window >= 32 + 8
    "dynamic": dict(boundaries="dynamic", min_chunk=2, window=40, sink_tokens=1),
}
SCHEDULES = {
    BASELINE: dict(enable_prefix_caching=True, max_num_batched_tokens=32, long=True),
    "no cache": dict(enable_prefix_caching=False, max_num_batched_tokens=32),
    "4096-token steps": dict(enable_prefix_caching=True, max_num_batched_tokens=4096),
    "one at a time": dict(enable_prefix_caching=True, max_num_batched_tokens=32, alone=True),
    "preempted": dict(enable_prefix_caching=True, max_num_batched_tokens=64, max_model_len=768, preempting=True,
                      long=True),
    "decodes planned in Python": dict(enable_prefix_caching=True, max_num_batched_tokens=32,
                                      env={"CHUNKED_KV_DECODE_PLAN": "python"}),
}


def make_rounds(seed: int) -> list[list[list[int]]]:
    """Round 1: 8 prompts of 60..400 tokens. Round 2: 4 of them extended, 4 repeated."""
    rng = random.Random(seed)
    vocab = vocabulary()
    bos, words = vocab.index("<bos>"), [i for i, w in enumerate(vocab) if w.startswith("w")]
    first = [[bos] + rng.choices(words, k=rng.randint(60, 400)) for _ in range(8)]
    second = [p + rng.choices(words, k=rng.randint(1, 90)) for p in first[:4]] + first[4:]
    return [first, second]


def run(model, settings: dict, schedule: dict, rounds) -> tuple[list[list[int]], int]:
    """Greedy tokens of every prompt, in order, and the number of preemptions."""
    schedule = dict(schedule)
    max_tokens = LONG_TOKENS if schedule.pop("long", False) else SHORT_TOKENS
    alone = schedule.pop("alone", False)
    env = schedule.pop("env", None)
    if schedule.pop("preempting", False):  # the same pressure whatever a config stores per token
        schedule["kv_cache_memory_bytes"] = int(PREEMPTING_KV * 4 / ChunkedKVConfig(**settings).tokens_per_state)
    if alone:
        rounds = [[prompt] for prompts in rounds for prompt in prompts]
    engine = dict(attention_backend="chunked_kv", additional_config={"chunked_kv": settings}, block_size=32,
                  **schedule)
    result = generate(model, engine, rounds, max_tokens=max_tokens, env=env)
    # The mechanism ran, not only the outputs agree: decodes are planned on the
    # device by default with the C++ kernels, in Python when asked (always with
    # dynamic boundaries).
    log = result["log"]
    on_device = "kernels on cpu: cpp" in log if env is None else env["CHUNKED_KV_DECODE_PLAN"] == "device"
    on_device = on_device and settings.get("boundaries") != "dynamic"
    assert f"uniform decode batches are planned {'on the device' if on_device else 'in Python'}" in log
    return [tokens for round_outputs in result["outputs"] for tokens in round_outputs], result["preemptions"]


@pytest.mark.parametrize("config", [pytest.param(c, marks=pytest.mark.xdist_group(f"invariance-{c}")) for c in CONFIGS])
def test_outputs_do_not_depend_on_scheduling(config, tiny_llama):
    rounds = make_rounds(seed=len(config))
    results = {name: run(tiny_llama, CONFIGS[config], schedule, rounds) for name, schedule in SCHEDULES.items()}
    assert results["preempted"][1] > 0, "the small KV budget did not force a preemption"
    baseline, _ = results.pop(BASELINE)
    assert len(baseline) == 16 and all(len(tokens) == LONG_TOKENS for tokens in baseline)
    for name, (outputs, _) in results.items():
        asked = LONG_TOKENS if SCHEDULES[name].get("long") else SHORT_TOKENS
        assert outputs == [want[:asked] for want in baseline], name
