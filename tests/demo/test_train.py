"""Contract of the demo training script (`demo.train`), on a shortened run.

- The same seed gives bit-identical weights (data, initialisation, early
  stops and every phase follow from the seed); another seed gives others.
- Training learns: the copy phase's loss starts near uniform guessing over
  the vocabulary and falls within the shortened budget.
- `--steps-scale` scales every phase's budget, never below one step.
- The gated variant (learned slot gains) is deterministic too, and learns
  gains of its own (normalised, moved away from mean pooling).
- The command writes loadable model directories with tokenizer and
  TRAINING.md, and the gated one its gains as a valid `pooling="gated"` config.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from vllm_chunked_kv.demo import train as train_mod
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB

pytestmark = pytest.mark.slow

SCALE = 0.01


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    logs: list[list[str]] = [[], [], []]
    first = train_mod.train(3, SCALE, log=logs[0].append, gated=True)
    second = train_mod.train(3, SCALE, log=logs[1].append, gated=True)
    other = train_mod.train(4, 0.002, log=logs[2].append)
    return first, second, other, logs


def test_same_seed_same_weights(runs):
    first, second, other, _ = runs
    a, b, c = _state(first.model), _state(second.model), _state(other.model)
    assert [r[:2] for r in first.record] == [r[:2] for r in second.record]
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(not torch.equal(a[name], c[name]) for name in a)
    gated_a, gated_b = _state(first.gated_model), _state(second.gated_model)
    assert all(torch.equal(gated_a[name], gated_b[name]) for name in gated_a)
    assert first.gains == second.gains


def test_gated_variant_learns_its_own_gains(runs):
    first = runs[0]
    assert len(first.gains) == train_mod.FINETUNE_COMPRESSION.chunk_size
    assert abs(sum(first.gains) - 1) < 1e-4
    assert first.gains != [0.25] * 4  # moved away from mean pooling
    a, g = _state(first.model), _state(first.gated_model)
    assert any(not torch.equal(a[name], g[name]) for name in a)


def test_copy_loss_falls(runs):
    logs = runs[3][0]
    losses = [float(m.group(1)) for line in logs if line.startswith("copy") for m in [re.search(r"loss (\S+)", line)] if m]
    assert losses[0] > 0.9 * math.log(256)  # starts near uniform guessing
    assert losses[-1] < losses[0] - 0.03  # the shortened run is still in the warm-up


def test_steps_scale():
    for phase in train_mod.CURRICULUM:
        assert train_mod.scaled(phase, 0.5).max_steps == round(phase.max_steps * 0.5)
        assert train_mod.scaled(phase, 1e-9).max_steps == 1


def test_command_writes_model_dirs(tmp_path):
    import json

    from transformers import AutoTokenizer, LlamaForCausalLM

    out, gated = tmp_path / "model", tmp_path / "gated"
    argv = ["--out", str(out), "--gated-out", str(gated), "--seed", "1", "--steps-scale", "0.002", "--eval-prompts", "4"]
    assert train_mod.main(argv) == 0
    for directory in (out, gated):
        assert (directory / "model.safetensors").exists() and (directory / "TRAINING.md").exists()
        LlamaForCausalLM.from_pretrained(directory)
    assert not (out / train_mod.GAINS_FILE).exists()
    meta = json.loads((gated / train_mod.GAINS_FILE).read_text())
    train_mod.gated_config(meta["slot_gains"])  # a valid gated config
    assert AutoTokenizer.from_pretrained(out)("k1")["input_ids"] == [VOCAB.index("<bos>"), VOCAB.index("k1")]
