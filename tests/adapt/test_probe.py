"""Contract of `adapt.probe`: needle prompts with each record where the span
puts it (positions drawn by the seed), and an accuracy that counts a prompt only when every
answer token is the argmax, computed from the answer positions' logits alone
(the same verdicts as the full logits give)."""

from __future__ import annotations

import pytest
import torch

from vllm_chunked_kv.adapt import probe

from .conftest import tiny_byte_llama


def test_each_record_starts_inside_the_span(byte_tokenizer):
    span = probe.span(640)
    assert span == (40, 1400) and probe.span(100) == (40, 400)
    prompts = probe.needle_prompts(byte_tokenizer, 9, span=span)
    assert len(prompts) == 9
    starts = []
    for prompt, answer in prompts:
        code = answer[1:]  # " 8962" -> the digits, which sit inside the record
        at = next(i for i in range(len(prompt)) if prompt[i : i + len(code)] == code)
        assert span[0] <= at <= span[1] + 300, at  # record start in the span, the code within its record
        starts.append(at)
    assert len(set(starts)) == 9  # drawn positions, not one place
    assert prompts != probe.needle_prompts(byte_tokenizer, 9, span=span, seed=1)  # the seed moves the needles


class Oracle(torch.nn.Module):
    """Logits whose argmax at position t is token t+1 of the given sequence, except
    at position `wrong` (counted from the end), where it is another token."""

    def __init__(self, wrong: int | None = None):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.wrong, self.kept = wrong, []

    def forward(self, input_ids, logits_to_keep=0):
        ids = input_ids[0]
        logits = torch.zeros(len(ids), 256)
        logits[torch.arange(len(ids) - 1), ids[1:]] = 1.0
        if self.wrong is not None:
            t = len(ids) - 1 - self.wrong
            logits[t] = 0.0
            logits[t, (int(ids[t + 1]) + 1) % 256] = 1.0
        self.kept.append(logits_to_keep)
        return type("Out", (), {"logits": logits[-logits_to_keep:][None] if logits_to_keep else logits[None]})


@pytest.mark.parametrize("wrong, expected", [(None, 1.0), (1, 0.0), (2, 0.0)])
def test_accuracy_needs_every_answer_token(byte_tokenizer, wrong, expected):
    prompts = probe.needle_prompts(byte_tokenizer, 3)
    model = Oracle(wrong)
    assert probe.accuracy(model, prompts) == expected
    assert model.kept == [len(answer) + 1 for _, answer in prompts]  # only the answer's positions


def test_kept_logits_give_the_full_logits_verdicts(byte_tokenizer):
    model = tiny_byte_llama().eval()
    prompts = probe.needle_prompts(byte_tokenizer, 12, span=(40, 120))
    # answers the random model does predict, so both verdicts occur
    with torch.no_grad():
        greedy = [(p, model(input_ids=torch.tensor([p])).logits[0, -1].argmax().view(1).tolist()) for p, _ in prompts]
    mixed = greedy[:6] + prompts[6:]
    full = []
    with torch.no_grad():
        for prompt, answer in mixed:
            logits = model(input_ids=torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
            full.append(logits.argmax(-1).tolist() == answer)
    assert probe.accuracy(model, mixed) == sum(full) / len(full) == 0.5
