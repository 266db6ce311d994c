"""Where CHUNKED_KV keeps each row: compressed pages and the raw window.

Every attention layer has two paged caches (docs/design.md §3-4, §10):

- **compressed pages** (the layer's own cache, a full-attention group whose
  spec declares ``tokens_per_state``): one *slot group* per ``hop`` tokens of
  the sequence, ``slots_per_group`` slots each (3 with boundary retention:
  pooled interior, first token, last token; else 1: the pooled row). Chunk
  ``k`` of a head with grid origin ``o`` ends at ``e = o + k*hop + chunk_size
  - 1`` and lives in group ``e // hop = k + first_group(o)``, i.e. in the page
  that holds its last token. A page is therefore final as soon as vLLM counts
  its tokens as computed, which is what prefix caching needs. Slot ``s`` of a
  request sits in block ``block_table[s // states_per_block]`` at offset
  ``s % states_per_block``. Groups below ``first_group(o)`` hold no chunk of
  that head and are written as zeros.
- **raw pages** (a companion layer, a sliding-window group of ``window +
  chunk_size - 1`` tokens): position ``j`` sits in block ``raw_table[j //
  raw_block_size]`` at offset ``j % raw_block_size``. The first
  ``forever_raw`` positions (sinks, and positions before a staggered grid
  origin) are never dropped.

Rows are written in the step in which a chunk's last token is computed;
attention reads sealed chunks from the compressed pages and everything else
from the raw pages. The functions here are the single source of those
paging sizes; the grid itself (seal rule, slot groups, slot kinds) is
`core/grid.py`, and `ops/step_plan.py` turns both into gather tensors.

Every function takes the settings as given and pages their
`ChunkedKVConfig.storage_grid`: with dynamic boundaries (`core/boundaries.py`),
a grid of one ``min_chunk``-token unit per chunk, whose slots sit
`dynamic_lag_pages` pages after their tokens (docs/design.md §12).
"""

from __future__ import annotations

from fractions import Fraction

from vllm_chunked_kv.core import grid
from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError


def spec_tokens_per_state(cfg: ChunkedKVConfig) -> int | Fraction:
    """`grid.tokens_per_state` as vLLM's spec field wants it: an int where it
    is one, so vLLM's integer-only checks apply."""
    value = grid.tokens_per_state(cfg.storage_grid())
    return int(value) if value.denominator == 1 else value


def block_multiple(cfg: ChunkedKVConfig) -> int:
    """A compressed page must hold whole slot groups: block sizes are multiples of hop."""
    return cfg.storage_grid().hop


DEFAULT_BLOCK_TOKENS = 32


def default_block_size(cfg: ChunkedKVConfig) -> int:
    """Block size used unless --block-size is given: the smallest multiple of
    hop from 32 tokens on. Raw pages hold as many rows as a compressed page
    holds states, and a request keeps about two windows of raw pages plus a
    page of rounding each, so small pages keep the raw overhead small. With
    dynamic boundaries: 2 * chunk_size, so that unit slots lag their tokens
    by one page (`dynamic_lag_pages`)."""
    if cfg.boundaries == "dynamic":
        return 2 * cfg.chunk_size
    return -(-DEFAULT_BLOCK_TOKENS // cfg.hop) * cfg.hop


def states_per_block(cfg: ChunkedKVConfig, block_size: int) -> int:
    """Rows in one compressed page of `block_size` tokens."""
    cfg = cfg.storage_grid()
    if block_size % block_multiple(cfg):
        raise ValueError(f"block size {block_size} is not a multiple of hop {cfg.hop}")
    return block_size // cfg.hop * grid.slots_per_group(cfg)


def raw_window(cfg: ChunkedKVConfig) -> int:
    """Sliding window of the raw pages, the smallest that works: a query at
    ``t`` reads raw rows from ``t - window - chunk_size + 2`` on (nothing sealed
    yet, overlapping chunks) or ``t - window - hop + 2`` (after a seal), and a
    chunk completing at ``t`` pools rows from ``t - chunk_size + 1``; vLLM keeps
    the newest ``sliding_window - 1`` computed tokens before a step."""
    return cfg.window + cfg.chunk_size - 1


def model_forever_raw(cfg: ChunkedKVConfig, num_kv_heads_total: int) -> int:
    """`grid.forever_raw` over every KV head of every layer (what one raw-page spec,
    shared by all layers, must keep), whatever a request's grid shift."""
    if isinstance(cfg.stagger, list):
        origins = [o for heads in cfg.stagger for o in heads]
    else:  # named staggers repeat with the layer index mod hop (or do not depend on it)
        origins = [o for layer in range(cfg.hop) for o in cfg.origins(layer, num_kv_heads_total)]
    return grid.forever_raw(cfg, grid.possible_origins(cfg, origins))


def dynamic_lag_pages(cfg: ChunkedKVConfig, block_size: int) -> int:
    """Dynamic boundaries: pages between a unit's tokens and its slot. A unit's
    chunk is decided at most ``2 * chunk_size`` positions after the unit
    starts (`core/boundaries.py`), so its slot goes in the page of the position
    this many whole pages on: written in the step that computes that
    position, and final once vLLM counts the page's tokens as computed (what
    prefix caching shares). 0 with fixed boundaries."""
    if cfg.boundaries == "fixed":
        return 0
    return -(-2 * cfg.chunk_size // block_size)


def check_block_size(cfg: ChunkedKVConfig, block_size: int) -> None:
    """Raise ChunkedKVConfigError if pages of `block_size` tokens do not suit
    the settings: whole slot groups per page, and with dynamic boundaries a
    window that outlasts the slot lag (a unit's slot must be written before
    the unit seals, from raw rows still in the window)."""
    multiple = block_multiple(cfg)
    if block_size % multiple:
        raise ChunkedKVConfigError(
            None, f"--block-size {block_size} must be a multiple of hop {multiple}: a compressed page holds "
            f"whole chunks (mitigation {cfg.mitigation!r}, chunk_size {cfg.chunk_size})")
    lag = dynamic_lag_pages(cfg, block_size) * block_size
    if lag and cfg.window < lag + 2 * cfg.chunk_size:
        raise ChunkedKVConfigError(
            "window", f"boundaries 'dynamic' with --block-size {block_size} needs window >= "
            f"{lag + 2 * cfg.chunk_size} (got {cfg.window}); block size {default_block_size(cfg)} needs "
            f"{4 * cfg.chunk_size}")
