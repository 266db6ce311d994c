"""The block size vLLM sets on CUDA suits the compressed layout.

On CUDA, vLLM resets `cache_config.block_size` after the model is loaded
(`Platform.update_block_size_for_backend`, weighing every attention backend
of the model, here CHUNKED_KV and its raw pages' backend). Called the way
vLLM calls it, without --block-size, it must pick the backend's preferred
size (the smallest multiple of hop from 32 tokens on), a multiple of hop for
every preset, including hops that do not divide vLLM's default 16; a user's
--block-size is left alone. The raw pages accept any size of their own.
"""

from __future__ import annotations

import types

import pytest
from vllm.config import VllmConfig
from vllm.platforms.interface import Platform
from vllm.v1.attention.backend import MultipleOf

from vllm_chunked_kv.core import layout
from vllm_chunked_kv.backend.attention import ChunkedKVBackend
from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend.raw_cache import RawPagesBackend

SETTINGS = {
    "chunk 4": {"chunk_size": 4},
    "chunk 3": {"chunk_size": 3},
    "chunk 5": {"chunk_size": 5},
    "overlap at chunk 6": {"chunk_size": 6, "mitigation": "overlap"},
    "boundary at chunk 5": {"chunk_size": 5, "mitigation": "boundary"},
    "dynamic boundaries": {"chunk_size": 4, "boundaries": "dynamic", "min_chunk": 2, "window": 16},
}


def update_like_cuda(settings: dict, monkeypatch, block_size: int | None = None) -> int:
    config = VllmConfig(additional_config={"chunked_kv": settings})
    config.cache_config.block_size = 16 if block_size is None else block_size  # CUDA's default
    config.cache_config.user_specified_block_size = block_size is not None
    object.__setattr__(config, "model_config", types.SimpleNamespace(is_hybrid=False))
    monkeypatch.setattr(Platform, "_find_non_ssm_backends",
                        classmethod(lambda cls, vllm_config: [ChunkedKVBackend, RawPagesBackend]))
    Platform.update_block_size_for_backend(config)
    return config.cache_config.block_size


@pytest.mark.parametrize("name", list(SETTINGS))
def test_cuda_block_size_update_keeps_whole_chunks(name, monkeypatch):
    cfg = ChunkedKVConfig(**SETTINGS[name])
    chosen = update_like_cuda(SETTINGS[name], monkeypatch)
    assert chosen == layout.default_block_size(cfg)
    assert chosen % cfg.hop == 0


def test_user_block_size_is_kept(monkeypatch):
    assert update_like_cuda({"chunk_size": 4}, monkeypatch, block_size=48) == 48


def test_raw_pages_take_any_size_of_their_own():
    spec = object()  # vLLM asks with the raw group's spec when it checks the raw pages themselves
    assert RawPagesBackend.get_supported_kernel_block_sizes(spec) == [MultipleOf(1)]
