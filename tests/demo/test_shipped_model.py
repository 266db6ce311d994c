"""The shipped demo model (`vllm_chunked_kv/demo/model/`), in transformers, offline.

- the directory holds config, fp32/bf16 safetensors, tokenizer files and
  TRAINING.md, at most 10 MB, and its config is the demo architecture;
- with full attention it answers at least 95% of 40 held-out prompts at the
  demo context length;
- the needle-phase sweep shows what the demo exists for: with full attention
  the best - worst phase gap's 95% interval includes zero, under the
  compression the model was fine-tuned with (mean pooling, chunk 4) the gap's
  95% interval lies above zero;
- the gated variant (`demo/model_gated/`) ships `chunked_kv_gains.json`,
  whose gains make a valid `pooling="gated"` config, and answers held-out
  prompts like the main model with full attention;
- the staggered variant (`demo/model_stagger/`) ships `chunked_kv_serve.json`,
  a chunked_kv config with staggered grids over the fine-tune compression,
  and answers held-out prompts like the main model with full attention.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_chunked_kv.demo.architecture import demo_config
from vllm_chunked_kv.demo.evaluate import DEFAULT_MODEL_DIR, accuracy, load_model, needle_sweep
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config
from vllm_chunked_kv.demo.train import FINETUNE_COMPRESSION, GAINS_FILE, gated_config

GATED_DIR = DEFAULT_MODEL_DIR.parent / "model_gated"
STAGGER_DIR = DEFAULT_MODEL_DIR.parent / "model_stagger"

REQUIRED = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "generation_config.json", "TRAINING.md"]


@pytest.fixture(scope="module")
def model():
    torch.set_num_threads(1)
    return load_model()


def test_directory_layout_and_size():
    names = {p.name for p in DEFAULT_MODEL_DIR.iterdir()}
    assert set(REQUIRED) <= names
    assert sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir()) <= 10 * 2**20
    tokenizer_config = json.loads((DEFAULT_MODEL_DIR / "tokenizer_config.json").read_text())
    assert tokenizer_config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_config_is_the_demo_architecture(model):
    expected = demo_config()
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "tie_word_embeddings"):
        assert getattr(model.config, field) == getattr(expected, field), field


def test_full_attention_answers_held_out_prompts(model):
    correct, total = accuracy(model, 40, seed=12345)
    assert correct >= 0.95 * total


def test_phase_gap_appears_only_under_compression(model):
    full = needle_sweep(model, None, per_phase=64, seed=777)
    chunked = needle_sweep(model, FINETUNE_COMPRESSION, per_phase=64, seed=777)
    assert full.gap.ci_low <= 0  # no phase effect beyond noise
    assert chunked.gap.ci_low > 0


def test_gated_variant_ships_its_gains():
    meta = json.loads((GATED_DIR / GAINS_FILE).read_text())
    cfg = gated_config(meta["slot_gains"])
    assert cfg.pooling == "gated" and len(cfg.slot_gains) == cfg.chunk_size
    assert sum(p.stat().st_size for p in GATED_DIR.iterdir()) <= 10 * 2**20
    torch.set_num_threads(1)
    correct, total = accuracy(load_model(GATED_DIR), 40, seed=12345)
    assert correct >= 0.95 * total


def test_stagger_variant_ships_its_serving_config():
    names = {p.name for p in STAGGER_DIR.iterdir()}
    assert set(REQUIRED) | {SERVE_FILE} <= names
    assert sum(p.stat().st_size for p in STAGGER_DIR.iterdir()) <= 10 * 2**20
    cfg = read_serve_config(STAGGER_DIR)
    assert any(cfg.origins(layer, 2) != [0, 0] for layer in range(2))
    for field in ("chunk_size", "hop", "window", "sink_tokens", "pooling"):
        assert getattr(cfg, field) == getattr(FINETUNE_COMPRESSION, field), field
    torch.set_num_threads(1)
    correct, total = accuracy(load_model(STAGGER_DIR), 40, seed=12345)
    assert correct >= 0.95 * total
