"""Mitigation presets: named combinations of existing settings.

A preset fills ``chunk_size``, ``hop``, ``keep_boundary`` or ``stagger`` for
the user; an explicit value contradicting it is an error (`core/config.py`
checks that). Adding a preset that only combines existing settings means
adding one entry to `PRESETS`: the config's choices and its error messages
follow from it (and a line in the docs' mitigation table tells users).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


class PresetError(ValueError):  # core/config.py turns it into a one-line ChunkedKVConfigError
    """A setting the preset cannot work with: (field, detail)."""

    def __init__(self, field: str, detail: str):
        super().__init__(detail)
        self.field = field
        self.detail = detail


@dataclass(frozen=True)
class Preset:
    summary: str
    settings: Callable[[int, dict[str, Any]], dict[str, Any]]
    """The values it sets, given the chunk_size asked for and the settings
    given explicitly (may raise PresetError); explicit values that differ
    from them are errors."""


def _fixed(**values: Any) -> Callable[[int, dict[str, Any]], dict[str, Any]]:
    return lambda chunk_size, explicit: dict(values)


def _boundary(chunk_size: int, explicit: dict[str, Any]) -> dict[str, Any]:
    return {"hop": chunk_size, "keep_boundary": True}


def _overlap(chunk_size: int, explicit: dict[str, Any]) -> dict[str, Any]:
    if chunk_size % 2:
        raise PresetError("chunk_size", f"mitigation 'overlap' needs an even chunk_size (got {chunk_size})")
    return {"hop": chunk_size // 2, "keep_boundary": False}


def _stagger(chunk_size: int, explicit: dict[str, Any]) -> dict[str, Any]:
    if "stagger" not in explicit:
        return {"stagger": "heads"}
    if explicit["stagger"] == "none":
        raise PresetError("stagger", "mitigation 'stagger' needs stagger 'heads' or a list of origins (got 'none')")
    return {}  # the user's own origins


PRESETS: dict[str, Preset] = {
    "none": Preset("one pooled row per chunk (hop = chunk_size unless set)", _fixed()),
    "boundary": Preset("keep each sealed chunk's first and last token raw, pool the interior", _boundary),
    "overlap": Preset("50% overlapping chunks: hop = chunk_size / 2", _overlap),
    "stride2": Preset("chunks of 2 tokens: chunk_size = hop = 2", _fixed(chunk_size=2, hop=2, keep_boundary=False)),
    "stagger": Preset("KV head h on a grid shifted by (h mod stagger_groups) * hop / stagger_groups", _stagger),
}


def preset_values(name: str, chunk_size: int, explicit: dict[str, Any]) -> dict[str, Any]:
    """The values preset `name` fills in, given the chunk_size asked for and
    the settings given explicitly (not None), plus the baseline for what is
    still unset (hop = chunk_size, no boundary retention); raise PresetError
    on a contradiction."""
    wanted = PRESETS[name].settings(chunk_size, explicit)
    for field, value in wanted.items():
        if field in explicit and explicit[field] != value:
            raise PresetError(field, f"mitigation {name!r} sets {field} = {value!r} (got {explicit[field]!r})")
    baseline = {"hop": wanted.get("chunk_size", chunk_size), "keep_boundary": False}
    return {**{k: v for k, v in baseline.items() if k not in explicit}, **wanted}
