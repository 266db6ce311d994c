"""ChunkedKVConfig: every setting of docs/design.md §3-4 and §10 in one pydantic model.

Settings arrive as ``--additional-config '{"chunked_kv": {...}}'``; read them
with :meth:`ChunkedKVConfig.from_additional_config`. A bad value raises
:class:`ChunkedKVConfigError`, whose message is one line naming the field and
what is allowed, e.g. ``chunked_kv.chunk_size: must be >= 1 (got 0)``.

Presets (``mitigation``) fill ``chunk_size``, ``hop``, ``keep_boundary`` and
``stagger``; an explicit value contradicting the chosen preset is an error.
``none`` and ``stagger`` only fill what was left unset (``hop = chunk_size``,
no boundary retention), so the grid stays settable field by field.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from fractions import Fraction
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vllm_chunked_kv.core import boundaries
from vllm_chunked_kv.core.config_errors import ADDITIONAL_CONFIG_KEY, ChunkedKVConfigError, fail
from vllm_chunked_kv.core.presets import PRESETS, PresetError, preset_values

__all__ = ["ADDITIONAL_CONFIG_KEY", "GAINS_FILE", "ChunkedKVConfig", "ChunkedKVConfigError", "fail", "gain_rows"]
GAINS_FILE = "chunked_kv_gains.json"  # learned per-slot gains shipped in a model directory


class _ChunkedKVFields(BaseModel):
    """The fields and their single-field checks, before presets are applied."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, use_attribute_docstrings=True)

    chunk_size: int = Field(default=4, ge=1)
    """Tokens pooled into one compressed row."""

    hop: int | None = Field(default=None, ge=1)
    """Distance between the starts of consecutive chunks; divides chunk_size.
    None: filled by the mitigation preset (chunk_size unless overlapping)."""

    window: int = Field(default=128, ge=1)
    """Raw recent tokens every query sees exactly; at least chunk_size."""

    sink_tokens: int = Field(default=0, ge=0)
    """First tokens of the sequence kept raw forever (0 allowed)."""

    pooling: Literal["mean", "gated", "key_norm"] = "mean"
    """How a sealed chunk's rows are pooled: uniform weights, fixed per-slot
    gains (slot_gains), or the softmax of the keys' L2 norms."""

    slot_gains: list[float] | list[list[float]] | None = None
    """Per-slot gains for pooling 'gated' (required then, forbidden otherwise):
    chunk_size non-negative finite numbers with a positive sum, normalised; or
    one such list per layer (each layer pools with its own, `for_layer`)."""

    proportional: bool = True
    """Add log(n) to the logit of a compressed row standing for n tokens."""

    keep_boundary: bool | None = None
    """Keep the first and last token of each sealed chunk raw and pool the
    interior only (needs chunk_size >= 3 and hop == chunk_size).
    None: filled by the mitigation preset."""

    mitigation: Literal[tuple(PRESETS)] = "none"  # type: ignore[valid-type]
    """Preset (`presets.PRESETS`): none (hop = chunk_size), boundary
    (keep_boundary), overlap (hop = chunk_size / 2), stride2 (chunk_size =
    hop = 2), stagger (stagger = 'heads')."""

    stagger: Literal["none", "heads", "layers"] | list[list[int]] = "none"
    """Per-KV-head grid origins (docs/design.md §10), n = stagger_groups: 'none'
    (all 0), 'heads' (KV head h, counted globally, at (h mod n) * hop / n),
    'layers' (head h of layer l at (l + (h mod n) * hop / n) mod hop; l counts
    every layer, so a hybrid's compressed layers may share grids: Gemma 3's
    global layers 5, 11 and 17 get 1, 3 and 1), or a per-layer list of
    per-KV-head origins, each in [0, hop)."""

    stagger_groups: int = Field(default=2, ge=1)
    """Number of distinct origins for stagger 'heads' or 'layers'; must divide hop."""

    align: Literal["none", "prompt_end"] = "none"
    """Per-request grid alignment (docs/design.md §10): 'none' (every request's
    grid starts at position 0) or 'prompt_end' (each request's grid is shifted
    by its prompt length mod hop, so every prompt ends on the last token of a
    chunk, whatever its length; the shifted-over positions stay raw). Costs
    no tokens and no memory; prefix caching then shares pages only between
    requests of the same prompt length mod hop."""

    boundaries: Literal["fixed", "dynamic"] = "fixed"
    """Where chunks end (docs/design.md §12): 'fixed' (on the grid) or
    'dynamic' (each chunk_size-token frame ends one chunk, after the
    min_chunk-token unit where adjacent keys differ most; chunks then run
    from min_chunk to 2 * chunk_size - min_chunk tokens, chunk_size on
    average). Dynamic boundaries store each chunk's pooled row once per
    unit it covers: pages hold chunk_size / min_chunk times the rows of
    'none'."""

    min_chunk: int | None = Field(default=None, ge=2)
    """Unit of dynamic boundaries (chunks are whole units): divides chunk_size,
    below it; required with 'dynamic' (e.g. chunk_size / 2), else not allowed."""

    sliding_window_layers: Literal["window", "compress"] = "window"
    """Layers with the model's own sliding window (Gemma's local layers, every
    layer of a Mistral-style model; docs/design.md §13): 'window' (they keep
    exactly their window on vLLM's default backend, uncompressed) or
    'compress' (they are compressed like the others, each query reading the
    raw rows and the chunks whose last token lie within the layer's window;
    vLLM frees their pages behind it). A model whose every layer slides
    needs 'compress'. Fixed boundaries only."""

    prefix_spare_pages: bool = True
    """With vLLM's prefix caching on, a step keeps every raw row it computes
    as prefix-cache pages while at least half of the KV pool stays free (not
    reserved; docs/prefix-caching.md). False: only the reserved raw tails,
    as vLLM keeps for its own sliding-window layers."""

    @field_validator("slot_gains", mode="before")
    @classmethod
    def _check_gains_shape(cls, gains: Any) -> Any:
        if isinstance(gains, list) and gains and len({isinstance(g, list) for g in gains}) > 1:
            raise ValueError(f"must be a list of numbers or a list of per-layer lists of numbers (got {gains!r})")
        return gains

    @field_validator("stagger", mode="before")
    @classmethod
    def _check_stagger_shape(cls, value: Any) -> Any:
        if isinstance(value, str) and value in ("none", "heads", "layers"):
            return value
        shape_ok = isinstance(value, list) and len(value) > 0 and all(
            isinstance(layer, list) and len(layer) > 0
            and all(isinstance(o, int) and not isinstance(o, bool) for o in layer)
            for layer in value
        )
        if not shape_ok:
            raise ValueError(
                "must be 'none', 'heads', 'layers' or a non-empty list of per-layer, non-empty lists "
                f"of integer origins (got {value!r})"
            )
        return value


