"""Contract of vllm_chunked_kv.ops.kernels.cpu_ext and the C++ CPU kernels (csrc/cpu/, csrc/common/).

Loading:
- the extension builds here (a C++ compiler is installed) and reports the
  instruction set it runs, the ones this CPU supports, its flags and library;
- ``CHUNKED_KV_BUILD_CPP=0`` or missing sources are a reason without a
  build; a failed build is exactly one warning naming the cause, after which
  the kernels are unavailable with that cause as their reason and the
  dispatcher runs PyTorch, saying why in its one log line;
- the shape limits (GQA group, value head size) are reasons without a build;
- the built fold loop holds its prefetch instructions (objdump, x86-64);
- `write_chunks` zeroes the slots below a head's first group in its one
  call, skipping the null page.

Through `schedule.run_schedule` with ``impl="cpp"`` (a simulated vLLM
pager, random steps mixing prefill, chunked prefill and decodes; dropped raw
rows are NaN, so reading one, even masked, fails): at every step the
compressed rows equal `compressed.write_chunks` (target slots NaN before
the call) and every query's output equals `reference_chunked_attention`
(output NaN before the call, so an unwritten element fails), for every
setting of `schedule.CONFIGS` with GQA 1 and 4 in fp32, and in bf16 and fp16
caches (their tolerance), with the odd lengths 63 and 100 among the
requests; one schedule of 2,000 tokens; every instruction set this CPU has
(AVX-512 BF16, AVX-512, AVX2, scalar) in fp32 and bf16; GQA 3, values wider
than keys, heads that are not whole vectors, several query tiles per
request, split contexts, decode-only batches, caches with head-major strides
and padded rows, fp32 queries over bf16 caches, and bf16 queries with fp32
step rows into an fp16 ``out`` (against `compressed.attend`); a model's
logit cap and learned sink logits (`LOGIT_OPTIONS`) with split contexts,
query tiles and bf16. The kernels
really run: their call counters grow while the PyTorch ops are disabled.
"""

import platform
import re
import shutil
import subprocess
import warnings

import pytest
import torch

from vllm_chunked_kv.core.config import ChunkedKVConfig
from vllm_chunked_kv.ops import dispatch
from vllm_chunked_kv.ops.kernels import compressed, cpu_ext
from vllm_chunked_kv.ops.plans.step_plan import ChunkWrites

from . import kernel_checks, schedule
from .kernel_checks import CACHE_LAYOUTS, KERNEL_SHAPES, LOGIT_SHAPES, run_cache_layout, run_logit_shape, run_shape
from .schedule import CONFIGS, LOGIT_OPTIONS, kernel_lengths, run_schedule

torch.set_num_threads(1)
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.fixture(scope="module")
def module():
    cpu_ext._reset_for_tests()
    built = cpu_ext.load()
    assert built is not None, cpu_ext.unavailable_reasons()
    return built


@pytest.fixture
def fresh_state(monkeypatch):
    """cpu_ext and the dispatcher with nothing loaded or chosen; restored afterwards."""
    saved = dict(cpu_ext._state)
    cpu_ext._reset_for_tests()
    dispatch.clear_choices()
    monkeypatch.delenv(dispatch.IMPL_ENV, raising=False)
    yield
    cpu_ext._state.update(saved)
    dispatch.clear_choices()


@pytest.fixture
def isa(module):
    """Set an instruction set for one test; the widest again afterwards."""
    yield module.set_isa
    module.set_isa(module.supported_isas()[0])


# ------------------------------------------------------------------ loading


def test_builds_and_reports_what_runs(module):
    isas = module.supported_isas()
    assert isas[-1] == "scalar" and module.isa() == isas[0]
    assert (module.MAX_TILE_ROWS, module.MAX_CHUNK) == (cpu_ext.MAX_TILE_ROWS, cpu_ext.MAX_CHUNK)
    text = cpu_ext.describe()
    assert text.startswith(f"{isas[0]} kernels") and "-O3 -fopenmp" in text and module.__file__ in text
    assert dispatch.available("cpp", "cpu") == []


