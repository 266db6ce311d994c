"""Training rows for `adapt`: plain English text and prose retrieval beyond the raw window.

Both kinds use the training split of `tasks.english_text` (standard-library
docstrings), never the held-out passages perplexity is measured on, nor the
names or the filler of the shipped evaluation task (`tasks.prose_codes`; one
of the seven training phrasings is the evaluation's).

- text row: `length` tokens of consecutive docstring passages. Loss: KL to
  the full-attention teacher on every token (keeps the model's general
  ability under compression).
- repeat row: a text row in which, after the first `min_distance` tokens,
  stretches of fresh text alternate with verbatim copies of earlier spans of
  the same row, every copied token at least `min_distance` tokens after its
  source (beyond the raw window). Loss: KL on every token. Held-out text
  repeats phrases far apart, and those tokens are most of what pooling
  costs in perplexity (`benchmarks/perplexity.py`'s `ppl_by_repeat`); the
  full-attention teacher copies them almost surely, so these rows teach
  copying from pooled rows.
- retrieval row: docstring filler with facts ("The badge number assigned
  to Elena Costa is 5521."; 2-6 by default) at random token positions, then
  questions about some of them (1-3 by default), each answered by its code. Most asked
  facts sit more than `min_distance` tokens before their question (beyond
  the raw window), one may be recent. Loss: KL on every token plus cross-entropy on the answers.
  With probability `distractors` the row is a hard one: every fact has the
  same phrasing, so only the name tells them apart, and one fact that is not
  asked sits after the asked ones, nearer the questions (often inside the
  raw window, where it is read exactly while the asked ones are pooled).

Texts are encoded without special tokens; a tokenizer that starts every text
with `<bos>` (Gemma's) gets it once, at the start of the row (`with_bos`).

Everything follows from the `random.Random` passed in, so a step's batch is
a function of (seed, step) and a resumed run sees the same data.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vllm_chunked_kv.tasks import english_text, prose_codes

IGNORE = -100


@dataclass(frozen=True)
class Row:
    ids: list[int]  # [length]
    labels: list[int]  # [length]: the next-token target at answer tokens, IGNORE elsewhere


def encode(tokenizer, text: str) -> list[int]:
    """`text`'s tokens, without the special tokens a tokenizer may add (a `<bos>`)."""
    return tokenizer.encode(text, add_special_tokens=False)


def bos_id(tokenizer) -> int | None:
    """The `<bos>` id a tokenizer puts in front of every text, or None if it adds none."""
    bos = getattr(tokenizer, "bos_token_id", None)
    return bos if bos is not None and tokenizer.encode("a")[:1] == [bos] else None


def with_bos(row: Row, bos: int | None) -> Row:
    """`row` with `bos` in front (nothing to predict there), or unchanged when None."""
    return row if bos is None else Row([bos] + row.ids, [IGNORE] + row.labels)


def _filler(tokenizer, rng: random.Random, count: int) -> list[int]:
    """`count` tokens of consecutive training passages from a random starting passage."""
    passages = english_text.passages(False)
    start = rng.randrange(len(passages))
    ids: list[int] = []
    i = start
    while len(ids) < count + 64:
        ids += encode(tokenizer, passages[i % len(passages)] + "\n\n")
        i += 1
    offset = rng.randrange(0, len(ids) - count + 1)
    return ids[offset : offset + count]


def text_row(tokenizer, rng: random.Random, length: int) -> Row:
    ids = _filler(tokenizer, rng, length)
    return Row(ids, [IGNORE] * length)


COPY_TOKENS = (12, 64)  # length of a copied span in a repeat row, inclusive
FRESH_TOKENS = (16, 96)  # fresh text between two copies


def repeat_row(tokenizer, rng: random.Random, length: int, min_distance: int = 160) -> Row:
    """A repeat row of exactly `length` tokens (see the module docstring): about two
    fifths of the tokens after the first `min_distance` are copies."""
    ids = _filler(tokenizer, rng, length)  # [length]
    pos = min_distance
    while True:
        pos += rng.randint(*FRESH_TOKENS)  # keep the filler here
        size = rng.randint(*COPY_TOKENS)
        if pos + size > length:
            break
        src = rng.randint(0, pos - min_distance)  # every copied token is min_distance or more after its source
        ids[pos:pos + size] = ids[src:src + size]  # slice copy first: fine even if the spans overlap
        pos += size
    return Row(ids, [IGNORE] * length)


