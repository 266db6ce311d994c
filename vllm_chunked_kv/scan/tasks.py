"""What the scanner asks: the synthetic key-value task, or a team's own tasks from JSONL.

Each task yields `Item`s: a prompt as segments (see `render.py`) with one
`Target` and the expected answer. Two families of items:

- offset items: prompts whose target sits at the same position in every
  item, so that prepending `k` filler units moves every target to the same
  new position (DESIGN.md §7, the prefix-offset probe);
- needle items: only the target's position changes, position-matched across
  phases (`needle_positions_by_phase`, DESIGN.md §7).

User tasks (one JSON object per line):

    {"template": "Notes: {record} Question: what is Bob's code? Answer:",
     "record": "Bob's code is 4812.", "answer": "4812", "filler": "optional text"}

The record goes into the template's `{record}` slot; its position is that of
its first unit. The filler (default: a neutral sentence) pads around it.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.render import Fill, Renderer, Segment, Target, Text
from vllm_chunked_kv.tasks import kv_retrieval as kv

DEFAULT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
SLOT = "{record}"


@dataclass(frozen=True)
class Item:
    segments: tuple[Segment, ...]
    answer: str


class KVTask:
    """The project's key-value retrieval task (`vllm_chunked_kv.tasks.kv_retrieval`)."""

    name = "kv"
    default_max_tokens = 1  # the answer is one word; the demo model never emits <eos>

    def __init__(self, haystack_len: int = 240, num_records: int = 48):
        self.haystack_len = haystack_len
        self.num_records = num_records

    def filler(self, units: str) -> str:
        # Whole filler words in tokens; spaces in characters (the seeds' "extra spaces").
        return " ".join(kv.FILLERS) if units == "tokens" else " "

    def is_correct(self, completion: str, answer: str) -> bool:
        return kv.is_correct(completion, answer)

    def _item(self, prompt: kv.KVPrompt) -> Item:
        words = prompt.text.split(" ")
        value = prompt.target_position - 1  # text has no <bos>: word i is token i + 1
        head = " ".join(words[:value]) + " "
        return Item((Text(head), Target(" ".join(words[value:]))), prompt.answer)

    async def offset_items(self, renderer: Renderer, count: int, seed: int, position: int | None) -> list[Item]:
        position = self.haystack_len // 2 if position is None else position
        return [
            self._item(self._make(random.Random(f"{seed}:offset:{i}"), position)) for i in range(count)
        ]

    async def needle_items(
        self, renderer: Renderer, hop: int, per_phase: int, seed: int, span: tuple[int, int] | None
    ) -> dict[int, list[Item]]:
        # Default: past a few sink tokens, and older than a raw window of ~32 before the query.
        lo, hi = span or (8, max(self.haystack_len - 40, self.haystack_len // 2))
        positions = kv.needle_positions_by_phase(hop, per_phase, lo, hi, random.Random(f"{seed}:needle"))
        return {
            phase: [self._item(self._make(random.Random(f"{seed}:needle:{phase}:{i}"), p)) for i, p in enumerate(ps)]
            for phase, ps in positions.items()
        }

    def _make(self, rng: random.Random, position: int) -> kv.KVPrompt:
        try:
            return kv.make_prompt(
                rng, haystack_len=self.haystack_len, num_records=self.num_records, target_position=position
            )
        except ValueError as exc:
            raise ScanError(f"kv task: {exc}") from None


@dataclass(frozen=True)
class UserLine:
    head: str  # template before the slot
    record: str
    tail: str  # template after the slot
    answer: str
    filler: str


class UserTask:
    """Tasks from a JSONL file; see the module docstring for the format."""

    default_max_tokens = 16

    def __init__(self, path: str | Path):
        self.name = str(path)
        self.lines = load_user_lines(path)

    def filler(self, units: str) -> str:
        return DEFAULT_FILLER

    def is_correct(self, completion: str, answer: str) -> bool:
        """The completion, whitespace collapsed, starts with the answer."""
        return " ".join(completion.split()).startswith(" ".join(answer.split()))

    async def _bases(self, renderer: Renderer) -> list[int]:
        """Units before the record slot, per line."""
        return [await renderer.length((Text(line.head), Target(line.record))) for line in self.lines]

    async def offset_items(self, renderer: Renderer, count: int, seed: int, position: int | None) -> list[Item]:
        # Pad each line in front so that every record starts at the same position.
        bases = await self._bases(renderer)
        start = max(bases) if position is None else position
        if start < max(bases):
            raise ScanError(f"--target-position {start} is before a record that starts at {max(bases)}")
        items = []
        for i in range(count):
            line, base = self.lines[i % len(self.lines)], bases[i % len(self.lines)]
            segments = (Fill(start - base, line.filler), Text(line.head), Target(line.record), Text(line.tail))
            items.append(Item(segments, line.answer))
        return items

    async def needle_items(
        self, renderer: Renderer, hop: int, per_phase: int, seed: int, span: tuple[int, int] | None
    ) -> dict[int, list[Item]]:
        bases = await self._bases(renderer)
        lo, hi = span or (max(bases), max(bases) + 16 * hop)
        if lo < max(bases):
            raise ScanError(f"--needle-range starts at {lo}, before a record that starts at {max(bases)}")
        positions = kv.needle_positions_by_phase(hop, per_phase, lo, hi, random.Random(f"{seed}:needle"))
        groups: dict[int, list[Item]] = {}
        for phase, ps in positions.items():
            items = []
            for i, position in enumerate(ps):
                line, base = self.lines[i % len(self.lines)], bases[i % len(self.lines)]
                before = position - base  # filler units in front of the record
                after = hi - base - before  # keeps each line's prompt length fixed
                segments = (
                    Text(line.head), Fill(before, line.filler), Target(line.record),
                    Fill(after, line.filler), Text(line.tail),
                )
                items.append(Item(segments, line.answer))
            groups[phase] = items
        return groups


def load_user_lines(path: str | Path) -> list[UserLine]:
    """Parse and check the JSONL file; any problem is one ScanError naming the line."""
    path = Path(path)
    try:
        raw_lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ScanError(f"cannot read task file {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ScanError(f"{path}: not UTF-8 text") from None
    lines = []
    for number, raw in enumerate(raw_lines, start=1):
        if not raw.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ScanError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise ScanError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        for key in ("template", "record", "answer"):
            if not isinstance(obj.get(key), str) or not obj[key]:
                raise ScanError(f"{where}: '{key}' must be a non-empty string")
        filler = obj.get("filler", DEFAULT_FILLER)
        if not isinstance(filler, str) or not filler:
            raise ScanError(f"{where}: 'filler' must be a non-empty string when given")
        unknown = set(obj) - {"template", "record", "answer", "filler"}
        if unknown:
            raise ScanError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}")
        if obj["template"].count(SLOT) != 1:
            raise ScanError(f"{where}: 'template' must contain the slot {SLOT} exactly once")
        head, tail = obj["template"].split(SLOT)
        lines.append(UserLine(head, obj["record"], tail, obj["answer"], filler))
    if not lines:
        raise ScanError(f"{path}: no tasks (the file is empty)")
    return lines
