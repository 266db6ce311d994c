"""`--kv-cache-dtype fp8` with CHUNKED_KV, end to end in vLLM (tiny Llama, CPU).

- The pages are FP8: at the same KV memory vLLM reports at least 1.9x the
  tokens it reports for bf16 pages with the same settings (the bytes halve;
  theory is 2x), and the kernels that run are ones that read FP8 pages (the
  startup log names them, and says why the others were passed over).
- Greedy tokens from vLLM on FP8 pages (boundary retention, sinks, chunked
  prefill, prefix caching; both formats) equal those of the same model in
  transformers with the reference chunked attention reading every row
  through the same pages (`hf.attention`'s cache_dtype), and differ from
  the reference on unquantised rows: the pages' rounding is what runs.
  (vLLM's default CPU backend rounds toward zero when it stores FP8; these
  pages round to nearest even, as vLLM's CUDA kernels do, so the two are not
  compared token for token.)
- Chunk 4 on FP8 pages, both formats, with a prefix-cache hit and chunked
  prefill: every request finishes its tokens, and a second run of the same
  requests in other step splits (a smaller token budget) gives the same tokens
  (pooled rows are quantised once, from the stored rows, whichever step sealed
  them).
- On FP8 pages, with boundary retention and sinks, a KV budget that forces
  preemption (vLLM counted one) gives the greedy tokens of a budget that
  does not, which itself serves round 2 from prefix-cache hits (counted), over
  256 decodes.
"""

from __future__ import annotations

import re

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.runner.engine import generate

from .test_attention_reference import MAX_TOKENS, WINDOW, prompts, reference_greedy

pytestmark = [pytest.mark.slow, pytest.mark.engine]

CAPACITY = re.compile(r"KV cache size: ([\d,]+) tokens")
ENGINE = dict(max_model_len=2048, block_size=32, kv_cache_memory_bytes=16 << 20, enable_prefix_caching=True)
CHUNK4 = {"chunk_size": 4, "window": 8, "sink_tokens": 2}


def _rounds() -> list[list[list[int]]]:
    first = prompts(seed=2, count=3)
    return [first, [first[0] + first[1][1:12]]]  # the second round extends a prompt: a prefix-cache hit


def _capacity(log: str) -> int:
    return int(CAPACITY.findall(log)[-1].replace(",", ""))


def _chunked(settings: dict, **engine) -> dict:
    return {**ENGINE, "attention_backend": "chunked_kv", "additional_config": {"chunked_kv": settings}, **engine}


def test_fp8_pages_hold_twice_the_tokens_and_an_fp8_reader_runs(tiny_llama):
    bf16 = generate(tiny_llama, _chunked(CHUNK4, dtype="bfloat16"), rounds=[])
    fp8 = generate(tiny_llama, _chunked(CHUNK4, dtype="bfloat16", kv_cache_dtype="fp8"), _rounds(), max_tokens=6)
    assert _capacity(fp8["log"]) >= 1.9 * _capacity(bf16["log"]), (_capacity(fp8["log"]), _capacity(bf16["log"]))
    chosen = re.findall(r"chunked KV kernels on cpu: (\S+)", fp8["log"])
    assert chosen and all(impl in dispatch.FP8_READERS for impl in chosen), chosen
    if "cpp" not in dispatch.FP8_READERS:
        assert "the cpp kernels do not read FP8 pages" in fp8["log"]
    assert [len(tokens) for batch in fp8["outputs"] for tokens in batch] == [6, 6, 6, 6]


@pytest.mark.parametrize("cache_dtype", ["fp8", "fp8_e5m2"])
def test_vllm_on_fp8_pages_equals_the_reference_on_fp8_pages(tiny_llama, cache_dtype):
    settings = {"window": WINDOW, "mitigation": "boundary", "sink_tokens": 2}
    cfg = ChunkedKVConfig.from_additional_config({"chunked_kv": settings})
    batch = prompts(seed=5, count=8)
    expected = reference_greedy(tiny_llama, cfg, batch, cache_dtype=cache_dtype)
    result = generate(tiny_llama, dict(attention_backend="chunked_kv", additional_config={"chunked_kv": settings},
                                       kv_cache_dtype=cache_dtype, max_num_batched_tokens=32,
                                       enable_prefix_caching=True), [batch], max_tokens=MAX_TOKENS)
    assert result["outputs"][0] == expected
    assert reference_greedy(tiny_llama, cfg, batch) != expected  # the pages' rounding shows in the tokens


@pytest.mark.parametrize("cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_pooled_fp8_rows_do_not_depend_on_the_step_split(tiny_llama, cache_dtype):
    engine = dict(dtype="float32", kv_cache_dtype=cache_dtype, enable_chunked_prefill=True)
    whole = generate(tiny_llama, _chunked(CHUNK4, **engine, max_num_batched_tokens=256), _rounds(), max_tokens=8)
    pieces = generate(tiny_llama, _chunked(CHUNK4, **engine, max_num_batched_tokens=16, max_num_seqs=2),
                      _rounds(), max_tokens=8)
    assert [len(tokens) for batch in whole["outputs"] for tokens in batch] == [8, 8, 8, 8]
    assert pieces["outputs"] == whole["outputs"]


def test_fp8_pages_under_preemption_and_prefix_hits(tiny_llama):
    from .test_scheduling_invariance import LONG_TOKENS, PREEMPTING_KV, make_rounds

    settings = {"mitigation": "boundary", "window": 16, "sink_tokens": 5}
    engine = _chunked(settings, block_size=32, enable_prefix_caching=True, kv_cache_dtype="fp8",
                      max_num_batched_tokens=32)
    rounds = make_rounds(seed=3)  # round 2 extends or repeats round 1's prompts
    roomy = generate(tiny_llama, engine, rounds, max_tokens=LONG_TOKENS)
    budget = int(PREEMPTING_KV * 4 / ChunkedKVConfig(**settings).tokens_per_state / 2)  # FP8: half the bytes
    tight = generate(tiny_llama, {**engine, "max_num_batched_tokens": 64, "max_model_len": 768,
                                  "kv_cache_memory_bytes": budget}, rounds, max_tokens=LONG_TOKENS)
    assert tight["preemptions"] > 0 and roomy["preemptions"] == 0
    assert roomy["cached_tokens"][1] > 0  # the tight budget has evicted round 1's pages by round 2
    assert [len(tokens) for batch in roomy["outputs"] for tokens in batch] == [LONG_TOKENS] * 16
    assert tight["outputs"] == roomy["outputs"]
