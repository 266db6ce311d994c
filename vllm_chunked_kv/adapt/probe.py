"""A quick in-process retrieval probe for `adapt`: the shipped prose-codes task in transformers.

Builds needle prompts from the evaluation task lines the way the scanner's
needle probe does (filler before and after the record, a fixed prompt length,
the record at a chosen token position) and scores them teacher-forced: a
prompt counts as correct when the argmax at every answer token is that token
(the same tokens greedy decoding would produce). One forward per prompt, so
it can run between training steps; the served numbers come from the scanner.
"""

from __future__ import annotations

import itertools
import random

import torch

from vllm_chunked_kv.adapt.data import bos_id, encode
from vllm_chunked_kv.tasks import prose_codes


def _cycled(ids: list[int], count: int) -> list[int]:
    return list(itertools.islice(itertools.cycle(ids), count))


def span(min_distance: int) -> tuple[int, int]:
    """The needle positions of the probe for rows whose facts sit `min_distance` or more
    back: (40, 400) for the default 160, longer prompts for farther facts."""
    return 40, max(400, 2 * min_distance + 120)


def needle_prompts(tokenizer, count: int, span: tuple[int, int] = (40, 400), seed: int = 0):
    """[(prompt ids, answer ids)]: each record starts at a token position drawn from
    `span`, and filler brings every prompt to `span[1]` tokens plus its record and the
    template's closing text and question (so the record sits at least those from the end)."""
    rng = random.Random(f"adapt-probe:{seed}")
    lines = prose_codes.task_lines(max(count, 1), seed=1)  # not the shipped file's seed
    out, bos = [], bos_id(tokenizer)
    for line in lines[:count]:
        head, tail = line["template"].split("{record}")
        head_ids, tail_ids = encode(tokenizer, head), encode(tokenizer, tail)
        record_ids, filler_ids = encode(tokenizer, line["record"]), encode(tokenizer, line["filler"])
        position = rng.randint(*span)
        before = max(position - len(head_ids), 0)
        after = span[1] - len(head_ids) - before
        prompt = head_ids + _cycled(filler_ids, before) + record_ids + _cycled(filler_ids, after) + tail_ids
        out.append(([bos] * (bos is not None) + prompt, encode(tokenizer, " " + line["answer"])))
    return out


@torch.no_grad()
def accuracy(model, prompts) -> float:
    """Fraction of prompts whose answer tokens are all the argmax, teacher-forced.

    Only the positions that predict the answer go through the output layer
    (`logits_to_keep`): Gemma 3's has 262,144 rows, and a 1,400-token prompt's
    full logits would be 1.5 GB of fp32 and most of the forward's work."""
    correct, dev = 0, next(model.parameters()).device
    for prompt, answer in prompts:
        ids = torch.tensor([prompt + answer], device=dev)  # [1, T]
        keep = len(answer) + 1  # the last prompt token predicts the first answer token
        logits = model(input_ids=ids, logits_to_keep=keep).logits[0, :-1]  # [len(answer), vocab]
        correct += int(logits.argmax(-1).tolist() == answer)
    return correct / max(len(prompts), 1)
