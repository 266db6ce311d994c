"""FP8 pages in the Triton kernels: bytes read as values and values stored as
bytes, exactly as `ops/fp8.py` (torch's casts) does it.

The pages are handed to the kernels as bytes (``uint8``) and converted here
by hand, from the bits, in integer and fp32 arithmetic, not with Triton's
float8 types: Triton's CPU interpreter (the kernels' tests) reads the NaN
codes as finite numbers (E4M3 0x7F as 480, E5M2's infinities and NaNs as
65,536 and up) and stores by truncating instead of rounding to nearest
even, and Triton refuses E4M3 on a GPU below sm_89. Reading a code takes
about a dozen integer and fp32 operations, storing one about twenty.

A kernel takes the format as the constexpr ``FP8`` (`kind`): its mantissa
bits, 3 for E4M3 (``float8_e4m3fn``: bias 7, no infinities, 0x7F / 0xFF
NaN), 2 for E5M2 (bias 15, IEEE infinities and NaNs), 0 for pages in the
model's dtype (loaded and stored as their pointer's type). `load` gives
a code's value unscaled (the callers apply the scales, or fold them into
the query scale and the output); `store` divides by the scale it is given.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm_chunked_kv.ops.fp8 import PageFormat

E4M3 = tl.constexpr(3)  # `FP8` of float8_e4m3fn pages ("fp8", "fp8_e4m3")
E5M2 = tl.constexpr(2)  # `FP8` of float8_e5m2 pages ("fp8_e5m2")
_KINDS = {torch.float8_e4m3fn: 3, torch.float8_e5m2: 2}


def kind(fmt: PageFormat | None) -> int:
    """The kernels' ``FP8`` constant of a page format (0: pages in the model's dtype)."""
    return 0 if fmt is None else _KINDS[fmt.torch_dtype]


def page_bytes(t: torch.Tensor, name: str) -> torch.Tensor:
    """An FP8 cache (or the step's stored rows) as the bytes the kernels read: ``uint8``,
    or a float8 view of them (the same bytes)."""
    if t.dtype not in (torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"{name} must hold FP8 bytes (uint8) with an FP8 page format, not {t.dtype}")
    return t.view(torch.uint8)


@triton.jit
def load(ptr, offsets, mask, FP8: tl.constexpr):
    """Elements at ``ptr + offsets`` as fp32, 0 where masked; FP8 codes decoded
    (unscaled): NaN codes NaN, E5M2's infinities infinite, subnormals exact."""
    if FP8 == 0:
        return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    else:
        BIAS: tl.constexpr = (1 << (6 - FP8)) - 1
        if FP8 == E4M3:
            two_to_minus_bias = 0.0078125
        else:
            two_to_minus_bias = 3.0517578125e-05
        code = tl.load(ptr + offsets, mask=mask, other=0).to(tl.int32)
        mag = code & 0x7F
        # a normal code's bits moved to fp32's places, the exponent rebiased: 2^(e - BIAS) * (1 + m / 2^FP8);
        # for a subnormal one (e == 0) that is 2^-BIAS * (1 + m / 2^FP8), its value 2^(1 - BIAS) * m / 2^FP8:
        # twice the difference (exact)
        v = ((mag << (23 - FP8)) + ((127 - BIAS) << 23)).to(tl.float32, bitcast=True)
        v = tl.where(mag < (1 << FP8), (v - two_to_minus_bias) * 2.0, v)
        if FP8 == E4M3:
            v = tl.where(mag == 0x7F, float("nan"), v)
        else:
            v = tl.where(mag >= 0x7C, tl.where(mag == 0x7C, float("inf"), float("nan")), v)
        return tl.where(code >= 0x80, -v, v)


@triton.jit
def store(ptr, offsets, values, scale, mask, FP8: tl.constexpr):
    """Store fp32 ``values`` at ``ptr + offsets``: in the pointer's type, or as the FP8 codes
    `fp8.quantise` stores for ``values / scale`` (IEEE division, as torch divides): saturated
    at the format's largest finite value, rounded to nearest even (subnormals included), NaN
    kept (0x7F; a NaN's sign is not)."""
    if FP8 == 0:
        tl.store(ptr + offsets, values.to(ptr.dtype.element_ty), mask=mask)
    else:
        BIAS: tl.constexpr = (1 << (6 - FP8)) - 1
        if FP8 == E4M3:
            largest = 448.0
        else:
            largest = 57344.0
        x = tl.math.div_rn(values, scale)
        bits = tl.minimum(tl.maximum(x, -largest), largest).to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        a = bits & 0x7FFFFFFF
        e = (a >> 23) - (127 - BIAS)  # the code's biased exponent before rounding (< 1: a subnormal code)
        mant = (a & 0x7FFFFF) | 0x800000  # 24 bits with the implicit one (fp32 subnormals round to 0 anyway)
        shift = tl.minimum(23 - FP8 + tl.maximum(1 - e, 0), 25)  # bits dropped: all of them from 25 on
        q = mant >> shift
        rem = mant - (q << shift)
        half = 1 << (shift - 1)
        q += ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)  # to nearest even; a carry is exact
        code = ((tl.maximum(e, 1) - 1) << FP8) + q
        code = tl.where(x != x, 0x7F, code | sign)
        tl.store(ptr + offsets, code.to(tl.uint8), mask=mask)
