"""The chunk grid, once: where chunks lie, when they seal, what a slot holds.

docs/design.md §3-4 and §10 in functions. Positions count from 0 at the
first prompt token; each KV head has a grid origin ``o`` in ``[0, hop)``.
Chunk ``k`` covers ``[o + k*hop, o + k*hop + chunk_size)``; a query at
``t`` sees it compressed (it is *sealed*) once its last token is at least
``window`` behind: ``o + k*hop + chunk_size - 1 <= t - window``.

Every function takes the settings first (anything with ``chunk_size``,
``hop``, ``window``, ``sink_tokens``, ``keep_boundary``: a
`ChunkedKVConfig`) and works on Python ints and on broadcasting torch
tensors alike, so the step plan, the reference and the tests share one
definition. Triton and CUDA kernels receive the constants below by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from fractions import Fraction


class SlotKind(IntEnum):
    """What a compressed slot holds: slot ``s`` of a group of ``slots_per_group``
    is of kind ``s % slots_per_group``."""

    POOLED = 0  # the chunk's pooled row (logit bias log_weight)
    FIRST = 1  # boundary retention: the chunk's first token, raw
    LAST = 2  # boundary retention: the chunk's last token, raw


BOUNDARY_SLOTS = len(SlotKind)  # slots per chunk with boundary retention; 1 without


def slots_per_group(cfg) -> int:
    """Stored slots per sealed chunk: the pooled row, plus the two boundary rows."""
    return BOUNDARY_SLOTS if cfg.keep_boundary else 1


def tokens_per_state(cfg) -> Fraction:
    """Tokens of the compressed region per stored slot (what vLLM's spec
    declares): hop / slots_per_group, i.e. chunk_size / 3 with boundary
    retention (hop == chunk_size there), else hop."""
    return Fraction(cfg.hop, slots_per_group(cfg))


def _at_least_zero(x):
    return x.clamp(min=0) if hasattr(x, "clamp") else max(x, 0)


# --------------------------------------------------------------- chunks


def chunk_start(cfg, k, origin=0):
    """First position of chunk ``k``."""
    return origin + k * cfg.hop


def chunk_last(cfg, k, origin=0):
    """Last position of chunk ``k`` (inclusive)."""
    return origin + k * cfg.hop + cfg.chunk_size - 1


def num_sealed(cfg, t, origin=0):
    """Sealed chunks of a head for a query at ``t``: they are chunks ``0 .. K-1``."""
    slack = t - cfg.window - chunk_last(cfg, 0, origin)
    return _at_least_zero(slack // cfg.hop + 1)


def raw_from(cfg, t, origin=0):
    """First position after the last sealed chunk (the origin when none is
    sealed): a query at ``t`` reads ``[raw_from, t]`` raw."""
    sealed = num_sealed(cfg, t, origin)
    return chunk_start(cfg, sealed, origin) + (cfg.chunk_size - cfg.hop) * (sealed > 0)


def completed_chunks(cfg, start: int, end: int, origin: int = 0) -> range:
    """Chunks whose last token lies in positions ``[start, end)``: what a
    step computing those positions pools and stores."""
    lo = max(0, -(-(start - origin - cfg.chunk_size + 1) // cfg.hop))
    hi = (end - origin - cfg.chunk_size) // cfg.hop + 1
    return range(lo, max(lo, hi))


def shifted(cfg, origin, shift):
    """A head's origin for a request whose grid is shifted by ``shift``
    (`ChunkedKVConfig.grid_shift`: per-request alignment): staggered heads keep
    their offsets from one another."""
    return (origin + shift) % cfg.hop


def possible_origins(cfg, origins: Sequence[int]) -> list[int]:
    """Every origin a head with one of `origins` may take in some request:
    all of ``[0, hop)`` with per-request alignment, else `origins`."""
    return list(range(cfg.hop)) if cfg.align != "none" else list(origins)


def forever_raw(cfg, origins: Sequence[int]) -> int:
    """Leading positions kept raw for the whole request: the sinks, and the
    positions before a head's grid origin."""
    return max(cfg.sink_tokens, max(origins, default=0))


def is_boundary(cfg, j, sealed, origin=0):
    """Whether position ``j`` is the first or the last token of one of the
    ``sealed`` chunks (kept raw with boundary retention)."""
    first = j - origin
    last = first - (cfg.chunk_size - 1)
    return (((first >= 0) & (first % cfg.hop == 0) & (first // cfg.hop < sealed))
            | ((last >= 0) & (last % cfg.hop == 0) & (last // cfg.hop < sealed)))


# ---------------------------------------------------------------- slots


def first_group(cfg, origin=0):
    """Slot group of chunk 0: chunk ``k`` lives in group ``k + first_group``,
    the group of the hop its last token falls in."""
    return (origin + cfg.chunk_size - 1) // cfg.hop


def slot_kind(cfg, slot):
    """`SlotKind` value of compressed slot ``slot``."""
    return slot % slots_per_group(cfg)


def slot_chunk(cfg, slot, origin=0):
    """Chunk stored in compressed slot ``slot`` (negative: a group below the
    head's first chunk, never visible)."""
    return slot // slots_per_group(cfg) - first_group(cfg, origin)


def visible_slots(cfg, t, origin=0):
    """Compressed slots ``[0, n)`` that may be visible to a query at ``t``:
    the groups of its sealed chunks."""
    return slots_per_group(cfg) * (num_sealed(cfg, t, origin) + first_group(cfg, origin))


# ---------------------------------------------------------------- a model's sliding window


def in_lookback(t, j, lookback: int):
    """Whether position ``j`` is read by a query at ``t`` in a layer with the
    model's own sliding window of ``lookback`` tokens (``t - j < lookback``;
    0: no window, every ``j``: True)."""
    return t - j < lookback if lookback else True


def chunk_in_lookback(cfg, k, t, lookback: int, origin=0):
    """Whether chunk ``k``'s rows are read by a query at ``t`` in such a layer:
    while the chunk's last token lies within the window. vLLM frees a
    sliding-window page once every token it covers has left the window, and
    a chunk's rows live in the page of its last token (`first_group`), so a
    row is never read after its page is freed."""
    return in_lookback(t, chunk_last(cfg, k, origin), lookback)


def slot_position(cfg, slot, origin=0):
    """The position by which compressed slot ``slot`` leaves a model sliding
    window: its own token for a kept first token (`SlotKind.FIRST`), else
    the last token of its chunk."""
    k = slot_chunk(cfg, slot, origin)
    return chunk_last(cfg, k, origin) - (slot_kind(cfg, slot) == SlotKind.FIRST) * (cfg.chunk_size - 1)


def first_lookback_slot(cfg, t: int, lookback: int, origin: int = 0) -> int:
    """First compressed slot a query at ``t`` may read in such a layer (0
    without a window): the group of the first chunk whose last token lies
    within the window. Python ints."""
    if not lookback:
        return 0
    k = max(0, (t - lookback - origin - cfg.chunk_size + 1) // cfg.hop + 1)  # chunk_last(k) > t - lookback
    return slots_per_group(cfg) * (k + first_group(cfg, origin))
