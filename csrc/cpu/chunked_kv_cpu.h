// The CPU kernels of the chunked KV ops over the compressed layout
// (vllm_chunked_kv/core/layout.py and core/grid.py, docs/design.md §3-4,
// §10): what ops/kernels/compressed.py `write_chunks` and `attend` compute,
// fused, read straight from the pages in the cache dtype with fp32
// arithmetic. Their arguments are the structs both kernel families share
// (common/chunked_kv_args.h), which the binding fills through
// common/chunked_kv_binding.h.
//
// Free of torch headers: the kernels are compiled once per instruction set
// (chunked_kv_cpu_<isa>.cpp, each under its own `#pragma GCC target`, so no
// inline code of a wider instruction set can leak into the binding) and the
// binding (chunked_kv_cpu_ext.cpp) picks one table at run time from what the
// CPU supports.
#pragma once

#include <stdint.h>

#include <atomic>

#include "../common/chunked_kv_args.h"

namespace chunked_kv_cpu {

using namespace chunked_kv_types;  // DType, SlotKind, kBoundarySlots, the argument structs: shared with CUDA

constexpr int kBlockKeys = 32;     // key rows folded into the online softmax at a time
constexpr int kMaxTileRows = 128;  // query rows (queries x GQA group) of a multi-token tile
constexpr int kMaxChunk = 256;     // chunk_size limit of write_chunks (a stack buffer per chunk)

// One instruction set's kernels.
struct KernelTable {
  const char* isa;  // "avx512bf16", "avx512", "avx2" or "scalar"
  void (*write_chunks)(const WriteArgs&);
  void (*attend)(const AttendArgs&);
  void (*merge_splits)(const MergeArgs&);
};

// Matrix products through a library: oneDNN's batch-reduce GEMM as ATen
// exposes it (at::native::cpublas::brgemm), which runs on the matrix units
// (AMX) where the CPU has them. The binding fills it; the kernels, free of
// torch headers, call it for the query x key and probability x value
// products of multi-token bf16 tiles (chunked_kv_cpu_library.h).
// C[M, N] (+)= A[M, K] . B[K, N], bf16 in, fp32 out, row-major with leading
// dimensions lda, ldb, ldc; B in VNNI pairs [K / 2][N][2] when `vnni`.
struct LibraryGemm {
  void (*bf16)(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
               const uint16_t* a, const uint16_t* b, float* c, bool vnni);
  void (*release)(bool vnni);  // frees the thread's matrix-unit state after its products
  bool vnni;
};
extern const LibraryGemm* g_library;       // null: the hand-written tiles for every product
extern std::atomic<int64_t> g_library_tiles;  // tiles whose products went through the library

extern const KernelTable kAvx512Bf16Table;
extern const KernelTable kAvx512Table;
extern const KernelTable kAvx2Table;
extern const KernelTable kScalarTable;

}  // namespace chunked_kv_cpu
