"""Dynamic chunk boundaries, once: where chunks end, and what each unit slot holds.

docs/design.md §12 in functions. With ``boundaries: dynamic`` the sequence
is cut in *frames* of ``chunk_size`` tokens (frame ``f`` is ``[f*C, (f+1)*C)``)
and *units* of ``min_chunk`` tokens (``u``). Each frame ends exactly one
chunk, after one of its units: the unit ``[c - u + 1, c]`` whose last key
``k[c]`` differs most from the next one, ``k[c + 1]`` (cosine distance; a
tie goes to the later cut, so keys that never change give the fixed grid).
Chunk ``f`` runs from the cut of frame ``f - 1`` (exclusive; -1 for frame 0)
to the cut of frame ``f``: whole units, ``u`` to ``2C - u`` tokens.

A frame's cut needs the keys of ``[f*C, (f+1)*C]``, so chunk ``f`` is
*decided* once position ``(f+1)*C`` is computed; it depends on no key outside
frames ``f - 1`` and ``f`` (and one more), which keeps a step's writes inside
the raw window and deterministic from the cached keys.

Storage is the fixed grid of units (`ChunkedKVConfig.storage_grid`): unit
``m``'s slot holds the mean-pooled row of the chunk that covers it, with the
logit bias ``log u``, and seals like a chunk of that grid. Once a whole
chunk of ``n`` tokens is sealed, its ``n / u`` equal rows weigh exactly as
one row with bias ``log n``: the attention of one dynamic chunk.

Every function takes the settings first (a `ChunkedKVConfig`, which checks
itself with `settings_problem`, so this module imports no config).
"""

from __future__ import annotations

import torch


def settings_problem(cfg) -> tuple[str, str] | None:
    """(field, detail) of the first setting dynamic boundaries cannot take, or
    None: a unit that divides the chunk, the plain grid (their own
    mitigation), mean pooling with proportional rows, and a window that
    outlasts a unit slot's lag at the default block size (`layout.check_block_size`)."""
    if cfg.boundaries == "fixed":
        return None if cfg.min_chunk is None else ("min_chunk", "only used with boundaries 'dynamic' (boundaries is 'fixed')")
    unit, size = cfg.min_chunk, cfg.chunk_size
    if unit is None:
        return "min_chunk", f"required with boundaries 'dynamic': a divisor of chunk_size {size} below it"
    if unit >= size or size % unit:
        return "min_chunk", f"must divide chunk_size {size} and be below it (got {unit})"
    plain = {"mitigation": (cfg.mitigation, "none"), "stagger": (cfg.stagger, "none"), "align": (cfg.align, "none"),
             "pooling": (cfg.pooling, "mean"), "proportional": (cfg.proportional, True)}
    for name, (value, allowed) in plain.items():
        if value != allowed:
            return name, f"boundaries 'dynamic' needs {name} {allowed!r} (got {value!r})"
    if cfg.window < 4 * size:
        return "window", f"boundaries 'dynamic' needs window >= 4 * chunk_size = {4 * size} (got {cfg.window})"
    return None


def decided_frames(cfg, seq_len):
    """Frames whose chunk is decided once positions ``[0, seq_len)`` are computed."""
    return (seq_len - 1) // cfg.chunk_size


def candidates(cfg) -> torch.Tensor:
    """Offsets in a frame after which its chunk may end: each unit's last token."""
    return torch.arange(cfg.min_chunk - 1, cfg.chunk_size, cfg.min_chunk)


def frame_cuts(cfg, frame_keys: torch.Tensor) -> torch.Tensor:
    """Offset in its frame of the last token of each frame's chunk.

    frame_keys ``[..., chunk_size + 1, D]``: a frame's keys and the next
    position's. Returns ``[...]`` long offsets (one of `candidates`)."""
    keys = frame_keys.float()
    cand = candidates(cfg).to(keys.device)
    here, after = keys[..., cand, :], keys[..., cand + 1, :]  # [..., n_cand, D] each
    distance = 1 - torch.nn.functional.cosine_similarity(here, after, dim=-1)  # [..., n_cand]
    last_best = distance.flip(-1).argmax(dim=-1)  # ties: the later cut
    return cand[cand.numel() - 1 - last_best]  # [...]


