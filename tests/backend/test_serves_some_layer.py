"""Contract of `backend.serves_some_layer`, the one predicate behind every
startup check, the serve file and the alignment salt: CHUNKED_KV serves a
layer of the model when `--attention-backend` names it or a
`backend_per_kind` entry does for a kind of layer the model has (a per-kind
entry wins for its kind, as in vLLM's selector); a Mistral-style model
(every layer slides) has only sliding-window layers, a Gemma-style one both
kinds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_chunked_kv.backend import BACKEND_NAME, model_kinds, serves_some_layer

OURS, OTHER = SimpleNamespace(name=BACKEND_NAME), SimpleNamespace(name="CPU_ATTN")


def _config(backend=None, per_kind=None, layer_types=None, window=None, model=True):
    text = SimpleNamespace(layer_types=layer_types)
    return SimpleNamespace(
        attention_config=SimpleNamespace(backend=backend, backend_per_kind=per_kind or {}),
        model_config=SimpleNamespace(hf_text_config=text, use_mla=False) if model else None,
        cache_config=SimpleNamespace(sliding_window=window),
    )


GEMMA = ["sliding_attention"] * 5 + ["full_attention"]


@pytest.mark.parametrize("config, served", [
    (_config(), False),
    (_config(backend=OURS), True),
    (_config(backend=OTHER), False),
    (_config(per_kind={"full_attention": OURS}), True),
    (_config(backend=OURS, per_kind={"full_attention": OTHER}), False),  # the entry wins for its kind
    (_config(per_kind={"sliding_window": OURS}), False),  # a kind the model does not have
    (_config(per_kind={"full_attention": OURS}, window=4096), False),  # Mistral-style: only sliding layers
    (_config(backend=OURS, window=4096), True),
    (_config(per_kind={"full_attention": OURS}, layer_types=GEMMA), True),
    (_config(per_kind={"sliding_window": OURS}, layer_types=GEMMA), True),
    (_config(per_kind={"full_attention": OURS}, model=False), True),  # no model to ask: any route naming it
])
def test_every_route_is_seen(config, served):
    assert serves_some_layer(config) is served


def test_kinds_of_layers():
    assert model_kinds(_config()) == {"full_attention"}
    assert model_kinds(_config(window=4096)) == {"sliding_window"}
    assert model_kinds(_config(layer_types=GEMMA)) == {"full_attention", "sliding_window"}
    assert model_kinds(_config(model=False)) is None
