// Values both kernel families (CUDA: cuda/chunked_kv.h, CPU:
// cpu/chunked_kv_cpu.h) share with the Python side: the storage dtypes, and
// the grid's slot kinds (vllm_chunked_kv/core/grid.py SlotKind,
// BOUNDARY_SLOTS). No torch, no CUDA. The kernels' argument structs, in the
// same namespace, are in chunked_kv_args.h.
#pragma once

namespace chunked_kv_types {

// kFloat8*: FP8 pages (vllm_chunked_kv/ops/fp8.py), bytes read with a scale per page set.
enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2, kFloat8E4m3 = 3, kFloat8E5m2 = 4 };

// What compressed slot s of a group of slots_per_group holds.
enum SlotKind : int { kPooled = 0, kFirst = 1, kLast = 2 };
constexpr int kBoundarySlots = 3;  // slots per chunk with boundary retention (1 without)

}  // namespace chunked_kv_types
