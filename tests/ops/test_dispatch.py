"""Contract of vllm_chunked_kv.ops.dispatch.

- `available(impl, device)` returns a list of reasons (empty: it can run):
  PyTorch always runs; CUDA has a reason on a CPU device; Triton on CPU
  names TRITON_INTERPRET unless the interpreter is really on (checked in the
  interpreter worker, where it is), and an unknown name is an error.
- `choose` on CPU picks PyTorch, even with the interpreter on; on a CUDA
  device it takes CUDA, then Triton, then PyTorch, the first without
  reasons; CUDA's kernel limits (GQA group, head size) send a shape on.
- ``CHUNKED_KV_IMPL`` (or ``impl=``) forces one; one that cannot run is an
  error that carries the reasons; an unknown name is an error.
- `attend` and `pool_chunk` have `paged.attend`'s and
  `reference.pool_chunk`'s signatures and results: on CPU the PyTorch path,
  forced to Triton (interpreter worker) the same numbers.
"""

import pytest
import torch

from vllm_chunked_kv.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch, paged, reference

torch.set_num_threads(1)
CFG = ChunkedKVConfig(chunk_size=4, window=8, sink_tokens=2, mitigation="boundary", pooling="key_norm")


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv(dispatch.IMPL_ENV, raising=False)
    dispatch.clear_choices()
    yield
    dispatch.clear_choices()


def _paged_case(seed=0):
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(12, 2, 8, 32, generator=gen)  # [blocks, Hkv, block_size, D + Dv]
    batch = paged.PagedBatch.from_vllm(
        query_start_loc=torch.tensor([0, 40, 41]),
        seq_lens=torch.tensor([40, 37]),
        block_table=torch.tensor([[3, 0, 7, 1, 9], [2, 4, 11, 5, 6]], dtype=torch.int32),
        block_size=8,
    )
    query = torch.randn(41, 8, 16, generator=gen)
    return query, kv_cache, batch


def test_torch_is_always_available():
    assert dispatch.available("torch", "cpu") == []


def test_cuda_on_cpu_has_a_reason():
    reasons = dispatch.available("cuda", "cpu")
    assert reasons and all(isinstance(r, str) for r in reasons)
    assert "CUDA device" in reasons[0]


def test_triton_on_cpu_without_interpreter_names_it(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reasons = dispatch.available("triton", "cpu")
    assert reasons and "TRITON_INTERPRET" in reasons[0]


def test_triton_on_cpu_with_interpreter_is_available(triton_ops):
    assert triton_ops.dispatch.available("triton", "cpu") == []
    assert triton_ops.dispatch.choose("cpu") == "torch"  # never picked automatically on CPU


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="unknown implementation"):
        dispatch.available("xformers", "cpu")


def test_cpu_picks_torch():
    assert dispatch.choose("cpu", cfg=CFG, head_size=16) == "torch"


def _pretend(monkeypatch, reasons_by_impl):
    real = dispatch.available

    def fake(impl, device=None, **shapes):
        if torch.device(device).type == "cuda":
            return reasons_by_impl.get(impl, []) if shapes.get("group", 1) <= 8 or impl != "cuda" else ["group too big"]
        return real(impl, device, **shapes)

    monkeypatch.setattr(dispatch, "available", fake)


@pytest.mark.parametrize(
    "reasons, expected",
    [
        ({}, "cuda"),
        ({"cuda": ["no extension"]}, "triton"),
        ({"cuda": ["no extension"], "triton": ["triton is not installed"]}, "torch"),
    ],
)
def test_cuda_device_order(monkeypatch, reasons, expected):
    _pretend(monkeypatch, reasons)
    assert dispatch.choose("cuda", cfg=CFG, head_size=64) == expected


def test_cuda_kernel_limits_fall_back_to_triton(monkeypatch):
    _pretend(monkeypatch, {})
    assert dispatch.choose("cuda", cfg=CFG, head_size=64, group=16) == "triton"


def test_cuda_limits_are_reasons():
    from vllm_chunked_kv.ops import cuda_ext

    reasons = cuda_ext.unsupported(ChunkedKVConfig(chunk_size=128, window=128), 512, 512, 16)
    assert len(reasons) == 3
    assert cuda_ext.unsupported(CFG, 128, 128, 8) == []


def test_forcing_an_implementation(monkeypatch):
    monkeypatch.setenv(dispatch.IMPL_ENV, "torch")
    assert dispatch.choose("cpu") == "torch"
    dispatch.clear_choices()
    monkeypatch.setenv(dispatch.IMPL_ENV, "cuda")
    with pytest.raises(RuntimeError, match="CUDA device"):
        dispatch.choose("cpu")
    dispatch.clear_choices()
    monkeypatch.setenv(dispatch.IMPL_ENV, "fastest")
    with pytest.raises(ValueError, match="choose from"):
        dispatch.choose("cpu")
    with pytest.raises(RuntimeError, match="CUDA device"):
        dispatch.choose("cpu", impl="cuda")


def test_attend_on_cpu_is_the_torch_path():
    query, kv_cache, batch = _paged_case()
    origins = torch.tensor([0, 2])
    got = dispatch.attend(query, kv_cache, batch, 0.25, CFG, origins)
    want = paged.attend(query, kv_cache, batch, 0.25, CFG, origins)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_pool_chunk_on_cpu_is_the_reference():
    keys, values = torch.randn(2, 3, 4, 16), torch.randn(2, 3, 4, 8)
    for got, want in zip(dispatch.pool_chunk(keys, values, CFG), reference.pool_chunk(keys, values, CFG)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_forced_triton_gives_the_same_numbers(triton_ops):
    query, kv_cache, batch = _paged_case(1)
    origins = torch.tensor([1, 3])
    got = triton_ops.dispatch.attend(query, kv_cache, batch, 0.25, CFG, origins, impl="triton")
    want = paged.attend(query, kv_cache, batch, 0.25, CFG, origins)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    keys, values = torch.randn(5, 4, 16), torch.randn(5, 4, 8)
    for got, want in zip(triton_ops.dispatch.pool_chunk(keys, values, CFG, impl="triton"), reference.pool_chunk(keys, values, CFG)):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
