#!/usr/bin/env bash
# One GPU check of the kernels, for a machine with a CUDA GPU, torch, triton,
# nvcc and this checkout (no vLLM, no network). About 5-8 minutes:
#
#   benchmarks/gpu_check.sh [OUT_DIR]      (default: gpu_check/)
#
# 1. builds the CUDA extension for this device's architecture only;
# 2. runs the GPU-marked kernel tests (CUDA against the reference, every
#    mitigation and stagger, fp32 and bf16) on the GPU, and the device-side
#    decode plan's tests where vLLM is installed (they import the backend);
# 3. times both kernels with benchmarks/gpu_kernels.py at 8k/32k/128k
#    context, decode batches 1 and 64 and a 2048-token prefill piece, head
#    sizes 64/128/256 (32 query heads over 8 KV heads, bf16), against vLLM's
#    kernels where they are installed; one JSON and one Markdown table per
#    head size in OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check}
mkdir -p "$out"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-$(command -v python3 || command -v python)}  # GPU images often have python3 only
TORCH_CUDA_ARCH_LIST=$("$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
export TORCH_CUDA_ARCH_LIST CHUNKED_KV_BUILD_CUDA=1

echo "== device: $("$py" -c 'import torch; print(torch.cuda.get_device_name())'), arch $TORCH_CUDA_ARCH_LIST"
"$py" -c "from vllm_chunked_kv.ops import cuda_ext; import sys; m = cuda_ext.load(); print('extension:', m or cuda_ext.unavailable_reasons()); sys.exit(m is None)"

echo "== kernel tests on the GPU"
tests=(tests/ops/test_cuda_ext.py)
if "$py" -c "import vllm" 2>/dev/null; then tests+=(tests/ops/test_decode_plan.py); else echo "(no vLLM here: decode-plan tests skipped)"; fi
"$py" -m pytest -q -rs -p no:cacheprovider "${tests[@]}" -k "gpu or decode" 2>&1 | tee "$out/tests.txt"

echo "== timings"
for head in 64 128 256; do
    "$py" benchmarks/gpu_kernels.py --head-size "$head" --contexts 8192,32768,131072 --batches 1,64 \
        --prefill-tokens 2048 --repeats 10 --json "$out/gpu_kernels_h$head.json" | tee "$out/gpu_kernels_h$head.md"
done
echo "== results in $out/"
