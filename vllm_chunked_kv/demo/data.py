"""Training batches for the demo model's curriculum, drawn from a `random.Random`.

- copy: `<bos> fillers s1 .. sn = s1 .. sn fillers`; the loss is on the repetition. This is
  what makes the induction circuit (attend to the token after the previous
  occurrence of the current token) appear, which plain recall training does
  not find on its own.
- recall: a retrieval haystack from `tasks.kv_retrieval.make_prompt`, followed
  by several queries `? key value` about records in it; the loss is on the
  queried values only. The first query is exactly the evaluation format.

Labels use -100 where no loss is taken (transformers' ignore index).
"""

from __future__ import annotations

import random

import torch

from vllm_chunked_kv.tasks.kv_retrieval import COPY_MARK, FILLERS, KEYS, QUERY, VALUES, VOCAB, make_prompt

IGNORE = -100
_ID = {word: i for i, word in enumerate(VOCAB)}
_COPYABLE = KEYS + VALUES  # segments; fillers pad the front
RECORD_DENSITY = 0.2  # records per haystack token, as in the default prompt (48 in 240)


def copy_example(rng: random.Random, length: int, max_segment: int = 24) -> tuple[list[int], list[int]]:
    """Token ids and labels of one copy example of exactly `length` tokens.

    A segment of distinct words and its repetition sit at a random place
    among fillers, and the segment's length varies, so the distance between a
    token and its copy varies and the pair can be anywhere: copying by a
    fixed relative or absolute position does not work, looking up the
    previous occurrence of the current word does, at every position.
    """
    room = (length - 2) // 2
    segment_len = rng.randint(min(4, room), min(max_segment, room))
    segment = [_ID[w] for w in rng.sample(_COPYABLE, segment_len)]  # distinct words
    free = length - 2 - 2 * segment_len
    lead_len = rng.randint(0, free)
    lead = [_ID[w] for w in rng.choices(FILLERS, k=lead_len)]
    tail = [_ID[w] for w in rng.choices(FILLERS, k=free - lead_len)]
    ids = [_ID["<bos>"]] + lead + segment + [_ID[COPY_MARK]] + segment + tail
    copy_start = 1 + lead_len + segment_len + 1
    labels = [IGNORE] * copy_start + segment + [IGNORE] * len(tail)
    return ids, labels


def pairs_example(rng: random.Random, length: int, max_pairs: int = 16) -> tuple[list[int], list[int]]:
    """Token ids and labels of one associative-recall example of exactly `length` tokens.

    `k1 v1 .. kn vn = ka va kb vb ..`: the pairs, then the same pairs in a
    shuffled order; the loss is on the repeated values. The order is new, so
    only looking up the previous occurrence of the current key predicts its
    value (no positional shortcut), and every second token carries a label.
    """
    room = (length - 2) // 4
    num_pairs = rng.randint(min(2, room), min(max_pairs, room))
    keys = rng.sample(KEYS, num_pairs)
    values = [rng.choice(VALUES) for _ in keys]
    order = rng.sample(range(num_pairs), num_pairs)
    free = length - 2 - 4 * num_pairs
    lead_len = rng.randint(0, free)
    words = rng.choices(FILLERS, k=lead_len)
    for key, value in zip(keys, values):
        words += [key, value]
    words.append(COPY_MARK)
    repeat_start = 1 + len(words)
    for i in order:
        words += [keys[i], values[i]]
    words += rng.choices(FILLERS, k=free - lead_len)
    ids = [_ID["<bos>"]] + [_ID[w] for w in words]
    labels = [IGNORE] * len(ids)
    for j in range(num_pairs):
        labels[repeat_start + 2 * j + 1] = ids[repeat_start + 2 * j + 1]
    return ids, labels


def recall_example(rng: random.Random, length: int, num_queries: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one recall example of exactly `length` tokens."""
    haystack_len = length - 1 - 3 * num_queries  # <bos>, haystack, then num_queries x (? key value)
    num_records = max(num_queries, round(RECORD_DENSITY * haystack_len * rng.uniform(0.8, 1.2)))
    prompt = make_prompt(rng, haystack_len=haystack_len, num_records=num_records)
    words = prompt.text.split()
    records = {words[i]: words[i + 1] for i in range(len(words) - 3) if words[i] in KEYS}
    first_key = words[-1]
    others = rng.sample(sorted(k for k in records if k != first_key), num_queries - 1)
    words.append(prompt.answer)
    for key in others:
        words += [QUERY, key, records[key]]
    ids = [_ID["<bos>"]] + [_ID[w] for w in words]
    answer_at = {1 + len(words) - 1 - 3 * j for j in range(num_queries)}  # token index of each answer
    labels = [ids[i] if i in answer_at else IGNORE for i in range(len(ids))]
    return ids, labels


def batch(
    rng: random.Random, task: str, batch_size: int, length: int, num_queries: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels), each [batch_size, length], for `task` in {copy, recall}."""
    rows = [
        copy_example(rng, length) if task == "copy"
        else pairs_example(rng, length) if task == "pairs"
        else recall_example(rng, length, num_queries)
        for _ in range(batch_size)
    ]
    ids = torch.tensor([r[0] for r in rows])  # [batch_size, length]
    labels = torch.tensor([r[1] for r in rows])  # [batch_size, length]
    return ids, labels
