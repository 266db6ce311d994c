"""Which implementation runs the chunked KV ops: the CUDA extension, the
Triton kernels, the C++ CPU kernels (`cpu_ext.py`), or the PyTorch path
(`compressed.py`).

- `available(impl, device, ...)` lists the reasons why an implementation
  cannot run there (empty: it can).
- `choose(device, ...)` picks one: on a CUDA device CUDA, then Triton, then
  PyTorch, and with both kernels there ``cuda+triton``: decodes on the
  CUDA kernels, prefill pieces on Triton's query tiles (fp32 `tl.dot` in IEEE
  precision: FMA, not tensor cores); on a CPU
  the C++ kernels (built on first use), then PyTorch (Triton's CPU
  interpreter can run the kernels, far slower than PyTorch, so only when
  asked for by name). With FP8 pages, only the implementations in
  `FP8_READERS`. It logs one line: the choice, and why
  the ones before it cannot run. The environment variable
  ``CHUNKED_KV_IMPL`` = ``cuda`` | ``triton`` | ``cpp`` | ``torch``, or
  ``DECODE+PREFILL`` of two kernels, forces one (an error, with the
  reasons, if it cannot run); ``auto`` or unset picks.
- `ops(impl)` returns the implementation's three step ops (and, for the
  C++ kernels, the extension that builds decode plans in one call), with the
  signatures of `shared.write_raw`, `compressed.write_chunks` and
  `compressed.attend`; only the PyTorch `attend` reads the plan's dense
  bias (`needs_bias`).

Nothing heavy is imported until an implementation is asked about: a CPU-only
process never imports Triton through this module and never compiles CUDA;
a CUDA process never compiles the C++ CPU kernels.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import platform
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import torch

from vllm_chunked_kv.ops import fp8
from vllm_chunked_kv.ops.kernels import compressed, shared, unit_writes
from vllm_chunked_kv.ops.plans.step_plan import StepPlan

IMPLS = ("cuda", "triton", "cpp", "torch")
IMPL_ENV = "CHUNKED_KV_IMPL"

logger = logging.getLogger("vllm.chunked_kv.dispatch")


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def native_bf16(dev: torch.device | None = None) -> bool:
    """Whether `dev` (default: the CPU) computes bf16 natively: a CUDA GPU that supports it,
    or a CPU with AVX-512 BF16 or AMX; without it (an AVX2-only CPU) bf16 is emulated and
    far slower than fp32."""
    if dev is not None and dev.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def cpu_description() -> dict:
    """The CPU's model and the flags that decide the kernels' paths (AMX, AVX-512 BF16, AVX-512, AVX2)."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")  # Linux; elsewhere the platform's name and no flags
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    wanted = ("amx_tile", "amx_bf16", "avx512_bf16", "avx512f", "avx2")
    return {"model": model, "flags": [flag for flag in wanted if flag in flags],
            "torch_amx": torch.cpu._is_amx_tile_supported(), "torch_avx512_bf16": torch.cpu._is_avx512_bf16_supported()}


def available(impl: str, device=None, *, head_size: int | None = None, head_size_v: int | None = None,
              group: int = 1, cache_dtype: str | None = None) -> list[str]:
    """Reasons why ``impl`` cannot run on ``device`` (default: the CUDA
    device if there is one, else the CPU) for these settings and shapes and
    vLLM's ``--kv-cache-dtype`` (`cache_dtype`); an empty list when it can."""
    if impl not in IMPLS:
        raise ValueError(f"unknown implementation {impl!r} (choose from {', '.join(IMPLS)})")
    device = resolve_device(device)
    if fp8.is_fp8(cache_dtype) and impl not in FP8_READERS:
        return [f"the {impl} kernels do not read FP8 pages (--kv-cache-dtype {cache_dtype})"]
    if impl == "torch":
        return []
    if impl in ("cuda", "cpp"):  # the extensions, each for one device type
        device_type, needs = _EXTENSION_DEVICE[impl]
        if device.type != device_type:
            return [f"tensors are on {device.type}: {needs}"]
        module = _extension(impl)
        reasons = module.unavailable_reasons()
        if head_size is not None:
            reasons += module.unsupported(head_size, head_size_v or head_size, group)
        return reasons
    return _triton_reasons(device)


FP8_READERS = ("torch", "cpp", "triton", "cuda")  # the implementations that read and write FP8 pages (ops/fp8.py)

_EXTENSION_DEVICE = {"cuda": ("cuda", "the CUDA extension needs a CUDA device"),
                     "cpp": ("cpu", "the C++ kernels run on the CPU")}


