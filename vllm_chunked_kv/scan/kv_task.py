"""The project's key-value retrieval task (`vllm_chunked_kv.tasks.kv_retrieval`) as scan items.

A prompt is `<bos>`, a haystack of `kX vY` records among filler words, then
`? kX`; the target is the record's value token. Every item of one scan has
the same length (`haystack_len` is fixed), so prepending filler moves the
target and the prompt's end together (offset probe), and the `length`
probe's filler goes between the haystack and the question.
"""

from __future__ import annotations

import random

from vllm_chunked_kv.scan.errors import ScanError
from vllm_chunked_kv.scan.items import Item
from vllm_chunked_kv.scan.placement import Geometry
from vllm_chunked_kv.scan.render import Fill, Renderer, Target, Text
from vllm_chunked_kv.tasks import kv_retrieval as kv


class KVTask:
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

    def _item(self, prompt: kv.KVPrompt, filler: str = " ") -> Item:
        """Segments: head, value (the target), the rest of the haystack, an empty fill, `? key`."""
        words = prompt.text.split(" ")
        value = prompt.target_position - 1  # text has no <bos>: word i is token i + 1
        head = " ".join(words[:value]) + " "
        body = "".join(" " + w for w in words[value + 1 : -2])
        question = " " + " ".join(words[-2:])
        segments = (Text(head), Target(words[value]), Text(body), Fill(0, filler), Text(question))
        return Item(segments, prompt.answer, slot=3)

    def _default_position(self) -> int:
        return min(self.haystack_len // 2, self._last_position())

    async def offset_items(self, renderer: Renderer, count: int, seed: int, position: int | None) -> list[Item]:
        position = self._default_position() if position is None else position
        return [
            self._item(self._make(random.Random(f"{seed}:offset:{i}"), position)) for i in range(count)
        ]

    async def length_items(self, renderer: Renderer, count: int, seed: int, hop: int) -> list[Item]:
        """Items whose targets cover every phase equally (position p0 - i mod hop), all one length."""
        filler = self.filler(renderer.units)
        p0 = self._default_position()
        return [
            self._item(self._make(random.Random(f"{seed}:length:{i}"), p0 - i % hop), filler) for i in range(count)
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
