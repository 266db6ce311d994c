"""ChunkedKVConfigError: a bad chunked_kv setting as one line naming the field.

Pydantic reports a list of errors with locations and types; `core/config.py`
turns the first into ``chunked_kv.<field>: <what is allowed> (got <value>)``,
e.g. ``chunked_kv.chunk_size: must be >= 1 (got 0)``, so a bad value stops
startup with one readable line.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticCustomError

from vllm_chunked_kv.core.presets import PRESETS

ADDITIONAL_CONFIG_KEY = "chunked_kv"


class ChunkedKVConfigError(ValueError):
    """A bad chunked_kv setting; ``str()`` is one line naming the field."""

    def __init__(self, field: str | None, detail: str):
        self.field = field
        self.detail = detail
        where = ADDITIONAL_CONFIG_KEY if field is None else f"{ADDITIONAL_CONFIG_KEY}.{field}"
        super().__init__(f"{where}: {detail}")

    def __reduce__(self):  # travels to and from worker processes intact
        return type(self), (self.field, self.detail)

    @classmethod
    def from_validation_error(cls, exc: ValidationError, allowed: tuple[str, ...]) -> ChunkedKVConfigError:
        """The first error of a pydantic ValidationError, as one line."""
        errors = exc.errors()
        field, detail = _describe_error(errors[0], allowed)
        if len(errors) > 1:
            detail += f" (and {len(errors) - 1} more error(s))"
        return cls(field, detail)


def fail(field: str | None, detail: str) -> PydanticCustomError:
    """An error raised inside validation that remembers which field it is about."""
    return PydanticCustomError("chunked_kv", "{detail}", {"field": field, "detail": detail})


_CHOICES = {
    "mitigation": tuple(PRESETS),
    "pooling": ("mean", "gated", "key_norm"),
    "align": ("none", "prompt_end"),
    "boundaries": ("fixed", "dynamic"),
}


def _describe_error(err: Mapping[str, Any], allowed: tuple[str, ...]) -> tuple[str | None, str]:
    """(field, detail) for one pydantic error dict."""
    kind, loc, ctx = err["type"], err.get("loc", ()), err.get("ctx") or {}
    if kind == "chunked_kv":
        return ctx["field"], ctx["detail"]
    if kind == "extra_forbidden":
        return None, f"unknown key {loc[0]!r} (allowed: {', '.join(allowed)})"
    field = str(loc[0]) + "".join(f"[{part}]" for part in loc[1:]) if loc else None
    if kind == "value_error":  # our field validators put the input in the message
        return field, str(ctx.get("error", err["msg"]))
    if kind == "literal_error":
        detail = "must be one of " + ", ".join(_CHOICES.get(str(loc[0]), ()))
    elif kind in ("greater_than_equal", "greater_than"):
        detail = f"must be >= {ctx['ge']}" if "ge" in ctx else f"must be > {ctx['gt']}"
    elif kind.startswith("int_"):
        detail = "must be an integer"
    elif kind.startswith("float_") or kind == "finite_number":
        detail = "must be a finite number"
    elif kind.startswith("bool_"):
        detail = "must be true or false"
    elif kind.startswith("list_"):
        detail = "must be a list"
    else:
        detail = err["msg"][:1].lower() + err["msg"][1:]
    return field, f"{detail} (got {err.get('input')!r})"
