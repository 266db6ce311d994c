"""Contract of `vllm_chunked_kv.serving.kv_footprint`: uncompressed bytes per token
is 2 (K, V) x layers x KV heads x head size x dtype bytes, read from the
model through vLLM's config, counting only the global layers of a hybrid
model (its sliding-window layers hold a fixed number of rows), at the bytes
of the KV pages' dtype (one per element for FP8 pages); compression counts only when CHUNKED_KV is the
selected backend, and then the ratio is docs/design.md §4's: chunk_size tokens
over the rows they are stored in; capacity is vLLM's own figure."""

from __future__ import annotations

import json
from fractions import Fraction
from types import SimpleNamespace

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.serving.kv_footprint import (
    capacity_tokens,
    chunked_backend_active,
    footprint,
    footprint_from_vllm_config,
    global_layers,
    uncompressed_bytes_per_token,
)

# docs/design.md §4: chunk_size C tokens over the rows they are stored in
# (none 1 row, boundary 3, overlap 2; stride2 stores every 2 tokens as 1 row).
EXPECTED_RATIO = {
    "none": lambda c: Fraction(c, 1), "boundary": lambda c: Fraction(c, 3),
    "overlap": lambda c: Fraction(c, 2), "stride2": lambda c: Fraction(2),
}


def _hf_bytes_per_token(model_dir, dtype_bytes: int) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    head_size = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_size * dtype_bytes


def test_default_backend_reports_no_compression(make_vllm_config, tiny_llama):
    vllm_config = make_vllm_config({"chunked_kv": {"chunk_size": 8}})
    assert not chunked_backend_active(vllm_config)
    fp = footprint_from_vllm_config(vllm_config, Fraction(8))
    assert fp.uncompressed_bytes_per_token == _hf_bytes_per_token(tiny_llama, 4)  # float32
    assert fp.bytes_per_token == fp.uncompressed_bytes_per_token
    assert fp.compression_ratio == 1.0


@pytest.mark.parametrize(
    "section",
    [{"chunk_size": 4}, {"chunk_size": 6, "mitigation": "boundary"}, {"chunk_size": 8, "mitigation": "overlap"},
     {"mitigation": "stride2"}],
)
def test_chunked_backend_ratio_follows_the_mitigation_table(make_vllm_config, tiny_llama, section):
    vllm_config = make_vllm_config({"chunked_kv": section}, attention_backend="chunked_kv")
    assert chunked_backend_active(vllm_config)
    cfg = ChunkedKVConfig.from_additional_config(vllm_config.additional_config)
    fp = footprint_from_vllm_config(vllm_config, cfg.tokens_per_state)
    expected_ratio = EXPECTED_RATIO[cfg.mitigation](section.get("chunk_size", 0))
    assert fp.compression_ratio == pytest.approx(float(expected_ratio))
    assert fp.bytes_per_token == pytest.approx(_hf_bytes_per_token(tiny_llama, 4) / expected_ratio)


def test_fp8_pages_count_one_byte_per_element(make_vllm_config, tiny_llama):
    vllm_config = make_vllm_config({"chunked_kv": {"chunk_size": 4}}, attention_backend="chunked_kv",
                                   kv_cache_dtype="fp8")
    fp = footprint_from_vllm_config(vllm_config, Fraction(4))
    assert fp.uncompressed_bytes_per_token == _hf_bytes_per_token(tiny_llama, 1)
    assert fp.bytes_per_token == pytest.approx(_hf_bytes_per_token(tiny_llama, 1) / 4)


def test_hybrid_models_count_their_global_layers_only():
    hybrid = SimpleNamespace(hf_text_config=SimpleNamespace(layer_types=["sliding_attention"] * 5 + ["full_attention"]),
                             get_total_num_hidden_layers=lambda: 6)
    plain = SimpleNamespace(hf_text_config=SimpleNamespace(), get_total_num_hidden_layers=lambda: 6)
    assert (global_layers(hybrid), global_layers(plain)) == (1, 6)


def test_mla_stores_one_latent_row():
    assert uncompressed_bytes_per_token(3, 8, 576, 2, use_mla=True) == 3 * 576 * 2
    assert uncompressed_bytes_per_token(3, 8, 64, 2) == 2 * 3 * 8 * 64 * 2


def test_capacity_prefers_vllms_own_figure():
    assert capacity_tokens(SimpleNamespace(kv_cache_size_tokens=1000, num_gpu_blocks=10, block_size=16)) == 1000
    assert capacity_tokens(SimpleNamespace(kv_cache_size_tokens=None, num_gpu_blocks=10, block_size=16)) == 160
    assert capacity_tokens(SimpleNamespace(num_gpu_blocks=None, block_size=16)) is None
    assert footprint(100, None, None).capacity_tokens is None
