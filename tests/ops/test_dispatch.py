"""Contract of vllm_chunked_kv.ops.dispatch.

- `available(impl, device)` returns a list of reasons (empty: it can run):
  PyTorch always runs; CUDA has a reason on a CPU device; Triton on CPU
  names TRITON_INTERPRET unless the interpreter is really on (checked in the
  interpreter worker, where it is), and an unknown name is an error.
- `choose` on CPU picks the C++ kernels, PyTorch when they cannot run, never
  Triton (even with the interpreter on); on a CUDA
  device it takes CUDA, then Triton, then PyTorch, the first without
  reasons, and CUDA with Triton for prefill pieces when both can run;
  CUDA's kernel limits (GQA group, head size) send a shape on.
- ``CHUNKED_KV_IMPL`` (or ``impl=``) forces one; one that cannot run is an
  error that carries the reasons; an unknown name is an error.
- `ops(impl)` gives an implementation's step ops: PyTorch's are
  `compressed.py`'s (and need the plan's bias); forced to Triton
  (interpreter worker) a whole schedule gives the reference's numbers.
- ``DECODE+PREFILL`` splits a step's attention: each side gets only its
  key sets, the output rows of prefill pieces come from the prefill side,
  and C++ decodes beside Triton prefill pieces give the reference's
  numbers; the PyTorch path cannot be a side.
"""

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.kernels import compressed, shared

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _fresh_choices(monkeypatch):
    monkeypatch.delenv(dispatch.IMPL_ENV, raising=False)
    dispatch.clear_choices()
    yield
    dispatch.clear_choices()


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
    assert triton_ops.dispatch.choose("cpu") in ("cpp", "torch")  # never picked automatically on CPU


def test_unknown_implementation_is_an_error():
    with pytest.raises(ValueError, match="unknown implementation"):
        dispatch.available("xformers", "cpu")


def test_cpu_picks_cpp_then_torch(monkeypatch):
    assert dispatch.choose("cpu", head_size=16) == "cpp"
    dispatch.clear_choices()
    monkeypatch.setattr(dispatch, "available", lambda impl, device=None, **shapes: ["no"] if impl == "cpp" else [])
    assert dispatch.choose("cpu", head_size=16) == "torch"


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
        ({}, "cuda+triton"),
        ({"triton": ["triton is not installed"]}, "cuda"),
        ({"cuda": ["no extension"]}, "triton"),
        ({"cuda": ["no extension"], "triton": ["triton is not installed"]}, "torch"),
    ],
)
def test_cuda_device_order(monkeypatch, reasons, expected):
    _pretend(monkeypatch, reasons)
    assert dispatch.choose("cuda", head_size=64) == expected


def test_cuda_kernel_limits_fall_back_to_triton(monkeypatch):
    _pretend(monkeypatch, {})
    assert dispatch.choose("cuda", head_size=64, group=16) == "triton"  # the fake's CUDA limit is 8


def test_cuda_limits_are_reasons():
    from vllm_chunked_kv.ops.kernels import cuda_ext

    reasons = cuda_ext.unsupported(512, 512, 64)
    assert len(reasons) == 2 and "512" in reasons[1] and "64" in reasons[0]
    assert cuda_ext.unsupported(128, 128, 8) == []


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
    with pytest.raises(ValueError, match="DECODE\\+PREFILL"):  # the PyTorch path needs the dense bias
        dispatch.choose("cpu", impl="cpp+torch")
    with pytest.raises(RuntimeError, match="CUDA device"):
        dispatch.choose("cpu", impl="cpp+cuda")


def test_split_attend_sends_decodes_and_prefill_pieces_apart():
    """Each side sees only its key sets; the pieces' rows come from the
    prefill side even though both sides write every row they are given."""
    from vllm_chunked_kv.ops.plans.step_plan import PagedBatch, build_plan

    cfg = ChunkedKVConfig(chunk_size=4, window=8)
    batch = PagedBatch(query_start=[0, 1, 7, 8], seq_lens=[30, 20, 41], block_table=torch.arange(1, 19).view(3, 6),
                       block_size=8, raw_block_table=torch.arange(1, 19).view(3, 6), raw_block_size=8)
    plan = build_plan(batch, cfg, [0], bias=False)  # requests 0 and 2 decode, request 1 computes 6 tokens
    seen = {}

    def side(name, value):
        def attend(query, step_rows, comp, raw, plan, scale, out=None):
            seen[name] = [keys.query_index.tolist() for keys in plan.key_sets]
            out = torch.empty(query.shape[0], 2, 3) if out is None else out
            return out.fill_(value)
        return attend

    out = torch.full((8, 2, 3), float("nan"))
    got = dispatch.split_attend(side("decode", 1.0), side("prefill", 2.0))(
        torch.zeros(8, 2, 4), None, None, None, plan, 1.0, out=out)
    assert got is out
    assert seen == {"decode": [[[0], [7]]], "prefill": [[[1, 2, 3, 4, 5, 6]]]}
    assert out[[0, 7]].eq(1.0).all() and out[1:7].eq(2.0).all()


def test_torch_ops_are_the_compressed_path():
    ops = dispatch.ops("torch")
    assert (ops.write_raw, ops.write_chunks.__wrapped__, ops.attend) == (shared.write_raw, compressed.write_chunks,
                                                                         compressed.attend)
    assert ops.needs_bias
    with pytest.raises(ValueError, match="unknown implementation"):
        dispatch.ops("xformers")


def test_forced_triton_runs_a_checked_schedule(triton_ops):
    cfg = ChunkedKVConfig(mitigation="stagger", chunk_size=4, window=6, sink_tokens=1)
    assert triton_ops.dispatch.choose("cpu", impl="triton") == "triton"
    assert triton_ops.schedule.run_schedule(cfg, [40, 9], seed=3, impl="triton", tol=1e-4) > 1


def test_decodes_in_cpp_and_prefill_pieces_in_triton_run_a_checked_schedule(triton_ops):
    """Mixed steps (decodes beside prefill pieces) through two kernels give the reference's numbers."""
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=4, window=6, sink_tokens=1)
    assert triton_ops.dispatch.choose("cpu", impl="cpp+triton") == "cpp+triton"
    assert triton_ops.schedule.run_schedule(cfg, [40, 9, 63], seed=5, impl="cpp+triton", group=2, tol=1e-4) > 1
