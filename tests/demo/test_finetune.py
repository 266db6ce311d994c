"""Contract of the staggered fine-tune (`demo.finetune`), on runs of a few steps.

- The compression keeps the fine-tune compression of `demo.train` (mean
  pooling, chunk 4, window 32, 4 sinks) and adds the requested stagger
  ('heads' or explicit origins); `serve_settings` reproduce it exactly when
  handed to vLLM's additional_config.
- Fine-tuning changes the weights and is deterministic: the same seed from
  the same start gives bit-identical weights.
- The command writes a model directory that transformers loads, with the
  tokenizer, a TRAINING.md that names the staggered and aligned sweeps of
  the fine-tuned and the starting model, and `chunked_kv_serve.json` whose
  config staggers the KV heads as the fine-tune did.
- Origins that do not fit the model are refused before training.
"""

from __future__ import annotations

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.demo import finetune
from vllm_chunked_kv.core.serve_file import SERVE_FILE, read_serve_config, serve_settings
from vllm_chunked_kv.demo.evaluate import DEFAULT_MODEL_DIR
from vllm_chunked_kv.demo.train import FINETUNE_COMPRESSION

SCALE = 0.004  # 5 of the phase's 1,200 steps


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.mark.parametrize("stagger", ["heads", [[0, 2], [1, 3]]])
def test_compression_adds_stagger_and_round_trips(stagger):
    cfg = finetune.staggered_compression(stagger)
    for field in ("chunk_size", "hop", "window", "sink_tokens", "pooling", "keep_boundary"):
        assert getattr(cfg, field) == getattr(FINETUNE_COMPRESSION, field), field
    assert cfg.stagger == stagger
    assert ChunkedKVConfig.from_additional_config({"chunked_kv": serve_settings(cfg)}) == cfg


def test_heads_stagger_offsets_the_two_kv_heads():
    cfg = finetune.staggered_compression("heads")
    hop = cfg.hop
    assert [cfg.origins(layer, 2) for layer in range(2)] == [[0, hop // 2], [0, hop // 2]]


def test_finetune_is_deterministic_and_changes_weights():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = finetune.staggered_compression("heads")
    start = _state(finetune.load_for_training(DEFAULT_MODEL_DIR))
    runs = []
    for _ in range(2):
        model = finetune.load_for_training(DEFAULT_MODEL_DIR)
        record = finetune.finetune(model, cfg, seed=5, steps_scale=SCALE, log=lambda msg: None)
        assert [r[:2] for r in record] == [("finetune-stagger", 5)]
        runs.append(_state(model))
    assert all(torch.equal(runs[0][name], runs[1][name]) for name in start)
    assert any(not torch.equal(runs[0][name], start[name]) for name in start)


def test_command_writes_a_servable_staggered_model(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(1)
    out = tmp_path / "model_stagger"
    argv = ["--from", str(DEFAULT_MODEL_DIR), "--stagger", "heads", "--out", str(out), "--seed", "1",
            "--steps-scale", str(SCALE), "--eval-prompts", "4"]
    assert finetune.main(argv) == 0
    LlamaForCausalLM.from_pretrained(out)
    AutoTokenizer.from_pretrained(out)
    served = read_serve_config(out)
    assert served == finetune.staggered_compression("heads")
    assert served.origins(0, 2) != [0, 0]
    report = (out / "TRAINING.md").read_text()
    for row in ("| chunked mean-4, staggered |", "| chunked mean-4, aligned |", "| start: chunked mean-4, staggered |"):
        assert row in report
    assert SERVE_FILE in report and "finetune-stagger" in report


def test_origins_that_do_not_fit_the_model_are_refused(tmp_path):
    argv = ["--from", str(DEFAULT_MODEL_DIR), "--stagger", "[[0, 2, 1], [0, 2, 1]]", "--out", str(tmp_path / "x")]
    with pytest.raises(ChunkedKVConfigError, match="stagger"):
        finetune.main(argv)
    assert not (tmp_path / "x").exists()
