"""Contract of adapt's training rows (`adapt.data`).

- Every row has exactly the requested length, ids and labels alike.
- Retrieval rows: labels are set only where the next token is part of an
  answer, and the labelled tokens spell the asked codes (with their period);
  every asked fact that is not the one recent fact starts at least
  `min_distance` tokens before the first question.
- Hard rows (`distractors`): one phrasing for all facts, and an unasked fact
  after the asked ones beyond `min_distance`.
- Repeat rows: the first `min_distance` tokens are the filler's; after them
  copied spans of `COPY_TOKENS` lengths alternate with fresh text, every
  copied token at least `min_distance` positions after its source, and the
  copies are a third to a half of those tokens; no labels.
- A row is a function of the rng seed: the same seed gives the same row.
- A tokenizer that puts `<bos>` before every text (Gemma's) gets one, at
  position 0 of each row, nothing to predict there; the row keeps its length.
"""

from __future__ import annotations

import random
import re

from vllm_chunked_kv.adapt import data
from vllm_chunked_kv.tasks import prose_codes
from tests.adapt.conftest import ByteTokenizer


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


def test_facts_sets_how_many_facts_a_row_holds(byte_tokenizer):
    """`facts=(lo, hi)`: every row holds lo-hi facts (all of them placed), and asks up to
    `questions[1]` of them; the default is 2-6."""
    counts = []
    for seed in range(12):
        row = data.retrieval_row(byte_tokenizer, random.Random(seed), 2048, min_distance=640,
                                 questions=(6, 8), distractors=0.5, facts=(9, 12))
        text = byte_tokenizer.decode(row.ids)
        first_question = text.index("\n\nQuestion:")
        counts.append(len(_facts(text[:first_question])))
        asked = byte_tokenizer.decode([t for t in row.labels if t != data.IGNORE]).replace(".", " ").split()
        assert 6 <= len(asked) <= 8
    assert min(counts) >= 9 and max(counts) <= 12 and len(set(counts)) > 1
    default = [len(_facts(byte_tokenizer.decode(data.retrieval_row(byte_tokenizer, random.Random(s), 1024).ids)))
               for s in range(12)]
    assert min(default) >= 2 and max(default) <= 6


def test_rows_are_deterministic(byte_tokenizer):
    a = data.retrieval_row(byte_tokenizer, random.Random(7), 512)
    b = data.retrieval_row(byte_tokenizer, random.Random(7), 512)
    c = data.text_row(byte_tokenizer, random.Random(7), 512)
    assert a == b and len(c.ids) == 512 and set(c.labels) == {data.IGNORE}


def _facts(text: str) -> list[tuple[int, int, str]]:
    """(start, phrasing index, code) of every training-phrasing record in `text`, in order."""
    found = []
    for k, (record, _, _) in enumerate(prose_codes._TRAIN_PHRASES):
        pattern = re.escape(record).replace(r"\{name\}", r"[A-Z][a-z]+ [A-Z][a-z]+").replace(r"\{code\}", r"(\d{4})")
        found += [(m.start(), k, m.group(1)) for m in re.finditer(pattern, text)]
    return sorted(found)


def test_hard_rows_share_one_phrasing_and_put_an_unasked_fact_after_the_asked_ones(byte_tokenizer):
    """With `distractors=1` every row's facts use one phrasing and an unasked fact
    starts after every asked fact that lies beyond `min_distance`; at 0 rows mix phrasings."""
    for seed in range(20):
        row = data.retrieval_row(byte_tokenizer, random.Random(seed), 1024, min_distance=300, distractors=1.0)
        text = byte_tokenizer.decode(row.ids)
        first_question = text.index("\n\nQuestion:")
        facts = _facts(text[:first_question])
        asked = set(byte_tokenizer.decode([t for t in row.labels if t != data.IGNORE]).replace(".", " ").split())
        assert len(facts) >= 2 and len({k for _, k, _ in facts}) == 1
        old_asked = [s for s, _, code in facts if code in asked and first_question - s >= 300]
        assert any(code not in asked and s > max(old_asked, default=0) for s, _, code in facts)
    mixed = [_facts(byte_tokenizer.decode(data.retrieval_row(byte_tokenizer, random.Random(seed), 1024).ids))
             for seed in range(20)]
    assert any(len({k for _, k, _ in facts}) > 1 for facts in mixed)


def test_repeat_rows_copy_spans_from_beyond_min_distance(monkeypatch, byte_tokenizer):
    """With a filler whose token at p is p, a token is a copy iff it differs from its
    position, and its value is the position of its original."""
    monkeypatch.setattr(data, "_filler", lambda tokenizer, rng, count: list(range(count)))
    length, distance = 1200, 160
    for seed in range(10):
        row = data.repeat_row(byte_tokenizer, random.Random(seed), length, min_distance=distance)
        assert len(row.ids) == len(row.labels) == length and set(row.labels) == {data.IGNORE}
        assert row.ids[:distance] == list(range(distance))
        copied = [p for p, t in enumerate(row.ids) if t != p]
        assert all(p - row.ids[p] >= distance for p in copied)
        assert 0.33 < len(copied) / (length - distance) < 0.5
        spans, start = [], copied[0]  # maximal runs of consecutive copied positions continuing one source
        for prev, p in zip(copied, copied[1:] + [None]):
            if p is None or p != prev + 1 or row.ids[p] != row.ids[prev] + 1:
                spans.append(prev + 1 - start)
                start = p
        assert min(spans) >= 1 and max(spans) <= data.COPY_TOKENS[1]
        assert sum(s >= data.COPY_TOKENS[0] for s in spans) > len(spans) / 2


def test_repeat_rows_are_deterministic_real_filler(byte_tokenizer):
    a = data.repeat_row(byte_tokenizer, random.Random(3), 700)
    assert a == data.repeat_row(byte_tokenizer, random.Random(3), 700)
    assert a != data.repeat_row(byte_tokenizer, random.Random(4), 700) and len(a.ids) == 700


class BosTokenizer(ByteTokenizer):
    """Bytes, with a <bos> (id 1) in front of every text unless told not to: Gemma's habit."""

    bos_token_id = 1

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] * add_special_tokens + list(text.encode("utf-8"))


def test_a_tokenizer_that_adds_bos_gets_it_once_at_the_start():
    from vllm_chunked_kv.adapt import train

    opts = train.AdaptOptions(rows=4, full_rows=1, text_rows=1, repeat_rows=1, length=1400, min_distance=300)
    for step in range(3):
        for row in train.step_rows(BosTokenizer(), step, opts):
            assert len(row.ids) == len(row.labels) == 1400
            assert row.ids[0] == 1 and 1 not in row.ids[1:] and row.labels[0] == data.IGNORE
    assert data.bos_id(BosTokenizer()) == 1
