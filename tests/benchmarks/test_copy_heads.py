"""Contract of benchmarks/copy_heads.py, on a tiny random byte-level Llama.

- The observer hook of `hf.attention.chunked_attention` runs in every
  layer, and `span_mass` fills every (layer, KV head) cell: a span of every
  position gets mass 1 (all attention lands on rows made of span tokens,
  pooled or raw), an empty span 0, a span in between a value strictly
  between, and the logits are the chunked forward's.
- A span far behind the raw window is read through pooled rows only, and
  each row counts with its share of span tokens: two disjoint spans' masses
  add up to their union's, and one token of a row gets part of it.
- `code_rows` gives rows whose asked code sits once, at least
  `min_distance` tokens before its answer digits; `measure` reports one
  mass per layer and KV head with that head's origin, and the top heads in
  decreasing order.
- `mass_by_origin` adds each head's mass to its origin's sum over the chosen
  layers only; `--from-json` recomputes it from a result file's own mass and
  origins.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.adapt.conftest import ByteTokenizer, tiny_byte_llama
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.hf.attention import chunked_attention

pytestmark = pytest.mark.slow

CFG = ChunkedKVConfig(chunk_size=4, window=16, sink_tokens=4, stagger="layers")


@pytest.fixture(scope="module")
def bench(load_benchmark):
    return load_benchmark("copy_heads")


@pytest.fixture(scope="module")
def model():
    return tiny_byte_llama().eval()


def test_span_mass_bounds_and_logits(bench, model):
    ids = list(range(40, 140))
    queries = [90, 95, 99]
    every, logits = bench.span_mass(model, CFG, ids, list(range(100)), queries)
    none, _ = bench.span_mass(model, CFG, ids, [], queries)
    part, _ = bench.span_mass(model, CFG, ids, list(range(20, 40)), queries)
    assert every.shape == (2, 2) and not every.isnan().any()
    torch.testing.assert_close(every, torch.ones(2, 2), atol=1e-5, rtol=0)
    assert (none == 0).all()
    assert ((part > 0) & (part < 1)).all()
    with torch.no_grad(), chunked_attention(model, CFG):
        torch.testing.assert_close(logits, model(torch.tensor([ids])).logits[0])


def test_far_back_span_is_read_through_pooled_rows_by_share(bench, model):
    ids = list(range(40, 140))
    queries = [99]  # its raw window is 83..99 (plus the sinks 0..3); 20..39 only pooled
    a, _ = bench.span_mass(model, CFG, ids, list(range(20, 30)), queries)
    b, _ = bench.span_mass(model, CFG, ids, list(range(30, 40)), queries)
    both, _ = bench.span_mass(model, CFG, ids, list(range(20, 40)), queries)
    assert (a > 0).all() and (b > 0).all()  # only pooled rows hold these tokens
    torch.testing.assert_close(a + b, both)  # a row counts with its share of span tokens: additive
    one, _ = bench.span_mass(model, CFG, ids, [25], queries)
    assert ((one > 0) & (one < both)).all()  # a single token of a pooled row: a part of that row


def test_measure_on_retrieval_rows(bench, model):
    tokenizer = ByteTokenizer()
    rows = list(bench.code_rows(tokenizer, 3, 768, 300, seed=1))
    assert len(rows) == 3
    for ids, span, answer, labels in rows:
        assert answer[0] - span[-1] > 300 - len(span)
        assert [ids[p] for p in span] == [labels[p] for p in answer]
    result = bench.measure(model, tokenizer, CFG, rows=2, length=768, min_distance=300, seed=1)
    assert len(result["mass"]) == 2 and all(len(layer) == 2 for layer in result["mass"])
    assert result["origins"] == [CFG.origins(layer, 2) for layer in range(2)]
    masses = [t["mass"] for t in result["top"]]
    assert masses == sorted(masses, reverse=True) and len(masses) == 4
    assert 0 <= result["teacher_forced_correct"] <= 2


def test_mass_by_origin_sums_chosen_layers_by_origin(bench, tmp_path):
    mass = [[0.1, 0.2, 0.3], [0.4, 0.5, 0.6], [1.0, 2.0, 3.0]]
    origins = [[0, 2, 0], [1, 3, 1], [2, 0, 2]]
    assert bench.mass_by_origin(mass, origins) == {"layers": [0, 2], "mass": [2.4, 1.0, 4.2, 0.5]}
    assert bench.mass_by_origin(mass, origins, bench.parse_layers("0-1")) == {"layers": [0, 1], "mass": [0.4, 1.0, 0.2, 0.5]}
    assert bench.parse_layers("all") is None and bench.parse_layers("5") == range(5, 6)
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"mass": mass, "origins": origins}))
    bench.main(["--from-json", str(path), "--origin-layers", "1-2"])
    assert json.loads(path.read_text())["mass_by_origin"] == {"layers": [1, 2], "mass": [2.0, 1.0, 4.0, 0.5]}