def test_fold_loop_keeps_its_prefetches(module):
    """The block fold asks for the next rows while it folds the current ones:
    the built library's logit loops (`block_logits`, `direct_logits`) hold
    prefetch instructions (GCC once deleted them as dead code from an
    outlined helper, halving cold reads), into L2 (`prefetcht2`: prefetches
    into L1 filled its miss buffers and stalled the loop)."""
    objdump = shutil.which("objdump")
    if objdump is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs objdump on x86-64")
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", module.__file__], capture_output=True,
                          text=True, check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", text)  # one disassembled function per piece
    folds = [f for f in functions if re.search(r"::(fold_block|block_logits|direct_logits)<", f.partition("\n")[0])]
    assert folds, "no block_logits function in the library"
    assert all("prefetcht2" in f for f in folds), [f.partition("\n")[0][:120] for f in folds if "prefetcht2" not in f]


def test_build_forbidden_or_sources_missing_is_a_reason_without_a_build(fresh_state, monkeypatch, tmp_path):
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", lambda *a, **k: pytest.fail("built"))
    monkeypatch.setenv(cpu_ext.BUILD_ENV, "0")
    assert cpu_ext.BUILD_ENV in cpu_ext.unavailable_reasons()[0]
    cpu_ext._reset_for_tests()
    monkeypatch.delenv(cpu_ext.BUILD_ENV)
    monkeypatch.setattr(cpu_ext, "SOURCES_DIR", tmp_path)
    (reason,) = cpu_ext.unavailable_reasons()
    assert "not found" in reason and "chunked_kv_cpu_ext.cpp" in reason


def test_failed_build_is_one_warning_and_falls_back(fresh_state, monkeypatch, caplog):
    from torch.utils import cpp_extension

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'chunked_kv_cpu'\nc++: fatal error: killed")

    monkeypatch.setattr(cpp_extension, "load", broken)
    with warnings.catch_warnings(record=True) as caught, caplog.at_level("INFO", "vllm.chunked_kv.dispatch"):
        warnings.simplefilter("always")
        assert cpu_ext.load() is None and cpu_ext.load() is None
        assert dispatch.choose("cpu", head_size=64) == "torch"
    assert len(caught) == 1 and "fatal error: killed" in str(caught[0].message)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("chunked KV kernels on cpu: torch (not using cpp: building the C++ CPU kernels failed")


def test_cpu_chooses_cpp_and_says_which_kernels(module, fresh_state, caplog):
    cpu_ext._state.update(tried=True, module=module, flags=cpu_ext.build_flags())
    with caplog.at_level("INFO", "vllm.chunked_kv.dispatch"):
        assert dispatch.choose("cpu", head_size=64, group=4) == "cpp"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"chunked KV kernels on cpu: cpp ({module.isa()} kernels")
    assert dispatch.choose("cpu", head_size=64, group=cpu_ext.MAX_TILE_ROWS + 1) == "torch"


def test_limits_are_reasons():
    assert len(cpu_ext.unsupported(64, 2048, cpu_ext.MAX_TILE_ROWS + 1)) == 2
    assert cpu_ext.unsupported(256, cpu_ext.MAX_HEAD_SIZE_V, cpu_ext.MAX_TILE_ROWS) == []


def test_binding_rejects_strided_rows(module):
    cache = torch.zeros(4, 2, 8, 16).transpose(2, 3)  # last-dim stride 16
    index = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        module.write_chunks(cache, cache, torch.zeros(3, 2, 8), torch.zeros(4), index[0, :1], index, index, index,
                            index[:, :1], index[:, :1], *[index[0, :0]] * 3, 4, 0, 4, False, "", 1.0, 1.0)


def test_write_chunks_zeroes_unused_slots_in_its_call(module):
    """The slots below a head's first group are zeroed by the same extension
    call (no tensor op per layer); the decode plan's placeholders on vLLM's
    null page (block 0) are left alone."""
    cache = torch.full((3, 2, 4, 16), float("nan"))  # [blocks, Hkv, rows, D + Dv]
    long = dict(dtype=torch.long)
    none = torch.zeros(0, **long)
    writes = ChunkWrites(heads=none, src_blocks=none.view(0, 4), src_offsets=none.view(0, 4),
                         src_step=none.view(0, 4), dst_blocks=none.view(0, 1), dst_offsets=none.view(0, 1),
                         zero_heads=torch.tensor([1, 0, 1], **long), zero_blocks=torch.tensor([2, 0, 2], **long),
                         zero_offsets=torch.tensor([0, 1, 3], **long))
    before = module.calls()[0]
    cpu_ext.write_chunks(cache, cache, torch.zeros(1, 2, 16), writes, ChunkedKVConfig(chunk_size=4), 8)
    assert module.calls()[0] == before + 1
    zeroed = torch.zeros_like(cache, dtype=torch.bool)
    zeroed[2, 1, [0, 3]] = True
    assert (cache[zeroed] == 0).all() and cache[~zeroed].isnan().all()


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_steps_equal_reference(module, name, group):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, group), seed=group, impl="cpp", group=group, tol=1e-4) > 4


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_half_precision_caches_equal_reference(module, name, dtype):
    cfg = ChunkedKVConfig(**CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, 5), seed=5, impl="cpp", group=2, dtype=dtype,
                        tol=TOLERANCE[dtype]) > 4