def _extension(impl: str):
    """The module of an extension implementation (imported on demand)."""
    if impl == "cuda":
        from vllm_chunked_kv.ops.kernels import cuda_ext

        return cuda_ext
    from vllm_chunked_kv.ops.kernels import cpu_ext

    return cpu_ext


def _triton_reasons(device: torch.device) -> list[str]:
    try:
        importlib.import_module("triton")
    except ImportError as exc:
        return [f"triton is not installed ({exc})"]
    if device.type == "cuda":
        return [] if torch.cuda.is_available() else ["no CUDA device is visible to torch"]
    if device.type != "cpu":
        return [f"Triton has no backend for {device.type} tensors"]
    if os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        return ["tensors are on cpu and Triton has no CPU backend (its interpreter, TRITON_INTERPRET=1 "
                "set before triton is imported, runs the kernels slowly, for tests)"]
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.sum, InterpretedFunction):  # importing vLLM imports triton, for one
        return ["TRITON_INTERPRET=1 was set after triton was imported (set it before anything imports triton)"]
    from vllm_chunked_kv.ops.kernels import triton_attention

    if not triton_attention.INTERPRETED:
        return ["TRITON_INTERPRET=1 was set after the Triton kernels were imported (set it before importing them)"]
    return []


def choose(device=None, *, impl: str | None = None, head_size: int | None = None, head_size_v: int | None = None,
           group: int = 1, cache_dtype: str | None = None) -> str:
    """The implementation to use (see the module docstring for the order).
    ``impl`` (else ``CHUNKED_KV_IMPL``) names one: it is checked, not searched."""
    device = resolve_device(device)
    return _choose(device.type, impl or forced_impl(), head_size, head_size_v, group, cache_dtype)


def forced_impl() -> str:
    """What ``CHUNKED_KV_IMPL`` names, lower-cased: "auto" when unset or empty."""
    return os.environ.get(IMPL_ENV, "auto").strip().lower() or "auto"


def _choose(device_type: str, forced: str, head_size, head_size_v, group, cache_dtype=None) -> str:
    key = (device_type, forced, head_size, head_size_v, group, cache_dtype)  # what the choice depends on
    if key in _choices:
        return _choices[key]
    shapes = dict(head_size=head_size, head_size_v=head_size_v, group=group, cache_dtype=cache_dtype)
    why = f"{IMPL_ENV}={forced}"
    if forced != "auto":
        parts = forced.split("+")
        if any(part not in IMPLS for part in parts) or len(parts) > 2 or (len(parts) == 2 and "torch" in parts):
            raise ValueError(f"implementation {forced!r} (from impl= or {IMPL_ENV}): choose from auto, "
                             f"{', '.join(IMPLS)}, or DECODE+PREFILL of two kernels (e.g. cuda+triton)")
        reasons = [reason for part in dict.fromkeys(parts) for reason in available(part, device_type, **shapes)]
        if reasons:
            raise RuntimeError(f"implementation {forced!r} cannot run on {device_type}: " + "; ".join(reasons))
        choice = forced
    else:
        order = ("cuda", "triton", "torch") if device_type == "cuda" else ("cpp", "torch")
        skipped = {}
        for impl in order:
            reasons = available(impl, device_type, **shapes)
            if not reasons:
                choice = impl
                break
            skipped[impl] = reasons
        why = "; ".join(f"not using {impl}: {'; '.join(reasons)}" for impl, reasons in skipped.items())
        if choice == "cuda" and not available("triton", device_type, **shapes):
            choice = "cuda+triton"  # prefill pieces on Triton's query tiles, decodes on the CUDA kernels
    logger.info("chunked KV kernels on %s: %s%s", device_type, choice, _detail(choice, why))
    _choices[key] = choice
    return choice


_choices: dict[tuple, str] = {}


def forced_fp8_refusal(cache_dtype: str) -> str | None:
    """Why the implementation forced by ``CHUNKED_KV_IMPL`` cannot serve FP8 pages
    (`cache_dtype`), or None: unforced, or it reads them. Checked at startup, so
    the server stops with one line instead of upcasting the cache."""
    forced = forced_impl()
    unable = [part for part in forced.split("+") if part in IMPLS and part not in FP8_READERS]
    if forced == "auto" or not unable:
        return None
    return (f"--kv-cache-dtype {cache_dtype}: {IMPL_ENV}={forced} names kernels that do not read FP8 pages "
            f"({', '.join(unable)}; these do: {', '.join(FP8_READERS)})")


