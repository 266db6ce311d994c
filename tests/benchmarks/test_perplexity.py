"""Contract of benchmarks/perplexity.py, on the tiny Llama (fp32) through vLLM.

- `perplexity(model, settings, documents=...)` scores every next token of
  each token-id document through vLLM's prompt log-probs: the default
  backend's mean NLL equals the same NLL computed directly in transformers
  (fp32) within 1e-3, overall and beyond the window.
- CHUNKED_KV with a config that must equal full attention (chunk_size 1:
  every "compressed" row is one raw token) gives the default backend's
  perplexity within 1e-3 in NLL; a compressing config (chunk 4, window 16)
  gives a clearly different one, so the chunked path really ran.
- The result counts the scored tokens (one per position after the first)
  and those at query positions >= `beyond`; `served_settings` reads a model
  directory's chunked_kv_serve.json and `format_table` names every mode.
- `by_position` splits the perplexity by query position: every token in
  exactly one bucket, the buckets' perplexities those of their tokens.
- `repeat_kind` marks a scored token "far" when the n-gram it ends was seen
  only more than `window` positions before its query, "near" when seen
  within them, else "new"; `by_repeat` puts every token in its kind.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

DOCS, TOKENS, BEYOND = 2, 200, 40
TOLERANCE = 1e-3  # in mean NLL (nats)


@pytest.fixture(scope="module")
def ppl(load_benchmark):
    return load_benchmark("perplexity")


@pytest.fixture(scope="module")
def documents():
    rng = random.Random(0)
    return [[2] + [rng.randrange(10, 260) for _ in range(TOKENS - 1)] for _ in range(DOCS)]  # <bos> + words


def _transformers_nll(model_dir, documents) -> tuple[float, float]:
    """Mean NLL of every next token (and of those predicted at positions >= BEYOND), fp32 full attention."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(documents)  # [docs, T]
    with torch.no_grad():
        logits = model(input_ids=ids).logits  # [docs, T, vocab]
    logprobs = torch.log_softmax(logits[:, :-1].double(), dim=-1)  # [docs, T-1, vocab]
    nll = -logprobs.gather(-1, ids[:, 1:, None])[..., 0]  # [docs, T-1]
    return nll.mean().item(), nll[:, BEYOND:].mean().item()


@pytest.mark.slow
@pytest.mark.engine
def test_perplexity_matches_transformers_and_full_attention(ppl, tiny_llama, documents):
    kw = dict(documents=documents, dtype="float32", beyond=BEYOND, engine={"kv_cache_memory_bytes": 64 << 20})
    default = ppl.perplexity(tiny_llama, None, **kw)
    assert default["tokens"] == DOCS * (TOKENS - 1)
    assert default["tokens_beyond"] == DOCS * (TOKENS - 1 - BEYOND)
    assert default["ppl"] == pytest.approx(math.exp(default["nll"]))

    direct, direct_beyond = _transformers_nll(tiny_llama, documents)
    assert abs(default["nll"] - direct) < TOLERANCE, (default["nll"], direct)
    assert abs(default["nll_beyond"] - direct_beyond) < TOLERANCE, (default["nll_beyond"], direct_beyond)

    exact = ppl.perplexity(tiny_llama, {"chunk_size": 1, "window": 16}, **kw)
    assert abs(exact["nll"] - default["nll"]) < TOLERANCE, (exact["nll"], default["nll"])

    compressed = ppl.perplexity(tiny_llama, {"chunk_size": 4, "window": 16, "sink_tokens": 4}, **kw)
    assert abs(compressed["nll_beyond"] - default["nll_beyond"]) > 100 * TOLERANCE, compressed
    rows = [{"mode": "default", **default}, {"mode": "none", **compressed}]
    for row in rows:
        row["ppl_ratio"], row["ppl_beyond_ratio"] = row["ppl"] / default["ppl"], row["ppl_beyond"] / default["ppl_beyond"]
    table = ppl.format_table(rows)
    assert "| default |" in table and "| none |" in table and "1.000" in table


def test_modes_and_served_settings(ppl, tmp_path):
    assert ppl.mode_settings("default", tmp_path) is None
    assert ppl.mode_settings("stride2", tmp_path)["chunk_size"] == 2
    assert ppl.mode_settings("key_norm", tmp_path)["pooling"] == "key_norm"
    assert ppl.beyond_position(None) == 4 + 128 + 4
    with pytest.raises(FileNotFoundError):
        ppl.mode_settings("served", tmp_path)
    settings = {"chunk_size": 4, "window": 32, "sink_tokens": 4, "stagger": "heads"}
    serve = {"attention_backend": "chunked_kv", "additional_config": {"chunked_kv": settings}}
    (tmp_path / ppl.SERVE_FILE).write_text(json.dumps(serve))
    from vllm_chunked_kv.core.config import ChunkedKVConfig

    served = ChunkedKVConfig.from_additional_config({"chunked_kv": ppl.mode_settings("served", tmp_path)})
    assert served == ChunkedKVConfig(**settings)
    with pytest.raises(ValueError):
        ppl.mode_settings("bogus", tmp_path)


def test_by_position_buckets_every_token_once(ppl):
    logprobs = [[-1.0] * 300, [-2.0] * 100 + [-3.0] * 500]  # query positions 0-299 and 0-599
    buckets = ppl.by_position(logprobs, edges=(0, 100, 512))
    assert list(buckets) == ["0-100", "100-512", "512-"]
    assert buckets["0-100"] == pytest.approx(math.exp(1.5))
    assert buckets["100-512"] == pytest.approx(math.exp((200 * 1.0 + 412 * 3.0) / 612))
    assert buckets["512-"] == pytest.approx(math.exp(3.0))
    assert list(ppl.by_position([[-1.0] * 50], edges=(0, 100, 512))) == ["0-100"]


def test_repeat_kind_splits_by_where_the_ngram_was_last_seen(ppl):
    phrase = [7, 8, 9, 10, 11]
    doc = phrase + list(range(100, 140)) + phrase + list(range(200, 202)) + phrase  # copies 45 and 7 after
    kinds = ppl.repeat_kind(doc, window=20, n=4)
    assert len(kinds) == len(doc) - 1
    # scored token doc[t + 1]; the n-gram 7,8,9,10 ends at doc[t + 1] = 10, i.e. t = 2 in each copy
    first, second, third = 0, 45, 52
    assert kinds[first + 2] == kinds[first + 3] == "new"
    assert kinds[second + 2] == kinds[second + 3] == "far"  # last seen 45 back, beyond the window of 20
    assert kinds[third + 2] == kinds[third + 3] == "near"  # last seen 7 back
    assert kinds.count("far") == 2 and kinds.count("near") == 2
    logprobs = [[-1.0 if k == "new" else -0.1 for k in kinds]]
    split = ppl.by_repeat([doc], logprobs, window=20)
    assert sum(v["tokens"] for v in split.values()) == len(kinds)
    assert split["far"]["ppl"] == pytest.approx(math.exp(0.1)) and split["new"]["ppl"] == pytest.approx(math.e)