def test_two_thousand_tokens(module):
    cfg = ChunkedKVConfig(mitigation="boundary", chunk_size=8, window=64, sink_tokens=3)
    assert run_schedule(cfg, [2000, 100, 63], seed=1, impl="cpp", group=4, tol=1e-4) > 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name, group", [("boundary-key_norm", 4), ("stagger-heads", 3)])
def test_every_instruction_set(module, isa, name, group, dtype):
    """Every instruction set's kernels equal the reference; groups 4 and 3
    give decode tiles of a whole register block and of a remainder."""
    for each in module.supported_isas():
        isa(each)
        assert module.isa() == each
        cfg = ChunkedKVConfig(**CONFIGS[name])
        run_schedule(cfg, kernel_lengths(cfg, 6), seed=6, impl="cpp", group=group, dtype=dtype,
                     tol=TOLERANCE[dtype], attend_kwargs=dict(block_m=5))


@pytest.mark.parametrize("name, options", KERNEL_SHAPES + [
    ("overlap", dict(group=16, dtype=torch.bfloat16, tol=3e-2)),  # 16 rows per decode tile
    # bf16 decode tiles of 3 rows (SmolLM2's group): heads of 72 (a masked tail of bf16 key pairs,
    # fp32 values) and 64 (values in bf16 pair products)
    ("boundary-gated", dict(group=3, head_size=72, dtype=torch.bfloat16, tol=3e-2, decode_only=True,
                            decode_plan=True)),
    ("stagger-heads", dict(group=3, head_size=64, dtype=torch.bfloat16, tol=3e-2, decode_only=True,
                           decode_plan=True)),
    ("none-sinks", dict(group=cpu_ext.MAX_TILE_ROWS, num_kv_heads=1, head_size=4)),  # the largest tile
])
def test_shapes_tiles_splits_and_dtypes(module, name, options):
    assert run_shape(name, options, "cpp") > 4


@pytest.mark.parametrize("options", list(LOGIT_OPTIONS))
@pytest.mark.parametrize("name", list(LOGIT_SHAPES))
def test_logit_cap_and_sinks_equal_reference(module, name, options):
    assert run_logit_shape(name, options, "cpp") > 4


@pytest.mark.parametrize("layout", list(CACHE_LAYOUTS))
def test_cache_layouts(module, monkeypatch, layout):
    """Strided (head-major, NaN-padded) caches; fp32 queries over bf16 caches."""
    assert run_cache_layout(monkeypatch, layout, "cpp") > 4


def test_mixed_query_step_and_out_dtypes(module):
    """bf16 queries with fp32 step rows (computed in fp32) written into an fp16 out."""
    out, want = kernel_checks.mixed_dtypes_step(cpu_ext.attend)
    torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("head_size", [64, 9])
def test_bf16_prefill_tiles_take_bf16_products(module, isa, head_size):
    """On AVX-512 BF16, a bf16 multi-token tile takes its logits from bf16
    pair dot products (an odd head's last dim paired with zero): its output
    is within bf16 tolerance of the reference and rounds differently from
    the AVX-512 kernel's fp32 products on the same tile."""
    if "avx512bf16" not in module.supported_isas():
        pytest.skip("this CPU has no AVX-512 BF16")
    args, want = kernel_checks.bf16_prefill_step(head_size)
    outs = {}
    for each in ("avx512bf16", "avx512"):
        isa(each)
        out = torch.full(args[0].shape, float("nan"))  # fp32: a logit's rounding is not lost in bf16
        cpu_ext.attend(*args, out=out, block_m=10)  # 10 queries x GQA 4: packed tiles
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
        outs[each] = out
    assert not torch.equal(outs["avx512bf16"], outs["avx512"])


@pytest.fixture
def gemm(module):
    """Set the path of multi-token bf16 tiles' products for one test; `auto` again afterwards."""
    yield module.set_gemm
    module.set_gemm("auto")


