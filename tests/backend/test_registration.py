"""Registration contract: `register()` is idempotent; the CHUNKED_KV enum
member pickles into a fresh interpreter that has not loaded the plugin; the
CPU platform routes an explicit CHUNKED_KV selection to our class and keeps
CPU_ATTN when nothing (or CPU_ATTN) is asked."""

from __future__ import annotations

import pickle
import subprocess
import sys

import vllm_chunked_kv
from vllm_chunked_kv.backend import BACKEND_NAME, BACKEND_PATH


def test_register_is_idempotent():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_chunked_kv.register()
    vllm_chunked_kv.register()
    assert AttentionBackendEnum[BACKEND_NAME].get_path() == BACKEND_PATH
    assert list(AttentionBackendEnum.__members__).count(BACKEND_NAME) == 1


def test_member_unpickles_in_fresh_process():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    vllm_chunked_kv.register()
    payload = pickle.dumps(AttentionBackendEnum[BACKEND_NAME])
    code = (
        "import pickle, sys\n"
        "member = pickle.loads(sys.stdin.buffer.read())\n"
        "print(member.name, member.get_path())\n"
    )
    env_code = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, timeout=120)
    assert env_code.returncode == 0, env_code.stderr.decode()[-2000:]
    assert env_code.stdout.decode().split()[-2:] == [BACKEND_NAME, BACKEND_PATH]


def test_cpu_platform_routes_explicit_selection_only():
    import torch
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.attention.selector import AttentionSelectorConfig

    vllm_chunked_kv.register()
    selector = AttentionSelectorConfig(head_size=32, dtype=torch.float32, kv_cache_dtype="auto", block_size=16)
    chosen = CpuPlatform.get_attn_backend_cls(AttentionBackendEnum[BACKEND_NAME], selector)
    assert chosen == BACKEND_PATH
    assert CpuPlatform.get_attn_backend_cls(None, selector) == AttentionBackendEnum.CPU_ATTN.get_path()


def test_backend_rejects_what_it_cannot_serve():
    import torch
    from vllm.v1.attention.selector import AttentionSelectorConfig

    from vllm_chunked_kv.backend.attention import ChunkedKVBackend

    ok = AttentionSelectorConfig(head_size=64, dtype=torch.float32, kv_cache_dtype="auto", block_size=16)
    assert ChunkedKVBackend.validate_selector_config(ok) == []
    assert ChunkedKVBackend.validate_selector_config(ok._replace(kv_cache_dtype="fp8_e5m2")) == []  # FP8 pages
    for bad, word in [(ok._replace(kv_cache_dtype="fp8_inc"), "kv_cache_dtype"), (ok._replace(use_mla=True), "MLA"),
                      (ok._replace(has_sliding_window=True), "sliding window"),
                      (ok._replace(attn_type="encoder_only"), "encoder_only")]:
        reasons = ChunkedKVBackend.validate_selector_config(bad)
        assert any(word in r for r in reasons), reasons
