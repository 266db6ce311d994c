"""Contract of the shipped SmolLM2 adapter (`models fetch smollm2-135m --adapted`).

- The command prints the adapted model's directory as its last line of
  standard output; the directory holds `chunked_kv_serve.json` with the
  settings the adapter was trained for (chunk 4, window 128, 4 sinks, grids
  cycled over the layers, pooling "gated" with the slot gains learned with
  the adapter, one set per layer: each unequal and summing to 1), and
  differs from the base model only in the attention projections (the
  merged adapter).
- `--attention-backend chunked_kv` alone serves it with CHUNKED_KV in those
  settings: the startup log names its `chunked_kv_serve.json` and shows the
  backend running with exactly the file's resolved settings.
- Under the chunked attention it was adapted for, it retrieves prose codes
  from before the window that the base model cannot (teacher-forced probe on
  16 held-out needles, `adapt.probe`): the base model gets none, the adapted
  one at least a quarter. The served numbers at 1,024 needles are in
  the adapter's ADAPT.md.
"""

from __future__ import annotations

import json

import pytest

from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config

from .adapted import PROJECTIONS, changed_weights, expected_settings, fetch_adapted, probe_scores, served_settings

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.download, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def adapted_dir(smollm2_dir, models_cache):
    return fetch_adapted("smollm2-135m", models_cache)


def test_adapted_directory(adapted_dir, smollm2_dir):
    cfg = read_serve_config(adapted_dir)
    assert (cfg.chunk_size, cfg.hop, cfg.window, cfg.sink_tokens, cfg.pooling) == (4, 4, 128, 4, "gated")
    layers = json.loads((adapted_dir / "config.json").read_text())["num_hidden_layers"]  # 30 in SmolLM2-135M
    assert cfg.per_layer_gains and len(cfg.slot_gains) == layers
    for layer in range(layers):
        gains = cfg.for_layer(layer).normalised_gains()
        assert sum(gains) == pytest.approx(1.0) and max(gains) - min(gains) > 0.1, (layer, gains)  # learned, not the mean
    cycle = [[0, 2, 0], [1, 3, 1], [2, 0, 2], [3, 1, 3]]  # grids cycled over layers (models/adapters/.../ADAPT.md)
    assert [list(cfg.origins(layer, 3)) for layer in range(layers)] == [cycle[layer % 4] for layer in range(layers)]
    changed = changed_weights(smollm2_dir, adapted_dir)
    assert len(changed) == layers * 4 and all(k.endswith(PROJECTIONS) for k in changed)


def test_vllm_serves_it_as_adapted(adapted_dir):
    served = served_settings(adapted_dir, list(range(1000, 1300)))
    assert served["source"].startswith(f"{adapted_dir / SERVE_FILE} (")
    assert served["settings"] == expected_settings(adapted_dir) and len(served["tokens"]) == 4


def test_adapted_retrieves_what_the_base_cannot(adapted_dir, smollm2_dir):
    from transformers import AutoTokenizer

    from vllm_chunked_kv.adapt import probe

    prompts = probe.needle_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 16)
    scores = probe_scores(smollm2_dir, adapted_dir, prompts)
    assert scores["base"] == 0.0 and scores["adapted"] >= 0.25, scores
