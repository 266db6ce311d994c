// Launchers of the chunked KV kernels over the compressed layout
// (vllm_chunked_kv/core/layout.py and core/grid.py, docs/design.md §3-4,
// §10), free of torch headers so that the kernels compile with nvcc alone,
// or with a host compiler for the CPU emulation the tests use
// (CHUNKED_KV_CPU_EMULATION, cpu_emulation.h). Their arguments are the
// structs both kernel families share (common/chunked_kv_args.h), which the
// torch binding (chunked_kv_ext.cpp) fills through common/chunked_kv_binding.h;
// each launcher picks its kernel's instantiation from the dtypes they carry.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "../common/chunked_kv_args.h"

namespace chunked_kv {

using namespace chunked_kv_types;  // DType, SlotKind, kBoundarySlots, the argument structs: shared with the CPU kernels

constexpr int kThreads = 128;     // threads of every block
constexpr int kBlockKeys = 32;    // key rows an attention block folds in at a time
constexpr int kMaxTileRows = 32;  // query rows (queries x GQA group) of a multi-query tile, by default

// Dynamic shared memory of an attention block with `tile_rows` query rows.
size_t attend_shared_bytes(int tile_rows, int head_d, int head_dv);

// Each returns the launch's error (cudaSuccess when nothing was launched).
// write_chunks: step_dtype x cache_dtype; attend: query_dtype (= step and out
// dtypes) x cache_dtype; merge_splits: out_dtype. On FP8 pages the step rows
// are the step's stored bytes (step_dtype = cache_dtype), and the args' key
// and value scales apply.
cudaError_t launch_write_chunks(const WriteArgs& args, cudaStream_t stream);
cudaError_t launch_attend(const AttendArgs& args, cudaStream_t stream);
cudaError_t launch_merge_splits(const MergeArgs& args, cudaStream_t stream);

// (multiprocessors, opt-in shared memory per block in bytes) of a device.
cudaError_t device_limits(int device, int* multiprocessors, int* max_shared_bytes);
// What went wrong in a failed launch.
const char* error_string(cudaError_t err);

}  // namespace chunked_kv
