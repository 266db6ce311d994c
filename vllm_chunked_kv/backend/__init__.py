"""The vLLM attention backend: `attention` holds vLLM's four roles (backend,
metadata, metadata builder, impl); beside it, everything that plugs CHUNKED_KV
into vLLM's insides: registration, startup checks, the raw pages' spec, manager
and companion layer, and `compat`, the one list of vLLM members that are not
plugin interfaces.

Importing this package imports nothing from vLLM.
"""

BACKEND_NAME = "CHUNKED_KV"
BACKEND_PATH = "vllm_chunked_kv.backend.attention.ChunkedKVBackend"


def selected(vllm_config) -> bool:
    """Whether `vllm_config` asks for the CHUNKED_KV attention backend."""
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    return getattr(backend, "name", None) == BACKEND_NAME
