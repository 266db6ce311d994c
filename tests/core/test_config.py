"""Contract of vllm_chunked_kv.core.config.ChunkedKVConfig.

- Every mitigation preset fills chunk_size, hop, keep_boundary and stagger as
  docs/design.md §4 and §10 say; "none" and "stagger" leave the grid settable.
- Every bad value and every explicit contradiction of a preset raises
  ChunkedKVConfigError whose message is one line, starts with
  ``chunked_kv.<field>:`` (or ``chunked_kv:`` for an unknown key) and names
  what is allowed.
- from_additional_config reads the "chunked_kv" key; None, {} and a missing
  key give the defaults; a chunked_kv field name at the top level (the
  wrapper forgotten) is an error naming the wrapper.
- Derived values (tokens_per_state, rows_per_chunk, normalised_gains,
  origins, describe) follow from the resolved fields.
"""

import json
import math
from fractions import Fraction

import pytest

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError


def _error(**kwargs) -> ChunkedKVConfigError:
    with pytest.raises(ChunkedKVConfigError) as info:
        ChunkedKVConfig(**kwargs)
    return info.value


@pytest.mark.parametrize(
    "settings, chunk_size, hop, keep_boundary, stagger",
    [
        ({}, 4, 4, False, "none"),
        ({"mitigation": "none", "chunk_size": 8}, 8, 8, False, "none"),
        ({"chunk_size": 8, "hop": 4}, 8, 4, False, "none"),
        ({"mitigation": "boundary"}, 4, 4, True, "none"),
        ({"mitigation": "boundary", "chunk_size": 6}, 6, 6, True, "none"),
        ({"mitigation": "overlap"}, 4, 2, False, "none"),
        ({"mitigation": "overlap", "chunk_size": 8}, 8, 4, False, "none"),
        ({"mitigation": "stride2"}, 2, 2, False, "none"),
        ({"mitigation": "stride2", "chunk_size": 2, "hop": 2}, 2, 2, False, "none"),
        ({"mitigation": "stagger"}, 4, 4, False, "heads"),
        ({"mitigation": "stagger", "stagger": [[0, 1]]}, 4, 4, False, [[0, 1]]),
        ({"mitigation": "overlap", "stagger": "heads"}, 4, 2, False, "heads"),
    ],
)
def test_presets_fill_fields(settings, chunk_size, hop, keep_boundary, stagger):
    cfg = ChunkedKVConfig(**settings)
    assert (cfg.chunk_size, cfg.hop, cfg.keep_boundary, cfg.stagger) == (chunk_size, hop, keep_boundary, stagger)


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"chunk_size": 0}, "chunk_size"),
        ({"chunk_size": -3}, "chunk_size"),
        ({"chunk_size": "4"}, "chunk_size"),
        ({"chunk_size": True}, "chunk_size"),
        ({"chunk_size": 4.5}, "chunk_size"),
        ({"hop": 0}, "hop"),
        ({"hop": 8}, "hop"),
        ({"chunk_size": 6, "hop": 4}, "hop"),
        ({"window": 0}, "window"),
        ({"window": 3}, "window"),
        ({"sink_tokens": -1}, "sink_tokens"),
        ({"pooling": "max"}, "pooling"),
        ({"pooling": "gated"}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [1.0, 1.0]}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [1.0, -1.0, 1.0, 1.0]}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [0.0, 0.0, 0.0, 0.0]}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [1.0, float("nan"), 1.0, 1.0]}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [1.0, 0.0, 0.0, 1.0], "mitigation": "boundary"}, "slot_gains"),
        ({"pooling": "mean", "slot_gains": [1.0, 1.0, 1.0, 1.0]}, "slot_gains"),
        ({"pooling": "gated", "slot_gains": [[1.0, 1.0, 1.0, 1.0], [1.0, 1.0]]}, "slot_gains[1]"),
        ({"pooling": "gated", "slot_gains": [[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]}, "slot_gains[1]"),
        ({"pooling": "gated", "slot_gains": [[-1.0, 1.0, 1.0, 1.0]]}, "slot_gains[0]"),
        ({"pooling": "gated", "slot_gains": [[1.0, 1.0, 1.0, 1.0], 1.0]}, "slot_gains"),
        ({"pooling": "mean", "slot_gains": [[1.0, 1.0, 1.0, 1.0]]}, "slot_gains"),
        ({"proportional": "yes"}, "proportional"),
        ({"mitigation": "half"}, "mitigation"),
        ({"mitigation": "stride2", "chunk_size": 4}, "chunk_size"),
        ({"mitigation": "stride2", "hop": 1}, "hop"),
        ({"mitigation": "stride2", "keep_boundary": True}, "keep_boundary"),
        ({"mitigation": "boundary", "keep_boundary": False}, "keep_boundary"),
        ({"mitigation": "boundary", "hop": 2}, "hop"),
        ({"mitigation": "boundary", "chunk_size": 2}, "keep_boundary"),
        ({"mitigation": "overlap", "hop": 4}, "hop"),
        ({"mitigation": "overlap", "chunk_size": 6, "hop": 2}, "hop"),
        ({"mitigation": "overlap", "chunk_size": 5}, "chunk_size"),
        ({"mitigation": "overlap", "keep_boundary": True}, "keep_boundary"),
        ({"mitigation": "stagger", "stagger": "none"}, "stagger"),
        ({"keep_boundary": True, "chunk_size": 8, "hop": 4}, "keep_boundary"),
        ({"stagger": "diagonal"}, "stagger"),
        ({"stagger": []}, "stagger"),
        ({"stagger": [[0, 1], []]}, "stagger"),
        ({"stagger": [[0, 4]]}, "stagger[0]"),
        ({"stagger": [[0, 1], [-1, 0]]}, "stagger[1]"),
        ({"stagger": "heads", "stagger_groups": 3}, "stagger_groups"),
        ({"stagger": "layers", "stagger_groups": 3}, "stagger_groups"),
        ({"stagger": "heads", "stagger_groups": 0}, "stagger_groups"),
        ({"stagger": "heads", "chunk_size": 1, "window": 4}, "stagger_groups"),
        ({"stagger_groups": 4}, "stagger_groups"),
        ({"align": "prompt_start"}, "align"),
        ({"align": True}, "align"),
        ({"boundaries": "sliding"}, "boundaries"),
        ({"boundaries": "dynamic", "window": 16}, "min_chunk"),
        ({"min_chunk": 2}, "min_chunk"),
        ({"boundaries": "dynamic", "min_chunk": 1, "window": 16}, "min_chunk"),
        ({"boundaries": "dynamic", "min_chunk": 3, "window": 16}, "min_chunk"),
        ({"boundaries": "dynamic", "min_chunk": 4, "window": 16}, "min_chunk"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 15}, "window"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 16, "mitigation": "stagger"}, "mitigation"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 16, "align": "prompt_end"}, "align"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 16, "pooling": "key_norm"}, "pooling"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 16, "proportional": False}, "proportional"),
        ({"sliding_window_layers": "all"}, "sliding_window_layers"),
        ({"boundaries": "dynamic", "min_chunk": 2, "window": 16, "sliding_window_layers": "compress"},
         "sliding_window_layers"),
    ],
)
def test_bad_values_name_the_field_in_one_line(settings, field):
    error = _error(**settings)
    message = str(error)
    assert error.field == field
    assert message.startswith(f"chunked_kv.{field}: ")
    assert "\n" not in message
    assert "validation error" not in message.lower()


