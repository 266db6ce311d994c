"""FP8 pages: how a cache row is stored in one byte per element and read back.

vLLM's convention, which CHUNKED_KV keeps for both of its page sets (pooled
rows and the raw window): a key element ``x`` is stored as
``fp8(clamp(x / k_scale))`` and read as ``float(stored) * k_scale``; a value
element likewise with ``v_scale`` (the layer's `_k_scale_float` /
`_v_scale_float`: 1.0, a checkpoint's scales, or what `--calculate-kv-scales`
measured). The cache tensors are bytes (vLLM allocates ``uint8``); the format
says how to read them:

- ``fp8`` and ``fp8_e4m3``: E4M3 (``float8_e4m3fn``: 4 exponent bits, 3 of
  mantissa, largest 448, no infinities);
- ``fp8_e5m2``: E5M2 (largest 57,344).

Values beyond the format's largest finite one saturate to it (a cast alone
would give NaN in E4M3). Rounding is to nearest even.

What is quantised, and when (docs/design.md §14): every row is quantised
once, when it is written. A raw row is the step's key and value; a pooled
row is pooled in fp32 from the raw rows as the pages hold them (dequantised),
so it is the same whichever step completed its chunk, and then quantised;
the step's own rows enter attention as they will be read back
(`round_trip`), so a request attends to the same numbers however its prompt
was split into steps or served from the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FORMATS = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def is_fp8(cache_dtype: str | None) -> bool:
    """Whether vLLM's `--kv-cache-dtype` names an FP8 format CHUNKED_KV stores."""
    return cache_dtype in FORMATS


@dataclass(frozen=True)
class PageFormat:
    """How one layer's pages store a row ``[Dk + Dv]`` (keys, then values)."""

    cache_dtype: str  # "fp8", "fp8_e4m3" or "fp8_e5m2"
    head_size: int  # Dk: elements [0, Dk) are keys, the rest values
    k_scale: float = 1.0
    v_scale: float = 1.0

    @property
    def torch_dtype(self) -> torch.dtype:
        return FORMATS[self.cache_dtype]

    @property
    def largest(self) -> float:
        return float(torch.finfo(self.torch_dtype).max)

    def scales(self, width: int, device=None) -> torch.Tensor:
        """Each element's scale ``[Dk + Dv]``: k_scale for keys, v_scale for values."""
        out = torch.full((width,), self.v_scale, dtype=torch.float32, device=device)
        out[: self.head_size] = self.k_scale
        return out


def quantise(rows: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """Rows ``[..., Dk + Dv]`` (any float dtype) -> their stored bytes ``[..., Dk + Dv]`` (uint8)."""
    scaled = rows.float() / fmt.scales(rows.shape[-1], rows.device)
    return scaled.clamp(-fmt.largest, fmt.largest).to(fmt.torch_dtype).view(torch.uint8)


def dequantise(stored: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """Stored bytes ``[..., Dk + Dv]`` (uint8) -> the rows they hold, fp32 ``[..., Dk + Dv]``."""
    return stored.view(fmt.torch_dtype).float() * fmt.scales(stored.shape[-1], stored.device)


def round_trip(rows: torch.Tensor, fmt: PageFormat) -> torch.Tensor:
    """What storing `rows` and reading them back gives, fp32 (the reference's view of FP8 pages)."""
    return dequantise(quantise(rows, fmt), fmt)


def round_trip_kv(keys: torch.Tensor, values: torch.Tensor, fmt: PageFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[..., Dk]`` and values ``[..., Dv]`` stored as one row each and read back, fp32."""
    rows = round_trip(torch.cat([keys.float(), values.float()], dim=-1), fmt)  # [..., Dk + Dv]
    return rows[..., : keys.shape[-1]], rows[..., keys.shape[-1]:]


def binding_args(fmt: PageFormat | None) -> tuple[str, float, float]:
    """The C++ and CUDA bindings' page arguments: the format ("" for pages in the
    model's dtype), k_scale and v_scale (csrc/common/chunked_kv_binding.h `Pages`)."""
    return ("", 1.0, 1.0) if fmt is None else (fmt.cache_dtype, float(fmt.k_scale), float(fmt.v_scale))