class ChunkedKVConfig(_ChunkedKVFields):
    """Chunked KV-cache compression settings (docs/design.md §2-4, §10) with the
    preset applied: after validation ``hop`` and ``keep_boundary`` are never None."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, ChunkedKVConfig):
            return data
        try:
            parsed = _ChunkedKVFields.model_validate(data)  # types and bounds only
        except ValidationError as exc:
            error = ChunkedKVConfigError.from_validation_error(exc, tuple(_ChunkedKVFields.model_fields))
            raise fail(error.field, error.detail) from None
        return {**parsed.model_dump(exclude_unset=True), **_preset_values(parsed)}

    @model_validator(mode="after")
    def _check(self) -> ChunkedKVConfig:
        _check_cross_fields(self)
        return self

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            raise ChunkedKVConfigError.from_validation_error(exc, tuple(type(self).model_fields)) from None

    @classmethod
    def from_additional_config(cls, additional_config: Mapping[str, Any] | None) -> ChunkedKVConfig:
        """The config under the "chunked_kv" key of vLLM's additional_config
        (no key, or None: all defaults)."""
        if additional_config is None:
            additional_config = {}
        if not isinstance(additional_config, Mapping):
            raise ChunkedKVConfigError(None, f"additional_config must be a JSON object (got {additional_config!r})")
        section = additional_config.get(ADDITIONAL_CONFIG_KEY)
        stray = [key for key in additional_config if key in cls.model_fields]
        if stray:  # {"chunk_size": 5} instead of {"chunked_kv": {"chunk_size": 5}}: never run the defaults silently
            raise ChunkedKVConfigError(
                None, f"{stray[0]!r} is at the top level of --additional-config; it belongs under "
                f'"{ADDITIONAL_CONFIG_KEY}": {{"{ADDITIONAL_CONFIG_KEY}": {{"{stray[0]}": ...}}}}'
            )
        if section is None:
            return cls()
        if not isinstance(section, Mapping):
            raise ChunkedKVConfigError(None, f"must be a JSON object (got {section!r})")
        bad_keys = [key for key in section if not isinstance(key, str)]
        if bad_keys:
            raise ChunkedKVConfigError(None, f"keys must be strings (got {bad_keys[0]!r})")
        return cls(**section)

    @classmethod
    def from_vllm_config(cls, vllm_config) -> ChunkedKVConfig:
        """`from_additional_config` of a VllmConfig, plus gains shipped with the
        model: with `pooling="gated"` and no `slot_gains`, the `slot_gains` of
        the model directory's `chunked_kv_gains.json` are used."""
        additional = vllm_config.additional_config
        section = (additional or {}).get(ADDITIONAL_CONFIG_KEY) if isinstance(additional, Mapping) else None
        if isinstance(section, Mapping) and section.get("pooling") == "gated" and "slot_gains" not in section:
            model = getattr(getattr(vllm_config, "model_config", None), "model", None)
            gains = Path(str(model)) / GAINS_FILE if model else None
            if gains is not None and gains.is_file():
                try:
                    slot_gains = json.loads(gains.read_text())["slot_gains"]
                except (ValueError, KeyError) as exc:
                    raise ChunkedKVConfigError("slot_gains", f"cannot read {gains}: {exc}") from None
                return cls.from_additional_config({ADDITIONAL_CONFIG_KEY: {**section, "slot_gains": slot_gains}})
        return cls.from_additional_config(additional)

    # ------------------------------------------------------------ derived values

    @property
    def pooled_slots(self) -> range:
        """Slots of a chunk pooled into its row (the interior with keep_boundary)."""
        return range(1, self.chunk_size - 1) if self.keep_boundary else range(self.chunk_size)

    @property
    def log_weight(self) -> float:
        """Logit bias of a pooled row: log(pooled tokens) if proportional, else 0."""
        return math.log(len(self.pooled_slots)) if self.proportional else 0.0

    @property
    def tokens_per_state(self) -> Fraction:
        """Tokens of the compressed region per stored state (`grid.tokens_per_state`
        of the `storage_grid`)."""
        from vllm_chunked_kv.core import grid

        return grid.tokens_per_state(self.storage_grid())

    def storage_grid(self) -> ChunkedKVConfig:
        """The fixed grid of the pages, plans and kernels: these settings, or with
        dynamic boundaries one min_chunk-token unit per chunk (`core/boundaries.py`)."""
        if self.boundaries == "fixed":
            return self
        return ChunkedKVConfig(chunk_size=self.min_chunk, window=self.window, sink_tokens=self.sink_tokens,
                               prefix_spare_pages=self.prefix_spare_pages)

    @property
    def rows_per_chunk(self) -> Fraction:
        """Stored rows per chunk_size tokens (of this config) of the compressed
        region: 1 (none, stride2), 3 (boundary), chunk_size / hop (overlap)."""
        return self.chunk_size / self.tokens_per_state

    @property
    def per_layer_gains(self) -> bool:
        """Whether slot_gains holds one list per layer."""
        return _per_layer(self.slot_gains)

    def for_layer(self, layer_idx: int) -> ChunkedKVConfig:
        """The settings layer `layer_idx` pools with: with per-layer slot_gains,
        these settings with that layer's gains; otherwise these settings."""
        if not self.per_layer_gains:
            return self
        if not 0 <= layer_idx < len(self.slot_gains):
            raise ChunkedKVConfigError("slot_gains", f"has no gains for layer {layer_idx} ({len(self.slot_gains)} lists)")
        return self.model_copy(update={"slot_gains": list(self.slot_gains[layer_idx])})

    def normalised_gains(self) -> list[float]:
        """Fixed pooling weight of each of the chunk_size slots, summing to 1
        over the pooled slots (0 on kept boundary slots). Not defined for
        key_norm, whose weights depend on the keys, nor for per-layer gains
        (take `for_layer` first)."""
        if self.pooling == "key_norm":
            raise ValueError("key_norm pooling has no fixed slot weights")
        if self.per_layer_gains:
            raise ValueError("per-layer slot_gains: take the layer's settings (for_layer) first")
        slots = self.pooled_slots
        raw = self.slot_gains if self.pooling == "gated" else [1.0] * self.chunk_size
        total = sum(raw[i] for i in slots)
        return [raw[i] / total if i in slots else 0.0 for i in range(self.chunk_size)]

    def origins(self, layer_idx: int, num_kv_heads_total: int) -> list[int]:
        """Grid origin of each KV head (global index) of one layer."""
        if not isinstance(self.stagger, list):  # 'none', 'heads' or 'layers'
            step = 0 if self.stagger == "none" else self.hop // self.stagger_groups
            shift = layer_idx if self.stagger == "layers" else 0
            return [(shift + (h % self.stagger_groups) * step) % self.hop for h in range(num_kv_heads_total)]
        self.check_model(layer_idx + 1, num_kv_heads_total, exact_layers=False)
        return list(self.stagger[layer_idx])

    def grid_shift(self, prompt_len: int) -> int:
        """How far a request's grid moves for `align` (`grid.shifted`): its prompt
        length mod hop with 'prompt_end', else 0."""
        return prompt_len % self.hop if self.align == "prompt_end" else 0

    def check_model(self, num_layers: int, num_kv_heads_total: int, *, exact_layers: bool = True) -> None:
        """Raise ChunkedKVConfigError if an explicit stagger list or per-layer
        slot_gains do not fit the model."""
        per_layer = {"slot_gains": self.slot_gains if self.per_layer_gains else None,
                     "stagger": self.stagger if isinstance(self.stagger, list) else None}
        for name, lists in per_layer.items():
            if lists is not None and (len(lists) < num_layers or (exact_layers and len(lists) != num_layers)):
                raise ChunkedKVConfigError(name, f"needs one list per layer: the model has {num_layers} (got {len(lists)})")
        if not isinstance(self.stagger, list):
            return
        for layer, heads in enumerate(self.stagger[:num_layers]):
            if len(heads) != num_kv_heads_total:
                raise ChunkedKVConfigError(
                    f"stagger[{layer}]",
                    f"needs one origin per KV head: the model has {num_kv_heads_total} (got {len(heads)})",
                )

    def describe(self) -> dict[str, Any]:
        """JSON-serialisable view of the resolved settings and derived values."""
        out = self.model_dump()
        out["tokens_per_state"] = str(self.tokens_per_state)
        out["rows_per_chunk"] = str(self.rows_per_chunk)
        out["log_weight"] = self.log_weight
        return out