def test_unknown_key_lists_the_allowed_keys():
    message = str(_error(chunk_sise=4))
    assert message.startswith("chunked_kv: unknown key 'chunk_sise' (allowed: ")
    for name in ("chunk_size", "hop", "window", "sink_tokens", "mitigation", "stagger"):
        assert name in message
    assert "\n" not in message


def test_bad_choice_lists_the_choices():
    message = str(_error(mitigation="x"))
    assert message == "chunked_kv.mitigation: must be one of none, boundary, overlap, stride2, stagger (got 'x')"
    assert str(_error(chunk_size=0)) == "chunked_kv.chunk_size: must be >= 1 (got 0)"
    assert str(_error(align="end")) == "chunked_kv.align: must be one of none, prompt_end (got 'end')"


@pytest.mark.parametrize("align, hop, shifts", [("none", 4, [0, 0, 0, 0, 0]), ("prompt_end", 4, [1, 2, 3, 0, 1]),
                                                ("prompt_end", 2, [1, 0, 1, 0, 1])])
def test_grid_shift_is_the_prompt_length_mod_hop_with_align(align, hop, shifts):
    """A request's grid shift puts the prompt's last token at the end of a chunk."""
    cfg = ChunkedKVConfig(align=align, chunk_size=4, hop=hop)
    assert [cfg.grid_shift(n) for n in (5, 6, 7, 8, 9)] == shifts


