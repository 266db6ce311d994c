"""Contract of the demo training script (`demo.train`), on a shortened run.

- The same seed gives bit-identical weights (data, initialisation, early
  stops and every phase follow from the seed); another seed gives others.
- Training learns: the copy phase's loss starts near uniform guessing over
  the vocabulary and falls within the shortened budget.
- `--steps-scale` scales every phase's budget, never below one step.
- The command writes a loadable model directory with tokenizer and TRAINING.md.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from vllm_chunked_kv.demo import train as train_mod
from vllm_chunked_kv.tasks.kv_retrieval import VOCAB

SCALE = 0.02


def _state(model):
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs():
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    logs: list[list[str]] = [[], [], []]
    first = train_mod.train(3, SCALE, log=logs[0].append)
    second = train_mod.train(3, SCALE, log=logs[1].append)
    other = train_mod.train(4, 0.002, log=logs[2].append)
    return first, second, other, logs


def test_same_seed_same_weights(runs):
    (model_a, record_a), (model_b, record_b), (model_c, _), _ = runs
    a, b, c = _state(model_a), _state(model_b), _state(model_c)
    assert [r[:2] for r in record_a] == [r[:2] for r in record_b]
    assert all(torch.equal(a[name], b[name]) for name in a)
    assert any(not torch.equal(a[name], c[name]) for name in a)


def test_copy_loss_falls(runs):
    logs = runs[3][0]
    losses = [float(m.group(1)) for line in logs if line.startswith("copy") for m in [re.search(r"loss (\S+)", line)] if m]
    assert losses[0] > 0.9 * math.log(256)  # starts near uniform guessing
    assert losses[-1] < losses[0] - 0.1  # the shortened run is still in the warm-up


def test_steps_scale():
    for phase in train_mod.CURRICULUM:
        assert train_mod.scaled(phase, 0.5).max_steps == round(phase.max_steps * 0.5)
        assert train_mod.scaled(phase, 1e-9).max_steps == 1


def test_command_writes_model_dir(tmp_path):
    from transformers import AutoTokenizer, LlamaForCausalLM

    out = tmp_path / "model"
    assert train_mod.main(["--out", str(out), "--seed", "1", "--steps-scale", "0.002", "--eval-prompts", "4"]) == 0
    assert (out / "model.safetensors").exists() and (out / "TRAINING.md").exists()
    LlamaForCausalLM.from_pretrained(out)
    assert AutoTokenizer.from_pretrained(out)("k1")["input_ids"] == [VOCAB.index("<bos>"), VOCAB.index("k1")]
