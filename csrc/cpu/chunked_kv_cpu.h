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

extern const KernelTable kAvx512Bf16Table;
extern const KernelTable kAvx512Table;
extern const KernelTable kAvx2Table;
extern const KernelTable kScalarTable;

}  // namespace chunked_kv_cpu
