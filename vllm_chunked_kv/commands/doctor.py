"""`vllm-chunked-kv doctor`: which implementation would run here, and why, without a server.

Prints the vLLM and torch versions (and whether vLLM is the release this
package was tested with), the device, and for each implementation (CUDA
extension, Triton, the C++ CPU kernels, PyTorch) whether it can run and the
reasons if not (for the C++ kernels also the instruction set, threads, build
flags and library), for the KV pages' dtype (`--kv-cache-dtype`, named on
its own line); the last line names the one the backend would pick, as the
server logs it. A torchvision (torchaudio, torchcodec) that cannot load next
to this torch, which stops `vllm serve` on import, is an `error:` line with
the fix and a non-zero exit.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", help="cuda or cpu (default: cuda when torch sees a GPU)")
    parser.add_argument("--head-size", type=int, default=128, help="the model's head size")
    parser.add_argument("--group", type=int, default=1, help="query heads per KV head (GQA)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="vLLM's --kv-cache-dtype: auto (the model's dtype), or an FP8 format (fp8, fp8_e4m3, "
                        "fp8_e5m2), which only some implementations read")


def run(args: argparse.Namespace) -> int:
    import torch

    from vllm_chunked_kv.backend import compat
    from vllm_chunked_kv.ops import dispatch
    from vllm_chunked_kv.runner import companions

    version = compat.vllm_version()
    print(f"vllm {version} (tested with {compat.TESTED_VLLM}{'' if compat.version_warning(version) is None else ': differs'})")
    print(f"torch {torch.__version__}, CUDA devices: {torch.cuda.device_count()}")
    device = dispatch.resolve_device(args.device)
    shapes = dict(head_size=args.head_size, group=args.group, cache_dtype=args.kv_cache_dtype)
    print(f"KV pages: {args.kv_cache_dtype}" + (" (FP8, one byte per element)" if args.kv_cache_dtype.startswith("fp8") else ""))
    for impl in dispatch.IMPLS:
        reasons = dispatch.available(impl, device, **shapes)
        print(f"{impl:7s} {'can run' if not reasons else 'cannot run: ' + '; '.join(reasons)}{_details(impl, reasons)}")
    problem = companions.problem()
    if problem is not None:
        print(f"error: {problem}")
    forced = os.environ.get(dispatch.IMPL_ENV)
    try:
        chosen = dispatch.choose(device, **shapes)
    except (RuntimeError, ValueError) as exc:
        print(f"chosen: none ({exc})")
        return 1
    print(f"chosen on {device.type}: {chosen}" + (f" ({dispatch.IMPL_ENV}={forced})" if forced else ""))
    return 0 if problem is None else 1


def _details(impl: str, reasons: list[str]) -> str:
    """What the doctor adds to an implementation that can run: for the C++
    kernels, which instruction set runs and how they were built."""
    if impl != "cpp" or reasons:
        return ""
    from vllm_chunked_kv.ops.kernels import cpu_ext

    return f" ({cpu_ext.describe()})"
