"""Contract of the prose retrieval task (`tasks.prose_codes`) and its text source (`tasks.english_text`).

- The shipped scanner task file is exactly what `write_task_file` produces
  (reproducible), loads as a scanner task, and every line's answer is the
  code in its record.
- Every record is followed by at least MIN_TAIL_TOKENS whitespace-separated
  words (each at least one token in any tokenizer) before the question, so
  the needle lies before a 128-token raw window plus a chunk.
- Evaluation and training use disjoint names, and training questions are
  answered by the code of the fact they ask about.
- The held-out English text shares no passage with the training text and
  is long enough for a 2k-token perplexity measurement.
"""

from __future__ import annotations

import json
import random

from vllm_chunked_kv.scan.tasks import load_user_lines
from vllm_chunked_kv.tasks import english_text, prose_codes


def test_shipped_file_is_reproducible_and_loads(tmp_path):
    regenerated = prose_codes.write_task_file(tmp_path / "t.jsonl")
    assert regenerated.read_text() == prose_codes.TASK_FILE.read_text()
    lines = load_user_lines(prose_codes.TASK_FILE)
    assert len(lines) == 256
    for line in lines:
        assert line.answer in line.record and line.answer.isdigit() and len(line.answer) == 4


def test_records_lie_before_the_window():
    for obj in prose_codes.task_lines(32):
        tail = obj["template"].split("{record}")[1]
        assert len(tail.split()) >= prose_codes.MIN_TAIL_TOKENS


def _names(text_lines):
    return {" ".join(l.split("'")[0].split()[-2:]) for l in text_lines}


def test_names_are_disjoint_between_splits():
    eval_first = {json.loads(l)["record"].split()[1] for l in prose_codes.TASK_FILE.read_text().splitlines()}
    facts = prose_codes.training_facts(random.Random(0), 200)
    train_first = {w for f in facts for w in f.record.replace("'s", "").split() if w in prose_codes._TRAIN_FIRST}
    assert eval_first and train_first and not (eval_first & train_first)
    for fact in facts[:20]:
        question, answer = prose_codes.question_text(fact)
        assert answer.strip(" .") == fact.code and fact.code in fact.record


def test_held_out_text_is_disjoint_and_long_enough():
    train, held = set(english_text.passages(False)), set(english_text.passages(True))
    assert train and held and not (train & held)
    text = english_text.held_out_text()
    assert len(text.split()) > 1500  # > 2k tokens in any subword tokenizer
    assert all(p in held for p in text.split("\n\n") if p in train or p in held)
