"""Contract of adapt's loss (`adapt.loss`).

- `positions`: with a count, that many distinct positions drawn from the row
  plus every answer position, sorted, a function of the seed; None (every
  position) at 0 or at a count that covers the row.
- `top_k_kl`: the KL over the teacher's top k and one outcome for the rest;
  zero when student and teacher agree, never above the full KL (lumping
  outcomes loses information), equal to it when k is the whole vocabulary.
- `loss_terms` with `kl_positions`: the output layer runs only at the scored
  positions (seen at the output layer's input), and the answers' cross-entropy
  is still counted; with `kl_top_k` the KL is the top-k one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_chunked_kv.adapt import data, loss, lora, train
from vllm_chunked_kv.core.config import ChunkedKVConfig
from tests.adapt.conftest import tiny_byte_llama

CFG = ChunkedKVConfig(chunk_size=4, window=64, sink_tokens=4)


def test_positions_are_a_draw_plus_the_answers():
    labels = torch.full((2, 300), data.IGNORE)
    labels[0, 290:294] = 7
    labels[1, 250] = 3
    keep = loss.positions(labels, 32, "0:5")
    assert keep.tolist() == sorted(set(keep.tolist()))
    assert {250, 290, 291, 292, 293} <= set(keep.tolist())
    assert 32 <= len(keep) <= 37
    assert torch.equal(keep, loss.positions(labels, 32, "0:5"))
    assert not torch.equal(keep, loss.positions(labels, 32, "0:6"))
    assert loss.positions(labels, 0, "0:5") is None and loss.positions(labels, 300, "0:5") is None


def test_top_k_kl_is_the_lumped_kl():
    gen = torch.Generator().manual_seed(0)
    teacher = torch.randn(5, 50, generator=gen).log_softmax(-1)
    student = torch.randn(5, 50, generator=gen).log_softmax(-1)
    full = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
    assert float(loss.top_k_kl(teacher, teacher, 8)) == pytest.approx(0.0, abs=1e-6)
    assert 0 < float(loss.top_k_kl(student, teacher, 8)) < float(full)
    assert float(loss.top_k_kl(student, teacher, 49)) == pytest.approx(float(full), rel=1e-3)


@pytest.mark.parametrize("top_k", [0, 16])
def test_scored_positions_reach_the_output_layer_only(byte_tokenizer, top_k):
    model = tiny_byte_llama()
    adapters = lora.add_lora(model, 4, 8, 0)
    opts = train.AdaptOptions(rows=2, full_rows=1, text_rows=0, length=800, kl_positions=24, kl_top_k=top_k)
    ids, labels = data.batch(train.step_rows(byte_tokenizer, 0, opts))
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(args[0].shape[1]))
    total, kl, ce = loss.loss_terms(model, adapters, ids, labels, CFG, opts, seed="0:0")
    keep = loss.positions(labels, 24, "0:0")
    assert seen and set(seen) == {len(keep)} and len(keep) < 800  # teacher, chunked and full rows alike
    assert ce > 0 and total.requires_grad
    assert kl > 0  # the chunked row differs from its full-attention teacher
