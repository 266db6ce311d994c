"""Contract of prefix caching with CHUNKED_KV (docs/prefix-caching.md), in a real vLLM engine.

For each mitigation and stagger, with sinks and without (chunk 4, window 32,
tiny Llama, greedy):

- a 600-token prompt sent again hits at least prompt - window - chunk_size -
  alignment tokens (vLLM's `num_cached_tokens`; the alignment is vLLM's hit
  granularity over both page sets, the block size or a small multiple);
- a 4-turn chat whose every turn resends the conversation so far reuses the
  previous turns the same way;
- the first 400 tokens of the 600 with 3 new ones, and the first 300 with
  300 or 50 new ones (shared system prompts shorter than the first prompt)
  hit the same way with every retention interval (vLLM's
  `--prefix-cache-retention-interval`, default 0): the pool has room, so the
  first prompt's step kept its spare raw pages. With `prefix_spare_pages`
  off at interval 0, as with vLLM's own sliding-window layers, the first
  two are recomputed, and the 400 + 3 request keeps the tail before the
  shared prefix (vLLM's shared-prefix junction), so the next request
  sharing it hits (the first 300 with 300 new tokens, whose own end is far
  from the junction, then with 50 others);
- outputs with hits equal those of the same engine with prefix caching off,
  which hits nothing;
- under a KV budget that other prompts overflow between two sends of the
  same prompt, the hit shrinks (pages were evicted) and the tokens stay
  those of a fresh computation: no stale raw row is served;
- with per-request grid alignment (`align: prompt_end`), a request hits
  only pages of requests whose prompt length has the same remainder mod
  hop (same grid): sharing 400 tokens with a 600-token prompt, a 403-token
  prompt hits nothing and a 404-token one hits as above, and the tokens
  equal those of an engine without prefix caching.
"""

from __future__ import annotations

import random

import pytest

from .engine import run

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.download]

WINDOW, CHUNK = 32, 4
CONFIGS = {
    "none": {"mitigation": "none"},
    "none-sinks": {"mitigation": "none", "sink_tokens": 4},
    "boundary": {"mitigation": "boundary", "sink_tokens": 4},
    "overlap": {"mitigation": "overlap"},
    "stride2": {"mitigation": "stride2", "chunk_size": 2, "sink_tokens": 4},
    "stagger": {"mitigation": "stagger", "sink_tokens": 4},
    "none-sinks-no-spare": {"mitigation": "none", "sink_tokens": 4, "prefix_spare_pages": False},
}


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(10, 200) for _ in range(n)]


PROMPT = _tokens(0, 600)
CHAT = _tokens(1, 1400)
TURNS = [CHAT[:n] for n in (350, 700, 1050, 1400)]  # each turn: the conversation so far plus a new message
ROUNDS = [[PROMPT], [PROMPT], [PROMPT[:400] + [5, 6, 7]],
          [PROMPT[:300] + _tokens(2, 300)], [PROMPT[:300] + _tokens(3, 50)], *[[turn] for turn in TURNS]]
SHARED = [None, 600, 400, 300, 300, None, 350, 700, 1050]  # tokens each round shares with an earlier one
SYSTEM_PROMPTS = (2, 3)  # the rounds whose shared prefix ends inside earlier prompts, first met there


def _engine(settings: dict, **extra) -> dict:
    chunked = {"chunk_size": CHUNK, "window": WINDOW, **settings}
    return {"attention_backend": "chunked_kv", "additional_config": {"chunked_kv": chunked}, "dtype": "float32",
            "max_model_len": 2048, **extra}


CASES = [(name, 0) for name in CONFIGS] + [("none-sinks", None), ("stagger", 64)]  # (config, retention interval)


@pytest.fixture(scope="module", params=CASES, ids=[f"{name}-retention{r}" for name, r in CASES])
def pair(request, tiny_llama):
    name, retention = request.param
    cached = run(tiny_llama, _engine(CONFIGS[name], prefix_cache_retention_interval=retention), ROUNDS, max_tokens=6)
    fresh = run(tiny_llama, _engine(CONFIGS[name], enable_prefix_caching=False), ROUNDS, max_tokens=6)
    return cached, fresh, retention, CONFIGS[name].get("prefix_spare_pages", True)


def test_hits_reach_the_window_before_the_shared_prefix(pair):
    cached, _, retention, spare = pair
    hits = [c[0] for c in cached["cached"]]
    floor = WINDOW + CHUNK + max(cached["alignment_tokens"], retention or 0)
    for i, (shared, hit) in enumerate(zip(SHARED, hits)):
        if shared is None or (i in SYSTEM_PROMPTS and retention == 0 and not spare):
            assert hit == 0, hits
        else:
            assert shared - floor <= hit < shared, hits


def test_outputs_with_hits_equal_outputs_without(pair):
    cached, fresh, *_ = pair
    assert all(c[0] == 0 for c in fresh["cached"])
    assert cached["outputs"] == fresh["outputs"]


@pytest.mark.parametrize("name", ["none-sinks", "stagger"])
def test_eviction_never_serves_stale_rows(tiny_llama, name):
    others = [[_tokens(100 + i, 600)] for i in range(8)]
    rounds = [[PROMPT], *others, [PROMPT]]
    small = _engine(CONFIGS[name], kv_cache_memory_bytes=1 << 20, max_num_seqs=1, max_model_len=700)
    cached = run(tiny_llama, small, rounds, max_tokens=6)
    fresh = run(tiny_llama, _engine(CONFIGS[name], enable_prefix_caching=False), [[PROMPT]], max_tokens=6)
    assert cached["cached"][-1][0] < 600 - WINDOW - CHUNK - cached["alignment_tokens"]  # evicted, at least in part
    assert cached["outputs"][-1] == cached["outputs"][0] == fresh["outputs"][0]


def test_align_hits_only_within_a_grid(tiny_llama):
    shared = PROMPT[:400]
    rounds = [[PROMPT], [shared + [5, 6, 7]], [shared + [5, 6, 7, 8]], [PROMPT]]  # shifts 0, 3, 0, 0
    settings = {"mitigation": "stagger", "sink_tokens": 4, "align": "prompt_end"}
    cached = run(tiny_llama, _engine(settings), rounds, max_tokens=6)
    fresh = run(tiny_llama, _engine(settings, enable_prefix_caching=False), rounds, max_tokens=6)
    hits = [c[0] for c in cached["cached"]]
    floor = WINDOW + CHUNK + cached["alignment_tokens"]
    assert hits[0] == 0 and hits[1] == 0, hits  # another grid: nothing shared
    assert 400 - floor <= hits[2] < 400 and 600 - floor <= hits[3] < 600, hits
    assert cached["outputs"] == fresh["outputs"]
