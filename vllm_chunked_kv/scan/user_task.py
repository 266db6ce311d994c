"""A team's own tasks from JSONL, as scan items.

One JSON object per line:

    {"template": "Notes: {record} Question: what is Bob's code? Answer:",
     "record": "Bob's code is 4812.", "answer": "4812", "filler": "optional text"}

The record goes into the template's `{record}` slot; its position is that of
its first unit. The filler (default: a neutral sentence) pads around it:
before the record to move it (needle probe), after it to keep it beyond the
raw window (`place`) and to give every line of the offset and length probes
one common prompt length (so that filler in front moves target and prompt
end together, and filler after the record moves only the end).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.items import DEFAULT_FILLER, Item, prepended
from vllm_chunked_kv.scan.placement import Geometry
from vllm_chunked_kv.scan.render import Fill, Renderer, Target, Text
from vllm_chunked_kv.tasks import kv_retrieval as kv

SLOT = "{record}"


@dataclass(frozen=True)
class UserLine:
    head: str  # template before the slot
    record: str
    tail: str  # template after the slot
    answer: str
    filler: str

    def item(self, before: int, after: int) -> Item:
        """`before` filler units in front of the record, `after` between it and the question."""
        segments = (
            Text(self.head), Fill(before, self.filler), Target(self.record), Fill(after, self.filler), Text(self.tail),
        )
        return Item(segments, self.answer, slot=3)


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
            rendered = await renderer.render(line.item(0, 0).segments)
            self.pads[i] = max(0, geometry.min_distance - rendered.distance)

    def filler(self, units: str) -> str:
        return DEFAULT_FILLER

    def is_correct(self, completion: str, answer: str) -> bool:
        """The completion, whitespace collapsed, starts with the answer."""
        return " ".join(completion.split()).startswith(" ".join(answer.split()))

    async def _sizes(self, renderer: Renderer) -> tuple[list[int], list[int]]:
        """Per line: units before the record, and the whole prompt's units, without any filler."""
        rendered = [await renderer.render(line.item(0, 0).segments) for line in self.lines]
        return [r.target_position for r in rendered], [r.length for r in rendered]

    async def offset_items(self, renderer: Renderer, count: int, seed: int, position: int | None) -> list[Item]:
        """Every record at one position and every prompt one length (filler in front and after the record)."""
        bases, lengths = await self._sizes(renderer)
        start = max(*bases, self.sinks) if position is None else position
        if start < max(bases):
            raise ScanError(f"--target-position {start} is before a record that starts at {max(bases)}")
        ends = [start - b + n + pad for b, n, pad in zip(bases, lengths, self.pads)]  # lengths with no extra
        items = []
        for i in range(count):
            k = i % len(self.lines)
            line = self.lines[k]
            items.append(prepended(line.item(0, self.pads[k] + max(ends) - ends[k]), start - bases[k], line.filler))
        return items

    async def length_items(self, renderer: Renderer, count: int, seed: int, hop: int) -> list[Item]:
        """Records at `first + i mod hop` (every phase equally), every prompt one length."""
        bases, lengths = await self._sizes(renderer)
        first = max(*bases, self.sinks)
        common = max(n + (first + hop - 1 - b) + pad for b, n, pad in zip(bases, lengths, self.pads))
        items = []
        for i in range(count):
            k = (i // hop) % len(self.lines)  # each line in turn, at every phase
            before = first + i % hop - bases[k]
            items.append(self.lines[k].item(before, common - lengths[k] - before))
        return items

    async def needle_items(
        self, renderer: Renderer, hop: int, per_phase: int, seed: int, span: tuple[int, int] | None
    ) -> dict[int, list[Item]]:
        bases, _ = await self._sizes(renderer)
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
                # Filler in front of the record moves it; the rest after it keeps each line's length fixed.
                items.append(self.lines[k].item(position - bases[k], hi - position + self.pads[k]))
            groups[phase] = items
        return groups


def _in_front(item: Item, count: int, filler: str) -> Item:
    from vllm_chunked_kv.scan.items import prepended

    return prepended(item, count, filler)
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