def test_dynamic_boundaries_store_the_grid_of_units():
    """Pages, plans and kernels see a fixed grid of min_chunk-token units."""
    cfg = ChunkedKVConfig(boundaries="dynamic", chunk_size=4, min_chunk=2, window=16, sink_tokens=3)
    unit = cfg.storage_grid()
    assert (unit.chunk_size, unit.hop, unit.window, unit.sink_tokens, unit.boundaries) == (2, 2, 16, 3, "fixed")
    assert cfg.tokens_per_state == 2 and cfg.rows_per_chunk == 2
    assert ChunkedKVConfig().storage_grid() == ChunkedKVConfig()


def test_error_is_a_value_error_and_config_is_frozen():
    assert issubclass(ChunkedKVConfigError, ValueError)
    cfg = ChunkedKVConfig()
    with pytest.raises(Exception):
        cfg.chunk_size = 8


@pytest.mark.parametrize("additional_config", [None, {}, {"other_plugin": {"x": 1}}, {"chunked_kv": None}])
def test_from_additional_config_defaults(additional_config):
    assert ChunkedKVConfig.from_additional_config(additional_config) == ChunkedKVConfig()


def test_from_additional_config_reads_the_section():
    cfg = ChunkedKVConfig.from_additional_config(json.loads('{"chunked_kv": {"mitigation": "overlap", "window": 64}}'))
    assert (cfg.hop, cfg.window, cfg.mitigation) == (2, 64, "overlap")


@pytest.mark.parametrize(
    "additional_config, prefix",
    [
        ({"chunked_kv": {"foo": 1}}, "chunked_kv: unknown key 'foo'"),
        ({"chunked_kv": {"chunk_size": 0}}, "chunked_kv.chunk_size: "),
        ({"chunked_kv": [1, 2]}, "chunked_kv: must be a JSON object"),
        ({"chunked_kv": {"hop": 5}}, "chunked_kv.hop: "),
        ({"chunk_size": 5}, "chunked_kv: 'chunk_size' is at the top level of --additional-config; it belongs under"),
        ({"window": 64, "chunked_kv": {}}, "chunked_kv: 'window' is at the top level"),
    ],
)
def test_from_additional_config_errors(additional_config, prefix):
    with pytest.raises(ChunkedKVConfigError) as info:
        ChunkedKVConfig.from_additional_config(additional_config)
    assert str(info.value).startswith(prefix)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    "settings, tokens_per_state, rows_per_chunk",
    [
        ({}, Fraction(4), 1),
        ({"mitigation": "boundary"}, Fraction(4, 3), 3),
        ({"mitigation": "overlap"}, Fraction(2), 2),
        ({"mitigation": "overlap", "chunk_size": 8}, Fraction(4), 2),
        ({"mitigation": "stride2"}, Fraction(2), 1),
        ({"mitigation": "stagger"}, Fraction(4), 1),
    ],
)
def test_storage_ratios(settings, tokens_per_state, rows_per_chunk):
    cfg = ChunkedKVConfig(**settings)
    assert cfg.tokens_per_state == tokens_per_state
    assert cfg.rows_per_chunk == rows_per_chunk


def test_normalised_gains_and_log_weight():
    gated = ChunkedKVConfig(pooling="gated", slot_gains=[1.0, 2.0, 3.0, 2.0])
    assert gated.normalised_gains() == pytest.approx([0.125, 0.25, 0.375, 0.25])
    assert gated.log_weight == pytest.approx(math.log(4))
    interior = ChunkedKVConfig(pooling="gated", slot_gains=[5.0, 1.0, 3.0, 5.0], mitigation="boundary")
    assert interior.normalised_gains() == pytest.approx([0.0, 0.25, 0.75, 0.0])
    assert interior.log_weight == pytest.approx(math.log(2))
    assert ChunkedKVConfig(chunk_size=8).normalised_gains() == pytest.approx([1 / 8] * 8)
    assert ChunkedKVConfig(proportional=False).log_weight == 0.0
    with pytest.raises(ValueError):
        ChunkedKVConfig(pooling="key_norm").normalised_gains()