def _detail(choice: str, why: str) -> str:
    """What the log line adds to the choice: the C++ kernels' instruction set
    and build, and why the implementations before it were passed over."""
    parts = []
    if "cpp" in choice.split("+"):
        from vllm_chunked_kv.ops.kernels import cpu_ext

        parts.append(cpu_ext.describe())
    if why:
        parts.append(why)
    return f" ({'; '.join(parts)})" if parts else ""


def clear_choices() -> None:
    """Forget cached choices (after changing the environment)."""
    _choices.clear()


class Ops(NamedTuple):
    """One implementation's step ops (signatures of `compressed.py`)."""

    name: str
    write_raw: Callable
    write_chunks: Callable
    attend: Callable
    native_plans: ModuleType | None = None  # builds decode plans in one call (the C++ extension), or None

    @property
    def needs_bias(self) -> bool:
        """Whether `attend` reads the plan's dense bias (`build_plan(..., bias=True)`)."""
        return self.name == "torch"


@functools.cache
def ops(impl: str) -> Ops:
    """The step ops of ``impl`` (check `available` first: this imports it).
    ``"DECODE+PREFILL"`` (e.g. ``cuda+triton``) writes with the first and
    sends single-token key sets to the first's attention, multi-token key
    sets (prefill pieces) to the second's."""
    if "+" in impl:
        decode, prefill = (ops(part) for part in impl.split("+"))
        return Ops(impl, decode.write_raw, decode.write_chunks, split_attend(decode.attend, prefill.attend),
                   decode.native_plans)
    if impl == "torch":
        return Ops("torch", shared.write_raw, with_unit_writes(compressed.write_chunks), compressed.attend)
    if impl == "cuda":
        from vllm_chunked_kv.ops.kernels import cuda_ext

        return Ops("cuda", shared.write_raw, with_unit_writes(cuda_ext.write_chunks), cuda_ext.attend)
    if impl == "cpp":
        from vllm_chunked_kv.ops.kernels import cpu_ext

        return Ops("cpp", cpu_ext.write_raw, with_unit_writes(cpu_ext.write_chunks), cpu_ext.attend,
                   cpu_ext.load())
    if impl == "triton":
        from vllm_chunked_kv.ops.kernels import triton_attention, triton_pool

        return Ops("triton", shared.write_raw, with_unit_writes(triton_pool.write_chunks),
                   triton_attention.attend)
    raise ValueError(f"unknown implementation {impl!r} (choose from {', '.join(IMPLS)})")


def with_unit_writes(write_chunks: Callable) -> Callable:
    """An implementation's `write_chunks`, or with dynamic boundaries the unit
    writes of `kernels/unit_writes.py` (one PyTorch path for every implementation:
    a few rows per step; the attention kernels read the unit slots as they
    read any grid)."""

    @functools.wraps(write_chunks)  # `__wrapped__`: the implementation's own
    def write(comp_cache, raw_cache, step_rows, writes, cfg, head_size, **page):  # page: fmt= of FP8 pages
        if writes.dynamic is not None:
            unit_writes.write(comp_cache, raw_cache, step_rows, writes.dynamic, cfg, head_size, **page)
        else:
            write_chunks(comp_cache, raw_cache, step_rows, writes, cfg, head_size, **page)

    return write


def split_attend(decode_attend: Callable, prefill_attend: Callable) -> Callable:
    """An `attend` that runs the plan's single-token key sets (decodes)
    through `decode_attend` and its multi-token ones (prefill pieces)
    through `prefill_attend` (neither reads the dense bias). The prefill
    implementation writes a buffer of its own, whose pieces' rows are then
    copied into the output: an implementation may write rows outside its
    key sets."""

    def attend(query, step_rows, comp_cache, raw_cache, plan: StepPlan, scale: float, out=None, **logit_options):
        decodes = [keys for keys in plan.key_sets if keys.query_index.shape[1] == 1]
        pieces = [keys for keys in plan.key_sets if keys.query_index.shape[1] > 1]
        if not decodes or not pieces:
            run = decode_attend if decodes else prefill_attend
            return run(query, step_rows, comp_cache, raw_cache, plan, scale, out=out, **logit_options)
        out = decode_attend(query, step_rows, comp_cache, raw_cache, replace(plan, key_sets=decodes), scale, out=out,
                            **logit_options)
        piece_out = prefill_attend(query, step_rows, comp_cache, raw_cache, replace(plan, key_sets=pieces), scale,
                                   **logit_options)
        rows = torch.cat([keys.query_index.reshape(-1) for keys in pieces])  # [P] the pieces' tokens
        out[rows] = piece_out[rows].to(out.dtype)
        return out

    return attend
