"""Contract of the shipped SmolLM2 adapter (`models fetch smollm2-135m --adapted`).

- The command prints the adapted model's directory as its last line of
  standard output; the directory holds `chunked_kv_serve.json` with the
  settings the adapter was trained for (chunk 4, window 128, 4 sinks, grids
  cycled over the layers, pooling "gated" with the slot gains learned with
  the adapter, one set per layer: each unequal and summing to 1), and
  differs from the base model only in the attention projections (the
  merged adapter).
- `--attention-backend chunked_kv` alone serves it with CHUNKED_KV in those
  settings: the startup log names its `chunked_kv_serve.json`, and the
  greedy answer equals the explicit `--additional-config` form's.
- Under the chunked attention it was adapted for, it retrieves prose codes
  from before the window that the base model cannot (teacher-forced probe on
  16 held-out needles, `adapt.probe`): the base model gets none, the adapted
  one at least a quarter. The served numbers at 1,024 needles are in
  the adapter's ADAPT.md.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from vllm_chunked_kv.commands.main import main
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config
from vllm_chunked_kv.runner.engine import generate

from .engine import SERVE_DTYPE

pytestmark = [pytest.mark.slow, pytest.mark.engine, pytest.mark.download, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def adapted_dir(smollm2_dir, models_cache):
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["models", "fetch", "smollm2-135m", "--adapted", "--cache-dir", str(models_cache)]) == 0
    from pathlib import Path

    return Path(out.getvalue().strip().splitlines()[-1])


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
    base, merged = load_file(str(smollm2_dir / "model.safetensors")), load_file(str(adapted_dir / "model.safetensors"))
    changed = {k for k in base if not torch.equal(base[k], merged[k])}
    assert len(changed) == layers * 4
    assert all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")) for k in changed)


def test_vllm_serves_it_as_adapted(adapted_dir):
    serve = json.loads((adapted_dir / SERVE_FILE).read_text())
    engine = {"attention_backend": serve["attention_backend"], "dtype": SERVE_DTYPE, "kv_cache_memory_bytes": 256 << 20}
    prompt = [[list(range(1000, 1300))]]
    alone = generate(str(adapted_dir), engine, prompt, max_tokens=4)
    explicit = generate(str(adapted_dir), {**engine, "additional_config": serve["additional_config"]}, prompt,
                        max_tokens=4)
    assert "Using CHUNKED_KV attention backend" in alone["log"]
    assert f"chunked_kv: settings from {adapted_dir / SERVE_FILE} (" in alone["log"]
    assert len(alone["outputs"][0][0]) == 4 and alone["outputs"] == explicit["outputs"]


def test_adapted_retrieves_what_the_base_cannot(adapted_dir, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vllm_chunked_kv.adapt import probe, train
    from vllm_chunked_kv.hf.attention import chunked_attention

    cfg = read_serve_config(adapted_dir)
    prompts = probe.needle_prompts(AutoTokenizer.from_pretrained(smollm2_dir), 16)
    scores = {}
    for name, path in (("base", smollm2_dir), ("adapted", adapted_dir)):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        # adapt's own precision: bf16 where the CPU has it natively, fp32 where bf16 would be emulated
        with torch.no_grad(), train.autocast(train.AdaptOptions()), chunked_attention(model, cfg):
            scores[name] = probe.accuracy(model, prompts)
    assert scores["base"] == 0.0 and scores["adapted"] >= 0.25, scores