def retrieval_row(tokenizer, rng: random.Random, length: int, min_distance: int = 160,
                  questions: tuple[int, int] = (1, 3), distractors: float = 0.0,
                  facts: tuple[int, int] = (2, 6)) -> Row:
    """A retrieval row of exactly `length` tokens (see the module docstring) holding
    between `facts[0]` and `facts[1]` facts (at least 2) and asking between
    `questions[0]` and `questions[1]` of them; a hard row (one phrasing, a recent
    unasked fact) with probability `distractors`."""
    hard = distractors > 0 and rng.random() < distractors  # no draw at 0: rows of earlier recipes unchanged
    drawn = prose_codes.training_facts(rng, rng.randint(*facts), same_phrasing=hard)
    asked = rng.sample(range(len(drawn)), k=min(len(drawn) - hard, rng.randint(*questions)))
    question_ids = [(encode(tokenizer, q), encode(tokenizer, a))
                    for q, a in (prose_codes.question_text(drawn[i]) for i in asked)]
    tail = sum(len(q) + len(a) for q, a in question_ids)
    records = [encode(tokenizer, " " + f.record) for f in drawn]
    body = length - tail  # tokens before the first question
    # Asked facts go early enough to be beyond the window; others anywhere in the body.
    latest_old = body - min_distance - max(len(r) for r in records)
    if latest_old < 8:
        raise ValueError(f"length {length} is too short for facts {min_distance} tokens before the questions")
    recent = rng.random() < 0.25  # sometimes one asked fact is recent (read exactly from the window)
    old = [i in asked and not (recent and i == asked[-1]) for i in range(len(drawn))]
    late = [False] * len(drawn)
    if hard:  # the distractor: an unasked fact after the asked ones
        late[rng.choice([i for i in range(len(drawn)) if i not in asked])] = True
    starts = _place(rng, records, old, latest_old, body, late)
    ids = _filler(tokenizer, rng, body)
    targets = [IGNORE] * body  # aligned with ids: the token to predict there, at answer tokens only
    for start, record in zip(starts, records):
        ids[start : start + len(record)] = record
    for q, a in question_ids:
        ids += q + a
        targets += [IGNORE] * len(q) + a
    labels = targets[1:] + [IGNORE]  # labels[p]: the target of the prediction made at p
    return Row(ids[:length], labels[:length])


def _place(rng: random.Random, records: list[list[int]], old: list[bool], latest_old: int, body: int,
           late: list[bool]) -> list[int]:
    """Non-overlapping start positions: `old` records start by `latest_old`, `late` ones
    after every old one ends, the others anywhere in the body. Uniform draws, redrawn
    on overlap; when rows are too crowded for that to succeed, `_place_in_regions`
    places them constructively."""
    after_old = _regions(records, latest_old, body)[1][0]  # late records start after the old ones end
    for _ in range(100):
        starts = [rng.randint(after_old if t else 4, latest_old if o else body - len(r))
                  for r, o, t in zip(records, old, late)]
        spans = sorted((s, s + len(r)) for s, r in zip(starts, records))
        if all(a_end < b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
            return starts
    return _place_in_regions(rng, records, old, latest_old, body, late)


def _place_in_regions(rng: random.Random, records: list[list[int]], old: list[bool], latest_old: int, body: int,
                      late: list[bool]) -> list[int]:
    """Non-overlapping start positions: `old` records end by `latest_old` + their length
    (region A), `late` ones go after it (region B), the others to either at random."""
    region_a, region_b = _regions(records, latest_old, body)
    in_a = [o or (not t and rng.random() < 0.5) for o, t in zip(old, late)]
    size = lambda region, flag: region[1] - region[0] - sum(len(r) + 1 for r, a in zip(records, in_a) if a == flag)  # noqa: E731
    for i in sorted(range(len(records)), key=lambda i: old[i]):  # rebalance the free records if a region overflows
        if old[i] or late[i]:
            continue
        if in_a[i] and size(region_a, True) < 0:
            in_a[i] = False
        elif not in_a[i] and size(region_b, False) < 0 and size(region_a, True) >= len(records[i]) + 1:
            in_a[i] = True
    starts = [0] * len(records)
    for region, members in ((region_a, [i for i, a in enumerate(in_a) if a]), (region_b, [i for i, a in enumerate(in_a) if not a])):
        rng.shuffle(members)
        free = region[1] - region[0] - sum(len(records[i]) + 1 for i in members)
        if free < 0:  # the asked facts alone do not fit before the window, or everything does not fit
            raise ValueError("the rows are too short for their facts: make them longer")
        cuts = sorted(rng.randint(0, free) for _ in members)  # gaps before each record
        at = region[0]
        for cut, i in zip(cuts, members):
            starts[i] = at + cut
            at += len(records[i]) + 1  # sorted cuts: each record starts after the previous one's end
    return starts


def _regions(records: list[list[int]], latest_old: int, body: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Region A, where a record starting by `latest_old` ends at the latest, and region B after it."""
    region_a = (4, latest_old + max(len(r) for r in records))
    return region_a, (region_a[1] + 1, body)


def batch(rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids [rows, length], labels [rows, length])."""
    return torch.tensor([r.ids for r in rows]), torch.tensor([r.labels for r in rows])