# -------------------------------------------------------------------- validation


def _preset_values(cfg: _ChunkedKVFields) -> dict[str, Any]:
    """Values the mitigation preset fills in; raise on explicit contradictions."""
    explicit = {name: getattr(cfg, name) for name in cfg.model_fields_set if getattr(cfg, name) is not None}
    try:
        return preset_values(cfg.mitigation, cfg.chunk_size, explicit)
    except PresetError as exc:
        raise fail(exc.field, exc.detail) from None


def _check_cross_fields(cfg: ChunkedKVConfig) -> None:
    """Checks that need several resolved fields."""
    chunk_size, hop = cfg.chunk_size, cfg.hop
    if hop > chunk_size:
        raise fail("hop", f"must be <= chunk_size {chunk_size} (got {hop})")
    if chunk_size % hop:
        raise fail("hop", f"must divide chunk_size {chunk_size} (got {hop})")
    if cfg.window < chunk_size:
        raise fail("window", f"must be >= chunk_size {chunk_size} (got {cfg.window})")
    if cfg.keep_boundary:
        if chunk_size < 3:
            raise fail("keep_boundary", f"needs chunk_size >= 3 so a chunk has an interior (got {chunk_size})")
        if hop != chunk_size:
            raise fail("keep_boundary", f"needs hop == chunk_size {chunk_size} (got hop {hop})")
    if cfg.pooling == "gated":
        if cfg.slot_gains is None:
            raise fail("slot_gains", f"required for pooling 'gated': a list of {chunk_size} gains")
        for name, gains in gain_rows(cfg.slot_gains).items():
            if not all(math.isfinite(g) and g >= 0 for g in gains) or sum(gains) <= 0:
                raise fail(name, f"must be non-negative finite numbers with a positive sum (got {gains!r})")
            if len(gains) != chunk_size:
                raise fail(name, f"needs exactly chunk_size = {chunk_size} gains (got {len(gains)})")
            if sum(gains[i] for i in cfg.pooled_slots) <= 0:
                raise fail(name, f"the pooled (interior) slots need a positive sum (got {gains})")
    elif cfg.slot_gains is not None:
        raise fail("slot_gains", f"only allowed with pooling 'gated' (pooling is {cfg.pooling!r})")
    problem = boundaries.settings_problem(cfg)
    if problem:
        raise fail(*problem)
    if cfg.sliding_window_layers == "compress" and cfg.boundaries == "dynamic":
        raise fail("sliding_window_layers", "'compress' needs fixed boundaries (boundaries is 'dynamic')")
    if cfg.stagger in ("heads", "layers"):
        if hop % cfg.stagger_groups:
            raise fail("stagger_groups", f"must divide hop {hop} for stagger {cfg.stagger!r} (got {cfg.stagger_groups})")
    elif cfg.stagger_groups != _ChunkedKVFields.model_fields["stagger_groups"].default:
        raise fail("stagger_groups", f"only used with stagger 'heads' or 'layers' (stagger is {cfg.stagger!r})")
    if isinstance(cfg.stagger, list):
        for layer, heads in enumerate(cfg.stagger):
            bad = [o for o in heads if not 0 <= o < hop]
            if bad:
                raise fail(f"stagger[{layer}]", f"origins must be in [0, hop) = [0, {hop}) (got {bad[0]})")



def gain_rows(gains: list | None) -> dict[str, list[float]]:
    """Each list of slot gains by the name of its field: one (`slot_gains`), or
    one per layer (`slot_gains[i]`)."""
    if not _per_layer(gains):
        return {} if gains is None else {"slot_gains": gains}
    return {f"slot_gains[{layer}]": row for layer, row in enumerate(gains)}


def _per_layer(gains: list | None) -> bool:
    """Whether a slot_gains value holds one list per layer."""
    return bool(gains) and isinstance(gains[0], list)
