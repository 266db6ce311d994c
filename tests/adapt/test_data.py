"""Contract of adapt's training rows (`adapt.data`).

- Every row has exactly the requested length, ids and labels alike.
- Retrieval rows: labels are set only where the next token is part of an
  answer, and the labelled tokens spell the asked codes (with their period);
  every asked fact that is not the one recent fact starts at least
  `min_distance` tokens before the first question.
- A row is a function of the rng seed: the same seed gives the same row.
"""

from __future__ import annotations

import random

from vllm_chunked_kv.adapt import data


def test_rows_have_the_length_and_label_answers_only(byte_tokenizer):
    for seed in range(20):
        row = data.retrieval_row(byte_tokenizer, random.Random(seed), 1024)
        assert len(row.ids) == len(row.labels) == 1024
        labelled = [(p, t) for p, t in enumerate(row.labels) if t != data.IGNORE]
        assert labelled
        for p, t in labelled:
            assert row.ids[p + 1] == t  # a label is the next input token
        text = byte_tokenizer.decode(row.ids)
        answers = byte_tokenizer.decode([t for _, t in labelled])
        codes = [c for c in answers.replace(".", " ").split()]
        assert codes and all(c.isdigit() and len(c) == 4 for c in codes)
        first_question = text.index("\n\nQuestion:")
        for code in codes:
            assert code in text[:first_question]  # the fact is in the body


def test_old_facts_are_beyond_min_distance(byte_tokenizer):
    far = 0
    for seed in range(30):
        row = data.retrieval_row(byte_tokenizer, random.Random(seed), 1400, min_distance=300)
        text = byte_tokenizer.decode(row.ids)
        first_question = text.index("\n\nQuestion:")
        answers = byte_tokenizer.decode([t for t in row.labels if t != data.IGNORE]).replace(".", " ").split()
        distances = [first_question - text.index(code) for code in answers]
        # at most one asked fact (the recent one) may be closer than min_distance
        assert sum(d < 300 for d in distances) <= 1
        far += sum(d >= 300 for d in distances)
    assert far > 20


def test_rows_are_deterministic(byte_tokenizer):
    a = data.retrieval_row(byte_tokenizer, random.Random(7), 512)
    b = data.retrieval_row(byte_tokenizer, random.Random(7), 512)
    c = data.text_row(byte_tokenizer, random.Random(7), 512)
    assert a == b and len(c.ids) == 512 and set(c.labels) == {data.IGNORE}
