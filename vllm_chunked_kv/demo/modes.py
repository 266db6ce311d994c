"""The modes every demo and benchmark compares: each mitigation preset over chunk 4."""

from __future__ import annotations

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.core.presets import PRESETS


def _mode(name: str) -> dict:
    """Preset `name`, plus the chunk_size the preset fixes (explicit, so that
    the demo's chunk 4 does not contradict it)."""
    fixed = {k: v for k, v in PRESETS[name].settings(4, {}).items() if k == "chunk_size"}
    return {"mitigation": name, **fixed}


MITIGATION_MODES: dict[str, dict] = {name: _mode(name) for name in PRESETS}


def rows_per_token(settings: dict | None) -> float:
    """Stored KV rows per long-context token: 1 for full attention, else 1 / tokens_per_state."""
    if settings is None:
        return 1.0
    return float(1 / ChunkedKVConfig.from_additional_config({"chunked_kv": settings}).tokens_per_state)
