"""Retrieval in ordinary prose for real models: a person's numeric code, asked for later.

A record ("Note: Maria Olsen's access code is 4812.") sits in filler prose;
after at least `MIN_TAIL_TOKENS` more tokens of prose (so the record is older
than a 128-token raw window plus a chunk) comes the question, which ends
mid-answer ("... Answer: Maria Olsen's access code is"), so a model that
found the record continues with its digits. The tail also carries one
distractor record about someone else, inside the window.

Two disjoint sets of names and fillers (the evaluation's one phrasing is also
one of training's seven):

- `evaluation`: the scanner task file shipped in `tasks/data/prose_codes.jsonl`
  (`write_task_file`; JSONL in the format of `scan/tasks.py`), filler of
  plain everyday sentences written for it;
- `training`: `training_text` builds `adapt`'s retrieval rows from other names,
  seven phrasings and standard-library docstrings as filler
  (`english_text`, training split).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TASK_FILE = Path(__file__).parent / "data" / "prose_codes.jsonl"
MIN_TAIL_TOKENS = 160  # prose after the record: beyond a 128-token window plus a 4-token chunk and slack

_EVAL_FIRST = "Maria Daniel Sofia Henrik Amara Lucas Ines Tomas Yara Felix Nadia Oscar Leila Mateo Greta Arjun".split()
_EVAL_LAST = "Olsen Moreau Castillo Novak Brennan Ito Haddad Lindqvist Okafor Rossi Petrov Walsh".split()
_TRAIN_FIRST = "Alice Bruno Chloe Dmitri Elena Farid Hana Igor Julia Kofi Lena Marco Nina Omar Priya Quentin Rosa Samir Tara Viktor".split()
_TRAIN_LAST = "Anders Bauer Costa Dubois Evans Fischer Garcia Hansen Ivanova Jensen Kowalski Lopez Meyer Nakamura".split()

# (record, question, answer prefix) phrasings; {name} and {code} are filled in.
_EVAL_PHRASES = [("Note: {name}'s access code is {code}.", "What is {name}'s access code?", "{name}'s access code is")]
_TRAIN_PHRASES = [
    ("Remember that the locker code of {name} is {code}.", "What is the locker code of {name}?", "The locker code of {name} is"),
    ("{name} wrote down the number {code} for the new safe.", "Which number did {name} write down?", "{name} wrote down the number"),
    ("The badge number assigned to {name} is {code}.", "What badge number was assigned to {name}?", "The badge number assigned to {name} is"),
    ("For the record, {name}'s PIN is {code}.", "What is {name}'s PIN?", "{name}'s PIN is"),
    ("{name} said the room number was {code}.", "What room number did {name} mention?", "The room number was"),
    ("Note: {name}'s access code is {code}.", "What is {name}'s access code?", "{name}'s access code is"),
    ("In the ledger, {name} is listed under account {code}.", "Which account is {name} listed under?", "{name} is listed under account"),
]

EVAL_FILLERS = [
    " The weather was calm and the town was quiet that day. People walked slowly along the river.",
    " A light rain fell in the morning, and by noon the streets had dried in the sun.",
    " The bakery on the corner opened early, and the smell of fresh bread filled the square.",
    " Children played in the park while their parents talked on the benches under the trees.",
    " The train from the coast arrived a little late, as it often did in the summer.",
    " In the library, a few students read quietly at the long wooden tables near the windows.",
]
_EVAL_TAIL = (
    " Later that week, the office moved to a new building across the street. The old rooms were"
    " painted, the furniture was sold, and the plants were given to anyone who wanted one. Most of"
    " the staff liked the new place, which had larger windows and a small kitchen on every floor."
    " The move took three days. On the last day, everyone stayed late to unpack the boxes, and the"
    " manager ordered pizza for the whole team. Note: {other}'s access code is {other_code}. Nobody"
    " remembered exactly where the printer cables had gone, but they turned up a week later in a"
    " drawer in the meeting room. After that, things settled into their usual rhythm again, and the"
    " only complaint anyone had was about the coffee machine, which was slower than the old one."
    " In the evenings the building was quiet, and the cleaners worked their way from floor to floor."
)


def _code(rng: random.Random) -> str:
    return str(rng.randint(1000, 9999))


def _name(rng: random.Random, first: list[str], last: list[str]) -> str:
    return f"{rng.choice(first)} {rng.choice(last)}"


def task_lines(count: int = 256, seed: int = 0) -> list[dict]:
    """Scanner task lines (JSONL objects) for the evaluation split."""
    rng = random.Random(f"prose-codes:{seed}")
    lines = []
    for i in range(count):
        name = _name(rng, _EVAL_FIRST, _EVAL_LAST)
        other = _name(rng, _EVAL_FIRST, _EVAL_LAST)
        while other.split()[0] == name.split()[0]:
            other = _name(rng, _EVAL_FIRST, _EVAL_LAST)
        record, question, prefix = _EVAL_PHRASES[0]
        code = _code(rng)
        tail = _EVAL_TAIL.format(other=other, other_code=_code(rng))
        template = (
            "Read the notes and answer the question.\n\nNotes:{record}" + tail
            + f"\n\nQuestion: {question.format(name=name)}\nAnswer: {prefix.format(name=name)}"
        )
        lines.append({
            "template": template, "record": " " + record.format(name=name, code=code),
            "answer": code, "filler": EVAL_FILLERS[i % len(EVAL_FILLERS)],
        })
    return lines


def write_task_file(path: Path = TASK_FILE, count: int = 256, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(line) + "\n" for line in task_lines(count, seed)))
    return path


@dataclass(frozen=True)
class Fact:
    record: str
    question: str
    prefix: str
    code: str


def training_facts(rng: random.Random, count: int, same_phrasing: bool = False) -> list[Fact]:
    """`count` facts about distinct people of the training split, each in a random
    phrasing or, with `same_phrasing`, all in one."""
    names: list[str] = []
    while len(names) < count:
        name = _name(rng, _TRAIN_FIRST, _TRAIN_LAST)
        if name not in names:
            names.append(name)
    facts = []
    shared = rng.choice(_TRAIN_PHRASES) if same_phrasing else None
    for name in names:
        record, question, prefix = shared or rng.choice(_TRAIN_PHRASES)
        code = _code(rng)
        facts.append(Fact(record.format(name=name, code=code), question.format(name=name),
                          prefix.format(name=name), code))
    return facts


def question_text(fact: Fact) -> tuple[str, str]:
    """(text up to the answer, the answer with its leading space) for one question."""
    return f"\n\nQuestion: {fact.question}\nAnswer: {fact.prefix}", f" {fact.code}."


if __name__ == "__main__":
    print(write_task_file())
