"""What the scanner asks: the synthetic key-value task, or a team's own tasks from JSONL.

Each task yields `Item`s: a prompt as segments (see `render.py`) with one
`Target` and the expected answer. Two families of items:

- offset items: prompts whose target sits at the same position in every
  item, so that prepending `k` filler units moves every target to the same
  new position (docs/design.md §7, the prefix-offset probe);
- needle items: only the target's position changes, position-matched across
  phases (`needle_positions_by_phase`, docs/design.md §7).

User tasks (one JSON object per line):

    {"template": "Notes: {record} Question: what is Bob's code? Answer:",
     "record": "Bob's code is 4812.", "answer": "4812", "filler": "optional text"}

The record goes into the template's `{record}` slot; its position is that of
its first unit. The filler (default: a neutral sentence) pads around it.

`place(renderer, geometry)` (called by the scan once it knows the server)
makes the default positions land where the server compresses
(`placement.py`): the kv task grows its haystack, user tasks pad between the
record and the question, so that every target has at least
`geometry.min_distance` units after it and sits past the sinks. Without it
the items are built as if the window were 0.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.placement import Geometry
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
        self.min_distance: int | None = None  # tokens a target must have after it (set by place)
        self.lo = 8  # first needle position by default: past a few sink tokens

    async def place(self, renderer: Renderer, geometry: Geometry, hop: int, explicit: list[int]) -> None:
        """Grow the haystack so every default or `explicit` target has `min_distance` tokens after it."""
        self.min_distance = geometry.min_distance  # in tokens: this task's positions are token positions
        self.lo = max(self.lo, geometry.sink_tokens)
        last = max([self.lo + 16 * hop, *explicit])  # the latest target a probe may place
        # Prompt: <bos>, haystack, "?", key; the value at p has haystack_len + 2 - p tokens after it.
        self.haystack_len = max(self.haystack_len, last + self.min_distance - 2)

    def _last_position(self) -> int:
        """The latest default target: `min_distance` tokens before the end, else ~40 (unplaced)."""
        if self.min_distance is None:
            return max(self.haystack_len - 40, self.haystack_len // 2)
        return self.haystack_len + 2 - self.min_distance

    def filler(self, units: str) -> str:
        # Whole filler words in tokens; spaces in characters (the seeds' "extra spaces").
        return " ".join(kv.FILLERS) if units == "tokens" else " "

    def is_correct(self, completion: str, answer: str) -> bool:
        return kv.is_correct(completion, answer)

    def _item(self, prompt: kv.KVPrompt) -> Item:
        words = prompt.text.split(" ")
        value = prompt.target_position - 1  # text has no <bos>: word i is token i + 1
        head = " ".join(words[:value]) + " "
        tail = " " + " ".join(words[value + 1 :])
        return Item((Text(head), Target(words[value]), Text(tail)), prompt.answer)

    async def offset_items(self, renderer: Renderer, count: int, seed: int, position: int | None) -> list[Item]:
        position = min(self.haystack_len // 2, self._last_position()) if position is None else position
        return [
            self._item(self._make(random.Random(f"{seed}:offset:{i}"), position)) for i in range(count)
        ]

    async def needle_items(
        self, renderer: Renderer, hop: int, per_phase: int, seed: int, span: tuple[int, int] | None
    ) -> dict[int, list[Item]]:
        # Default: past the sinks, and older than the raw window (place), else than ~40 tokens.
        lo, hi = span or (self.lo, self._last_position())
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
        self.pads = [0] * len(self.lines)  # filler units between record and question (set by place)
        self.sinks = 0

    async def place(self, renderer: Renderer, geometry: Geometry, hop: int, explicit: list[int]) -> None:
        """Pad each line after its record so the record ends `min_distance` units before the prompt's end."""
        geometry = geometry.scaled(renderer.units)
        self.sinks = geometry.sink_tokens
        for i, line in enumerate(self.lines):
            rendered = await renderer.render((Text(line.head), Target(line.record), Text(line.tail)))
            self.pads[i] = max(0, geometry.min_distance - rendered.distance)

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
        start = max(*bases, self.sinks) if position is None else position
        if start < max(bases):
            raise ScanError(f"--target-position {start} is before a record that starts at {max(bases)}")
        items = []
        for i in range(count):
            k = i % len(self.lines)
            line, base, pad = self.lines[k], bases[k], self.pads[k]
            segments = (
                Fill(start - base, line.filler), Text(line.head), Target(line.record),
                Fill(pad, line.filler), Text(line.tail),
            )
            items.append(Item(segments, line.answer))
        return items

    async def needle_items(
        self, renderer: Renderer, hop: int, per_phase: int, seed: int, span: tuple[int, int] | None
    ) -> dict[int, list[Item]]:
        bases = await self._bases(renderer)
        first = max(*bases, self.sinks)
        lo, hi = span or (first, first + 16 * hop)
        if lo < max(bases):
            raise ScanError(f"--needle-range starts at {lo}, before a record that starts at {max(bases)}")
        positions = kv.needle_positions_by_phase(hop, per_phase, lo, hi, random.Random(f"{seed}:needle"))
        groups: dict[int, list[Item]] = {}
        for phase, ps in positions.items():
            items = []
            for i, position in enumerate(ps):
                k = i % len(self.lines)
                line, base = self.lines[k], bases[k]
                before = position - base  # filler units in front of the record
                after = hi - position + self.pads[k]  # keeps each line's prompt length fixed
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