def chunk_cuts(cfg, keys: torch.Tensor) -> torch.Tensor:
    """Absolute position of the last token of every decided chunk of a
    sequence: keys ``[T, Hkv, D]`` -> ``[F, Hkv]`` long, increasing in F."""
    seq_len = keys.shape[0]
    frames = decided_frames(cfg, seq_len)
    starts = torch.arange(frames, device=keys.device) * cfg.chunk_size  # [F]
    positions = starts[:, None] + torch.arange(cfg.chunk_size + 1, device=keys.device)  # [F, C + 1]
    frame_keys = keys[positions].transpose(1, 2)  # [F, C + 1, Hkv, D] -> [F, Hkv, C + 1, D]
    return starts[:, None] + frame_cuts(cfg, frame_keys)  # [F, Hkv]


def max_chunk(cfg) -> int:
    """Longest chunk: from just after a frame's first unit to the next frame's end."""
    return 2 * cfg.chunk_size - cfg.min_chunk


def pool_span(keys: torch.Tensor, values: torch.Tensor, first: torch.Tensor, last: torch.Tensor,
              rows_from: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of the rows of positions ``[first, last]`` (fp32).

    keys ``[..., R, D]``, values ``[..., R, Dv]``: consecutive positions from
    ``rows_from [...]``; first, last ``[...]``. Returns ``[..., D]``, ``[..., Dv]``."""
    position = rows_from[..., None] + torch.arange(keys.shape[-2], device=keys.device)  # [..., R]
    inside = ((position >= first[..., None]) & (position <= last[..., None])).float()[..., None]  # [..., R, 1]
    count = (last - first + 1).float()[..., None]  # [..., 1]
    return (inside * keys.float()).sum(-2) / count, (inside * values.float()).sum(-2) / count


def unit_rows(keys: torch.Tensor, values: torch.Tensor, cfg
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each unit's row of a whole sequence: keys ``[T, Hkv, D]``, values
    ``[T, Hkv, Dv]`` -> fp32 ``(key rows [N, Hkv, D], value rows [N, Hkv, Dv],
    decided [N, Hkv])`` for the N units wholly inside the sequence; a unit of
    no decided chunk is not decided (its rows are zeros)."""
    seq_len, num_kv_heads, _ = keys.shape
    unit = cfg.min_chunk
    n = seq_len // unit
    cuts = chunk_cuts(cfg, keys)  # [F, Hkv]
    unit_start = torch.arange(n, device=keys.device)[:, None] * unit  # [N, 1]
    heads = torch.arange(num_kv_heads, device=keys.device)
    if not cuts.shape[0]:
        return (keys.new_zeros((n, num_kv_heads, keys.shape[-1]), dtype=torch.float32),
                values.new_zeros((n, num_kv_heads, values.shape[-1]), dtype=torch.float32),
                torch.zeros((n, num_kv_heads), dtype=torch.bool, device=keys.device))
    chunk = torch.searchsorted(cuts.T.contiguous(), unit_start.T.expand(num_kv_heads, n).contiguous()).T  # [N, Hkv]
    decided = chunk < cuts.shape[0]
    chunk = chunk.clamp(max=cuts.shape[0] - 1)
    last = cuts[chunk, heads]  # [N, Hkv]
    first = torch.where(chunk > 0, cuts[(chunk - 1).clamp(min=0), heads] + 1, 0)  # [N, Hkv]
    span = first[..., None] + torch.arange(max_chunk(cfg), device=keys.device)  # [N, Hkv, L]
    span = span.clamp(max=seq_len - 1)
    rows_k = keys[span, heads[:, None]]  # [N, Hkv, L, D]
    rows_v = values[span, heads[:, None]]  # [N, Hkv, L, Dv]
    key_rows, value_rows = pool_span(rows_k, rows_v, first, last, first)
    zero = ~decided[..., None]
    return key_rows.masked_fill(zero, 0), value_rows.masked_fill(zero, 0), decided