def test_per_layer_gains():
    """One list of slot gains per layer: each layer's settings (`for_layer`) pool
    with its own; the model-wide view has no single set; the count must match
    the model's layers."""
    cfg = ChunkedKVConfig(pooling="gated", slot_gains=[[1.0, 1.0, 1.0, 1.0], [0.0, 2.0, 2.0, 0.0]], stagger="layers")
    assert cfg.per_layer_gains and not ChunkedKVConfig(pooling="gated", slot_gains=[1.0, 0, 0, 0]).per_layer_gains
    assert cfg.for_layer(0).normalised_gains() == pytest.approx([0.25] * 4)
    assert cfg.for_layer(1).normalised_gains() == pytest.approx([0.0, 0.5, 0.5, 0.0])
    assert cfg.for_layer(1).model_dump(exclude={"slot_gains"}) == cfg.model_dump(exclude={"slot_gains"})
    assert ChunkedKVConfig().for_layer(7) == ChunkedKVConfig()
    with pytest.raises(ValueError, match="for_layer"):
        cfg.normalised_gains()
    with pytest.raises(ChunkedKVConfigError, match=r"^chunked_kv\.slot_gains: has no gains for layer 2"):
        cfg.for_layer(2)
    cfg.check_model(2, 3)
    cfg.check_model(1, 3, exact_layers=False)
    for layers in (1, 3):
        with pytest.raises(ChunkedKVConfigError, match=r"^chunked_kv\.slot_gains: needs one list per layer"):
            cfg.check_model(layers, 3)
    json.dumps(cfg.describe())


def test_origins():
    assert ChunkedKVConfig().origins(0, 3) == [0, 0, 0]
    heads = ChunkedKVConfig(mitigation="stagger")
    assert heads.origins(0, 4) == [0, 2, 0, 2]
    assert heads.origins(5, 4) == [0, 2, 0, 2]
    four = ChunkedKVConfig(chunk_size=8, stagger="heads", stagger_groups=4)
    assert four.origins(0, 6) == [0, 2, 4, 6, 0, 2]
    overlap = ChunkedKVConfig(mitigation="overlap", chunk_size=8, stagger="heads")
    assert overlap.origins(0, 2) == [0, 2]
    layers = ChunkedKVConfig(stagger="layers")  # the 'heads' origins moved on by the layer index, mod hop
    assert [layers.origins(layer, 3) for layer in range(5)] == [[0, 2, 0], [1, 3, 1], [2, 0, 2], [3, 1, 3], [0, 2, 0]]
    eight = ChunkedKVConfig(chunk_size=8, stagger="layers", stagger_groups=4)
    assert eight.origins(7, 4) == [7, 1, 3, 5]
    explicit = ChunkedKVConfig(stagger=[[0, 2], [1, 3]])
    assert explicit.origins(1, 2) == [1, 3]
    explicit.check_model(2, 2)
    with pytest.raises(ChunkedKVConfigError, match=r"^chunked_kv\.stagger: "):
        explicit.check_model(3, 2)
    with pytest.raises(ChunkedKVConfigError, match=r"^chunked_kv\.stagger\[0\]: "):
        explicit.origins(0, 4)


def test_describe_is_json_and_round_trips():
    cfg = ChunkedKVConfig(mitigation="boundary", pooling="gated", slot_gains=[1.0, 2.0, 2.0, 1.0])
    described = json.loads(json.dumps(cfg.describe()))
    assert described["tokens_per_state"] == "4/3"
    assert described["keep_boundary"] is True
    assert ChunkedKVConfig(**cfg.model_dump()) == cfg
    assert ChunkedKVConfig.model_validate(cfg) is cfg
    assert all(field.description for field in ChunkedKVConfig.model_fields.values())


def test_gated_gains_come_from_the_model_directory(tmp_path):
    """pooling=gated without slot_gains reads the gains shipped with the model."""
    from types import SimpleNamespace

    (tmp_path / "chunked_kv_gains.json").write_text('{"pooling": "gated", "slot_gains": [0.1, 0.6, 0.3, 0.0]}')
    vllm_config = SimpleNamespace(additional_config={"chunked_kv": {"pooling": "gated"}},
                                  model_config=SimpleNamespace(model=str(tmp_path)))
    cfg = ChunkedKVConfig.from_vllm_config(vllm_config)
    assert cfg.slot_gains == [0.1, 0.6, 0.3, 0.0]
    explicit = SimpleNamespace(additional_config={"chunked_kv": {"pooling": "gated", "slot_gains": [1.0, 0, 0, 0]}},
                               model_config=SimpleNamespace(model=str(tmp_path)))
    assert ChunkedKVConfig.from_vllm_config(explicit).slot_gains == [1.0, 0, 0, 0]
    elsewhere = SimpleNamespace(additional_config={"chunked_kv": {"pooling": "gated"}},
                                model_config=SimpleNamespace(model=str(tmp_path / "missing")))
    with pytest.raises(ChunkedKVConfigError, match="slot_gains"):
        ChunkedKVConfig.from_vllm_config(elsewhere)
