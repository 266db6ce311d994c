"""This process's chunked_kv settings, wherever vLLM asks for them.

vLLM calls some capability-sheet hooks inside its config context
(`set_current_vllm_config`: the block-size hooks) and some outside it
(`customize_spec` runs after the model, and so an attention impl, was
built): inside, the settings come from that config; outside, from the last
impl built in this process.
"""

from __future__ import annotations

from vllm.config import get_current_vllm_config_or_none

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend import BACKEND_NAME

_remembered: ChunkedKVConfig | None = None  # set by every impl (all read the same engine config)


def remember(cfg: ChunkedKVConfig) -> None:
    global _remembered
    _remembered = cfg


def active_config_or_none() -> ChunkedKVConfig | None:
    """The settings of the engine config vLLM is working on, else those the
    last impl read, else None (outside any engine)."""
    vllm_config = get_current_vllm_config_or_none()
    if vllm_config is not None:
        return ChunkedKVConfig.from_vllm_config(vllm_config)
    return _remembered


def active_config() -> ChunkedKVConfig:
    cfg = active_config_or_none()
    if cfg is None:
        raise RuntimeError(f"{BACKEND_NAME}: no engine config in this process to read chunked_kv settings from")
    return cfg
