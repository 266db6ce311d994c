"""Turn a prompt described as segments into what is sent, in the scan's units.

A prompt is a sequence of segments: `Text` (sent as is), `Fill` (a number of
filler units) and one `Target` (the record whose position is measured). The
units are tokens when the server can tokenize, characters otherwise:

- tokens: the server's special prefix (e.g. `<bos>`), then each text segment
  tokenized on its own without special tokens, each fill the filler's tokens
  cycled to the count; the prompt goes out as token ids, so positions are
  exact. Position 0 is the first token, special prefix included.
- characters: the segments joined as text, each fill the filler's
  characters cycled to the count; positions count characters.
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass
from typing import Union

from vllm_chunked_kv.scan.client import EndpointClient
from vllm_chunked_kv.scan.errors import ScanError


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Fill:
    count: int
    filler: str


@dataclass(frozen=True)
class Target:
    text: str


Segment = Union[Text, Fill, Target]


@dataclass(frozen=True)
class Rendered:
    prompt: str | list[int]
    target_position: int  # in units, 0 = first unit sent
    length: int  # prompt length in units
    target_end: int  # units up to the target's end (= length without a target)

    @property
    def distance(self) -> int:
        """Units after the target's last unit (scan/placement.py)."""
        return self.length - self.target_end


class Renderer:
    """Renders segments in characters (`client is None`) or in the server's tokens."""

    def __init__(self, client: EndpointClient | None = None, model: str = ""):
        self.client = client
        self.model = model
        self.units = "chars" if client is None else "tokens"
        self._cache: dict[tuple[str, bool], asyncio.Future] = {}

    async def _tokens(self, text: str, add_special: bool = False) -> list[int]:
        key = (text, add_special)
        if key not in self._cache:  # concurrent callers share one request
            self._cache[key] = asyncio.ensure_future(self.client.tokenize(self.model, text, add_special))
        try:
            return await asyncio.shield(self._cache[key])
        except Exception:
            self._cache.pop(key, None)
            raise

    async def special_prefix(self) -> list[int]:
        """Tokens the server adds in front of a text (e.g. [<bos>]); [] in character units."""
        if self.client is None:
            return []
        plain = await self._tokens("a")
        special = await self._tokens("a", True)
        if len(special) >= len(plain) and special[len(special) - len(plain) :] == plain:
            return special[: len(special) - len(plain)]
        return []

    async def length(self, segments: list[Segment] | tuple[Segment, ...]) -> int:
        """Units up to (not including) the target, or of everything without a target."""
        return (await self.render(segments)).target_position

    async def _fill(self, fill: Fill) -> list[int] | str:
        if fill.count == 0:
            return [] if self.client else ""
        unit = await self._tokens(fill.filler) if self.client else fill.filler
        if not unit:
            raise ScanError(f"filler {fill.filler!r} is empty in {self.units}")
        cycled = itertools.islice(itertools.cycle(unit), fill.count)
        return list(cycled) if self.client else "".join(cycled)

    async def render(self, segments: list[Segment] | tuple[Segment, ...]) -> Rendered:
        parts: list = [await self.special_prefix()] if self.client else []
        target_position = target_end = None
        for segment in segments:
            if isinstance(segment, Fill):
                parts.append(await self._fill(segment))
                continue
            if isinstance(segment, Target):
                target_position = sum(len(p) for p in parts)
            parts.append(await self._tokens(segment.text) if self.client else segment.text)
            if isinstance(segment, Target):
                target_end = sum(len(p) for p in parts)
        length = sum(len(p) for p in parts)
        prompt = [t for p in parts for t in p] if self.client else "".join(parts)
        if target_position is None:
            target_position = target_end = length
        return Rendered(prompt, target_position, length, target_end)
