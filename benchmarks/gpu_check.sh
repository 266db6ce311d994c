#!/usr/bin/env bash
# One GPU check of the kernels in at most 8 minutes, for a machine with a CUDA
# GPU, torch, triton, nvcc and this checkout (no vLLM, no network):
#
#   benchmarks/gpu_check.sh OUT_DIR
#
# Every step runs under its own timeout, keeps its stderr in OUT_DIR/<step>.err
# and appends what it found to OUT_DIR/results.jsonl as it comes; a failed
# step is recorded and the next one runs (timings need neither the CUDA
# build nor the tests: Triton runs without nvcc).
#
#  1. versions: torch, Triton, CUDA, the device;
#  2. build: the CUDA extension for this device's architecture only;
#  3. graph_check.py at head 128, for the CUDA kernels then Triton's:
#     contexts 8k and 32k at batches 1 and 64 and 128k at batch 1,
#     mitigations none and boundary; per case: no host sync, equal to the
#     PyTorch path (small cases), CUDA-graph replay equal to eager, and
#     timings against SDPA over the full cache and the copy bandwidth;
#  4. checks: both kernels against the reference on small shapes, every
#     mitigation (benchmarks/gpu_kernels.py, no timings);
#  5. tests: the GPU-marked CUDA kernel tests;
#  6. head sizes 64 and 256 at 64 x 32k, while time remains.
#
# PYTHON names the interpreter (default: python3, else python).
# GPU_CHECK_DEVICE, GPU_CHECK_IMPLS, GPU_CHECK_CASES, GPU_CHECK_WIDE_CASES and GPU_CHECK_SHAPE (extra
# graph_check.py arguments) override the defaults: CI runs the script on CPU
# with tiny shapes so that it cannot rot.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/gpu_check.sh OUT_DIR}
mkdir -p "$out"
results="$out/results.jsonl"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-$(command -v python3 || command -v python)}  # GPU images often have python3 only
device=${GPU_CHECK_DEVICE:-cuda}
impls=${GPU_CHECK_IMPLS:-cuda,triton}
cases=${GPU_CHECK_CASES:-1x8192,64x8192,1x32768,64x32768,1x131072}
wide=${GPU_CHECK_WIDE_CASES:-64x32768}  # the cases of head sizes 64 and 256
shape=${GPU_CHECK_SHAPE:-}
budget=480  # seconds for the whole script
SECONDS=0

note() {  # note STEP RC [SECONDS]: one JSON line for a step's outcome
    printf '{"step": "%s", "rc": %s, "seconds": %s}\n' "$1" "$2" "${3:-$SECONDS}" >> "$results"
    echo "== $1: rc $2 (${SECONDS}s elapsed)"
}

left() { echo $((budget - SECONDS)); }

run() {  # run STEP LIMIT CMD...: CMD under min(LIMIT, time left), stderr kept, outcome noted
    local step=$1 limit=$2
    shift 2
    local rest
    rest=$(left)
    if [ "$rest" -le 10 ]; then note "$step" '"skipped: no time left"'; return; fi
    [ "$limit" -gt "$rest" ] && limit=$rest
    local began=$SECONDS
    timeout -k 5 "$limit" "$@" 2> "$out/$step.err"
    note "$step" $? $((SECONDS - began))
}

run versions 60 "$py" -c "
import json, platform, sys, torch
info = {'step': 'versions', 'torch': torch.__version__, 'cuda': torch.version.cuda, 'python': platform.python_version()}
try:
    import triton; info['triton'] = triton.__version__
except ImportError:
    info['triton'] = None
if torch.cuda.is_available():
    info.update(device=torch.cuda.get_device_name(), capability='%d.%d' % torch.cuda.get_device_capability())
open(sys.argv[1], 'a').write(json.dumps(info) + chr(10))" "$results"

if [ "$device" = cuda ]; then
    TORCH_CUDA_ARCH_LIST=$("$py" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())" 2>/dev/null)
    export TORCH_CUDA_ARCH_LIST CHUNKED_KV_BUILD_CUDA=1
fi
run build 240 "$py" -c "
import sys
from vllm_chunked_kv.ops import cuda_ext
m = cuda_ext.load()
print('extension:', 'built' if m else cuda_ext.unavailable_reasons(), file=sys.stderr)
sys.exit(m is None)"

IFS=, read -r -a impl_list <<< "$impls"
for impl in "${impl_list[@]}"; do
    # shellcheck disable=SC2086  # GPU_CHECK_SHAPE is a list of arguments
    run "graph_$impl" 150 "$py" benchmarks/graph_check.py --device "$device" --impl "$impl" --head-size 128 \
        --cases "$cases" --mitigations none,boundary --layers 2 --steps 8 --repeats 10 --case-timeout 40 \
        --jsonl "$results" $shape
done

run checks 90 "$py" benchmarks/gpu_kernels.py --device "$device" --impls "$impls" --mitigations none,boundary,overlap,stride2 \
    --contexts '' --batches '' --prefill-tokens 0 --repeats 3 --copy-bytes 67108864 --json "$out/checks.json"

run tests 120 "$py" -m pytest -q -rs -p no:cacheprovider tests/ops/test_cuda_ext.py -k gpu \
    --junitxml "$out/tests.xml"

for head in 64 256; do
    # shellcheck disable=SC2086
    run "graph_${impl_list[0]}_h$head" 60 "$py" benchmarks/graph_check.py --device "$device" --impl "${impl_list[0]}" \
        --head-size "$head" --cases "$wide" --mitigations none --layers 2 --steps 8 --repeats 10 \
        --case-timeout 40 --jsonl "$results" $shape
done
echo "== results in $results (${SECONDS}s)"
