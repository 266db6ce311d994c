"""What a task hands the probes: a prompt as segments, the expected answer, and where it may grow.

`Item.slot` is the index of the `Fill` between the record and the question
(or None when the item has none): the `length` probe adds filler units
there, which moves the prompt's end and not the target (docs/design.md §7).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_chunked_kv.scan.render import Fill, Segment

DEFAULT_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


@dataclass(frozen=True)
class Item:
    segments: tuple[Segment, ...]
    answer: str
    slot: int | None = None  # index of the Fill after the record and before the question


def prepended(item: Item, count: int, filler: str) -> Item:
    """`count` filler units in front of everything: target and prompt end move together."""
    slot = None if item.slot is None else item.slot + 1
    return Item((Fill(count, filler),) + item.segments, item.answer, slot)


def grown(item: Item, extra: int) -> Item:
    """`extra` more filler units in the item's slot: only the prompt end moves."""
    if item.slot is None:
        raise ValueError("this item has no slot between its record and its question")
    fill = item.segments[item.slot]
    assert isinstance(fill, Fill), fill
    segments = list(item.segments)
    segments[item.slot] = replace(fill, count=fill.count + extra)
    return Item(tuple(segments), item.answer, item.slot)
