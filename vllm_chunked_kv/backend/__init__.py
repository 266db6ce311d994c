"""The vLLM attention backend: `attention` holds vLLM's four roles (backend,
metadata, metadata builder, impl); beside it, everything that plugs CHUNKED_KV
into vLLM's insides: registration, startup checks, the raw pages' spec, manager
and companion layer, the link between the two cache groups of a step, and
`compat`, the one list of vLLM members that are not plugin interfaces.

Importing this package imports nothing from vLLM.
"""

BACKEND_NAME = "CHUNKED_KV"
BACKEND_PATH = "vllm_chunked_kv.backend.attention.ChunkedKVBackend"


def _is_ours(backend) -> bool:
    return getattr(backend, "name", backend) == BACKEND_NAME


def model_kinds(vllm_config) -> set[str] | None:
    """The KV-cache group kinds of the model's attention layers, as vLLM's
    `backend_per_kind` names them (``full_attention``, ``sliding_window``,
    and their MLA forms); None when the config names no model."""
    model = getattr(vllm_config, "model_config", None)
    text = getattr(model, "hf_text_config", None)
    if text is None:
        return None
    mla = bool(getattr(model, "use_mla", False))
    layer_types = getattr(text, "layer_types", None)
    if layer_types:
        sliding = any(kind == "sliding_attention" for kind in layer_types)
        full = any(kind != "sliding_attention" for kind in layer_types)
    else:  # one kind for every layer: a window on all of them (Mistral-style) or none
        window = getattr(getattr(vllm_config, "cache_config", None), "sliding_window", None)
        sliding, full = bool(window), not window
    kinds = set()
    if full:
        kinds.add("mla_attention" if mla else "full_attention")
    if sliding:
        kinds.add("sliding_window_mla" if mla else "sliding_window")
    return kinds


def serves_some_layer(vllm_config) -> bool:
    """Whether CHUNKED_KV serves some layer of this model, whichever route
    chose it: ``--attention-backend`` (`AttentionConfig.backend`) or a
    per-kind entry (``--attention-config '{"backend_per_kind": {...}}'``,
    which wins for its kind, as vLLM's selector reads it). Every startup
    check, the serve file and the alignment salt stand behind this one
    predicate."""
    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None)
    per_kind = getattr(attention, "backend_per_kind", None) or {}
    kinds = model_kinds(vllm_config)
    if kinds is None:  # no model to ask: any route naming CHUNKED_KV
        return _is_ours(backend) or any(_is_ours(b) for b in per_kind.values())
    return any(_is_ours(per_kind.get(kind, backend)) for kind in kinds)
