"""Per-request grid alignment (`align: prompt_end`): the two things it needs
from vLLM beyond the attention metadata (docs/design.md §10).

- **Prompt lengths in the metadata builder.** A request's grid shift is its
  prompt length mod hop (`ChunkedKVConfig.grid_shift`). vLLM 0.32 puts
  prompt lengths in `CommonAttentionMetadata` only for models with an R-SWA
  window, so the worker's model runner is registered when it is built
  (keyed by its `VllmConfig`, the very object it hands its metadata
  builders), and a builder reads the runner's input batch, whose rows are
  the metadata's requests in the same order. vLLM keeps a request's prompt
  length through preemption and recomputation, so its grid never moves.
- **A prefix-cache salt per shift.** Compressed pages depend on the grid,
  so two requests share cached pages only if their shifts agree: the engine
  core adds the shift to each request's `cache_salt` before vLLM hashes its
  blocks. Raw rows would be shareable across shifts, but vLLM hashes every
  cache group with the same keys.
"""

from __future__ import annotations

import weakref

import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.backend import BACKEND_NAME, compat, serves_some_layer

SALT_PREFIX = "chunked_kv.align="  # cache_salt suffix naming the request's grid shift

_runners: weakref.WeakValueDictionary[int, object] = weakref.WeakValueDictionary()  # id(VllmConfig) -> runner


def install() -> None:
    """Patch vLLM's model runner (register itself) and engine core (salt requests); idempotent."""
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def make_init(original):
        def __init__(self, vllm_config, *args, **kwargs):
            original(self, vllm_config, *args, **kwargs)
            _runners[id(vllm_config)] = self

        return __init__

    def make_preprocess(original):
        def preprocess_add_request(self, request):
            cfg = _engine_config(self)
            if cfg is not None and cfg.align != "none":
                request.cache_salt = salted(request.cache_salt, cfg.grid_shift(_prompt_length(request)))
            return original(self, request)

        return preprocess_add_request

    compat.patch_method(GPUModelRunner, "__init__", make_init)
    compat.patch_method(EngineCore, "preprocess_add_request", make_preprocess)


def salted(cache_salt: str | None, shift: int) -> str:
    """The request's cache salt with its grid shift appended."""
    return f"{cache_salt or ''}|{SALT_PREFIX}{shift}"


def prompt_lengths(vllm_config, num_reqs: int) -> torch.Tensor:
    """Prompt length of each of the step's first `num_reqs` requests, ``[num_reqs]``
    int64 on the host, from the model runner built with `vllm_config`."""
    runner = _runners.get(id(vllm_config))
    if runner is None:
        raise RuntimeError(f"{BACKEND_NAME}: align needs the model runner's prompt lengths, but no runner "
                           "was registered for this engine config (is the plugin loaded in the worker?)")
    return runner.input_batch.num_prompt_tokens_cpu_tensor[:num_reqs].long()


def _prompt_length(request) -> int:
    """Tokens of an EngineCoreRequest's prompt (token ids or embeddings)."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return int(request.prompt_embeds.shape[0])


def _engine_config(engine) -> ChunkedKVConfig | None:
    """The engine's chunked_kv settings when CHUNKED_KV serves some layer (read once per engine)."""
    if not hasattr(engine, "_chunked_kv_config"):
        vllm_config = engine.vllm_config
        engine._chunked_kv_config = ChunkedKVConfig.from_vllm_config(vllm_config) if serves_some_layer(vllm_config) else None
    return engine._chunked_kv_config
