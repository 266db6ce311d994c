"""vllm-chunked-kv: chunked KV-cache compression as a vLLM attention backend.

`register()` is the `vllm.general_plugins` entry point. It must stay cheap:
importing this package imports nothing heavy.
"""

__version__ = "0.1.0"


def register() -> None:
    """Register the CHUNKED_KV attention backend with vLLM (idempotent)."""
    from vllm_chunked_kv.backend.registration import register_backend

    register_backend()
