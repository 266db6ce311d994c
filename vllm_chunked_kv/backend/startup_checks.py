"""Startup checks: combinations of our settings and vLLM's that cannot work.

Every failure is a `ChunkedKVConfigError` with a one-line message; when it
reaches the top of a `vllm serve` process, `install_excepthook` prints that
line instead of a traceback and the process exits non-zero.
"""

from __future__ import annotations

import sys

from vllm_chunked_kv.core.config import ChunkedKVConfig, ChunkedKVConfigError
from vllm_chunked_kv.ops import dispatch, fp8

CACHE_DTYPES = ("auto", "float16", "bfloat16", "float32", *fp8.FORMATS)  # --kv-cache-dtype values CHUNKED_KV stores


def check_engine_support(cfg: ChunkedKVConfig, vllm_config) -> None:
    """Raise ChunkedKVConfigError if vLLM's settings cannot run `cfg`."""
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None and getattr(model_config, "hf_text_config", None) is not None:
        text = model_config.hf_text_config
        window = getattr(getattr(vllm_config, "cache_config", None), "sliding_window", None)
        if window and cfg.sliding_window_layers == "window":  # vLLM sets it only when every layer slides
            raise ChunkedKVConfigError(
                "sliding_window_layers", f"every layer of the model keeps its own sliding window ({window} tokens): "
                "with 'window' (sliding-window layers on vLLM's default backend) no layer is left to compress; "
                "set it to 'compress'"
            )
        num_layers = getattr(text, "num_hidden_layers", None)
        if isinstance(num_layers, int):  # per-layer lists (stagger, slot_gains) must fit the model
            cfg.check_model(num_layers, model_config.get_total_num_kv_heads())
    cache_config = getattr(vllm_config, "cache_config", None)
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    if cache_dtype not in CACHE_DTYPES:
        raise ChunkedKVConfigError(
            None, f"--kv-cache-dtype {cache_dtype} is not supported (allowed: {', '.join(CACHE_DTYPES)})"
        )
    if fp8.is_fp8(cache_dtype):
        refusal = dispatch.forced_fp8_refusal(cache_dtype)
        if refusal:
            raise ChunkedKVConfigError(None, refusal)
    _check_paging(cfg, vllm_config, cache_config)


def _check_paging(cfg: ChunkedKVConfig, vllm_config, cache_config) -> None:
    """Compressed pages need whole slot groups per page, and the raw pages
    need vLLM's hybrid KV cache manager (a cache group of their own). Without
    --block-size, pick the block size that suits the compressed layout."""
    from vllm_chunked_kv.core import layout

    if cache_config is not None and not getattr(cache_config, "user_specified_block_size", True):
        cache_config.block_size = layout.default_block_size(cfg)
    block_size = getattr(cache_config, "block_size", None)
    if block_size:
        layout.check_block_size(cfg, block_size)
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise ChunkedKVConfigError(
            None, "KV connectors (--kv-transfer-config) are not supported: they move one KV state per "
            "token, and CHUNKED_KV stores one state per tokens_per_state tokens plus a raw window"
        )
    if getattr(vllm_config, "speculative_config", None) is not None:
        raise ChunkedKVConfigError(
            None, "speculative decoding (--speculative-config) is not supported: a step's chunk writes "
            "would pool draft tokens that verification may reject"
        )
    scheduler_config = getattr(vllm_config, "scheduler_config", None)
    if getattr(scheduler_config, "disable_hybrid_kv_cache_manager", None) is True:
        raise ChunkedKVConfigError(
            None, "--disable-hybrid-kv-cache-manager is not supported: the raw window lives in a "
            "sliding-window KV cache group of its own, next to the compressed pages"
        )
    parallel_config = getattr(vllm_config, "parallel_config", None)
    if getattr(parallel_config, "use_ubatching", False):
        raise ChunkedKVConfigError(
            None, "micro-batching (--enable-dbo) is not supported: a step's plans join the metadata of two "
            "cache groups, built for the whole batch (backend/step_link.py)"
        )
    model_config = getattr(vllm_config, "model_config", None)
    if getattr(model_config, "attention_chunk_size", None):
        raise ChunkedKVConfigError(
            None, "the model uses chunked local attention; chunked compression supports "
            "full-attention decoder models only"
        )


def find_config_error(exc: BaseException | None) -> ChunkedKVConfigError | None:
    """Our error inside `exc`: itself, a cause/context, or inside a pydantic
    ValidationError (vLLM validates VllmConfig with pydantic, which wraps it)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, ChunkedKVConfigError):
            return exc
        for err in getattr(exc, "errors", lambda: [])() if hasattr(exc, "error_count") else []:
            inner = (err.get("ctx") or {}).get("error")
            if isinstance(inner, ChunkedKVConfigError):
                return inner
        exc = exc.__cause__ or exc.__context__
    return None


def install_excepthook() -> None:
    """Print a ChunkedKVConfigError as one line (no traceback) and exit 1."""
    previous = sys.excepthook
    if getattr(previous, "_chunked_kv", False):
        return

    def hook(exc_type, exc, tb):
        cause = find_config_error(exc)
        if cause is None:
            return previous(exc_type, exc, tb)
        print(f"error: {cause}", file=sys.stderr)
        sys.stderr.flush()

    hook._chunked_kv = True  # type: ignore[attr-defined]
    sys.excepthook = hook