@pytest.mark.parametrize("head_size", [64, 9, 96])
def test_library_products_equal_the_reference(module, gemm, head_size):
    """Forced onto the library GEMM (oneDNN's batch-reduce GEMM; on a CPU
    without matrix units in plain layout, with them in VNNI pairs), bf16
    multi-token tiles take both products there (counted by `library_tiles`),
    odd head sizes included, and stay within bf16 tolerance of the
    reference; few-row tiles (decodes) keep the register tiles; `tiles`
    takes none."""
    args, want = kernel_checks.bf16_prefill_step(head_size)
    for mode, block_m, takes in (("library", 10, True), ("library", 1, False), ("tiles", 10, False)):
        gemm(mode)
        out = torch.full(args[0].shape, float("nan"))
        before = module.library_tiles()
        cpu_ext.attend(*args, out=out, block_m=block_m)
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
        assert (module.library_tiles() > before) == takes, (mode, block_m)


def test_auto_takes_the_matrix_units_where_they_are(module, gemm):
    """`auto` (the default) sends multi-token bf16 tiles to the library GEMM
    exactly where oneDNN packs for matrix units (AMX), and says so."""
    gemm("auto")
    args, _ = kernel_checks.bf16_prefill_step(64)
    before = module.library_tiles()
    cpu_ext.attend(*args, out=torch.empty(args[0].shape), block_m=10)
    assert (module.library_tiles() > before) == module.matrix_units()
    assert ("AMX" in module.gemm_path()) == module.matrix_units()
    if not module.matrix_units():
        pytest.skip("this CPU has no matrix units (AMX): the register tiles ran, as they should; "
                    "the matrix-unit path itself is untested here")


@pytest.mark.parametrize("name", ["boundary-gated", "stagger-heads"])
def test_library_path_on_the_schedule_harness(module, gemm, name):
    """Through the schedule harness (bf16 pages, prefill pieces, prefix hits,
    preemption), the library path equals the reference as the tiles do."""
    gemm("library")
    before = module.library_tiles()
    cfg = ChunkedKVConfig(**schedule.CONFIGS[name])
    assert run_schedule(cfg, kernel_lengths(cfg, 5), seed=5, impl="cpp", group=4, dtype=torch.bfloat16,
                        tol=TOLERANCE[torch.bfloat16], attend_kwargs=dict(block_m=5)) > 4  # 20-row tiles
    assert module.library_tiles() > before


@pytest.mark.parametrize("head_size, block_m", [(64, 1), (96, 2), (64, 10)])
def test_bf16_tiles_take_bf16_value_pairs(module, isa, head_size, block_m):
    """On AVX-512 BF16, a bf16 tile whose value head is a multiple of 32
    multiplies values two keys at a time (bf16 pairs, counted by
    `pair_value_tiles`), in tiles of few rows (4, 8) read in place and in
    packed ones (40): its output is within bf16 tolerance of the reference;
    the AVX-512 kernel takes no pairs on the same tile."""
    if "avx512bf16" not in module.supported_isas():
        pytest.skip("this CPU has no AVX-512 BF16")
    args, want = kernel_checks.bf16_prefill_step(head_size)
    for each, takes_pairs in (("avx512bf16", True), ("avx512", False)):
        isa(each)
        out = torch.full(args[0].shape, float("nan"))
        before = module.pair_value_tiles()
        cpu_ext.attend(*args, out=out, block_m=block_m)  # block_m queries x GQA 4 rows
        torch.testing.assert_close(out, want, atol=3e-2, rtol=3e-2)
        assert (module.pair_value_tiles() > before) == takes_pairs, each


def test_the_kernels_really_run(module, monkeypatch):
    """With PyTorch's attention disabled, a schedule through dispatch's "cpp"
    ops passes and the kernels' call counters grow by its steps."""
    monkeypatch.setattr(compressed, "attend", lambda *a, **k: pytest.fail("the PyTorch attention ran"))
    ops = dispatch.ops("cpp")
    assert (ops.write_chunks.__wrapped__, ops.attend) == (cpu_ext.write_chunks, cpu_ext.attend) and not ops.needs_bias
    writes, attends = module.calls()
    cfg = ChunkedKVConfig(**CONFIGS["stagger-heads"])
    steps = run_schedule(cfg, [63, 100], seed=2, impl="cpp", group=2, tol=1e-4)
    after = module.calls()
    assert after[1] - attends >= steps and after[0] - writes >= 1
