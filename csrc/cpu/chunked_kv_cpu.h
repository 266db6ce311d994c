// The CPU kernels of the chunked KV ops over the compressed layout
// (vllm_chunked_kv/layout.py and grid.py, docs/design.md §3-4, §10): what
// ops/compressed.py `write_chunks` and `attend` compute, fused, read straight
// from the pages in the cache dtype with fp32 arithmetic.
//
// Free of torch headers: the kernels are compiled once per instruction set
// (chunked_kv_cpu_<isa>.cpp, each under its own `#pragma GCC target`, so no
// inline code of a wider instruction set can leak into the binding) and the
// binding (chunked_kv_cpu_ext.cpp) picks one table at run time from what the
// CPU supports. Index arrays are the int64 tensors of ops/step_plan.py.
#pragma once

#include <stdint.h>

#include "../common/chunked_kv_types.h"

namespace chunked_kv_cpu {

using namespace chunked_kv_types;  // DType, SlotKind, kBoundarySlots: shared with the other kernel family

constexpr int kBlockKeys = 32;     // key rows folded into the online softmax at a time
constexpr int kMaxTileRows = 128;  // query rows (queries x GQA group) of a multi-token tile
constexpr int kMaxChunk = 256;     // chunk_size limit of write_chunks (a stack buffer per chunk)

// Pool the chunks a step completes (`ChunkWrites`) into their compressed slots.
struct WriteArgs {
  const void* step_rows;  // [n, Hkv, head_d + head_dv], step dtype
  const void* raw_cache;  // [raw_blocks, Hkv, raw_rows, head_d + head_dv], cache dtype
  void* comp_cache;       // [comp_blocks, Hkv, comp_rows, head_d + head_dv], cache dtype
  const float* gains;     // [chunk_size] normalised fixed gains (unused for key_norm)
  const int64_t* heads;        // [M] KV head of each chunk
  const int64_t* src_blocks;   // [M, chunk_size] raw page of each stored row
  const int64_t* src_offsets;  // [M, chunk_size]
  const int64_t* src_step;     // [M, chunk_size] step token of each own row, -1 if stored
  const int64_t* dst_blocks;   // [M, slots_per_group]
  const int64_t* dst_offsets;  // [M, slots_per_group]
  int64_t num_chunks;
  int64_t stride_st, stride_sh;             // step rows: token, head
  int64_t stride_rb, stride_rh, stride_rs;  // raw pages: block, head, row
  int64_t stride_cb, stride_ch, stride_cs;  // compressed pages: block, head, row
  int head_d, head_dv, chunk_size, slots_per_group;
  int pool_lo, pool_hi;  // pooled slots [pool_lo, pool_hi)
  bool key_norm;
  DType step_dtype, cache_dtype;
  int num_threads;
};

// Attention of the queries of one `KeySet` over its stored raw rows, the
// step's own rows and its compressed slots.
struct AttendArgs {
  const float* query;     // [n, num_heads, head_d] fp32 (converted by the binding if needed)
  bool query_is_bf16;     // the fp32 queries hold bf16 values exactly (bf16 dot products allowed)
  const void* step_rows;  // [n, Hkv, head_d + head_dv], step dtype
  const void* raw_cache;  // cache dtype
  const void* comp_cache; // cache dtype
  void* out;              // [n, num_heads, head_dv], out dtype (num_splits == 1)
  float* part_acc;        // [num_splits, n, num_heads, head_dv] (num_splits > 1)
  float* part_ml;         // [2, num_splits, n, num_heads]: running max, then sum
  const int64_t* query_index;      // [num_rows, num_q]
  const int64_t* query_positions;  // [num_rows, num_q], consecutive within a row
  const int64_t* raw_blocks;       // [num_rows, max_raw]
  const int64_t* raw_offsets;      // [num_rows, max_raw]
  const int64_t* raw_positions;    // [num_rows, max_raw]
  const int64_t* num_raw;          // [num_rows]
  // Slot s of a row: page comp_blocks[s], row comp_offsets[s] ([num_rows,
  // max_slots] each); or, when comp_rows_per_page > 0, page
  // comp_blocks[s / comp_rows_per_page] of the row's page table ([num_rows,
  // max_slots / comp_rows_per_page]), row s % comp_rows_per_page (no offsets).
  const int64_t* comp_blocks;
  const int64_t* comp_offsets;
  const int64_t* num_slots;        // [num_rows]
  const int64_t* origins;          // [num_rows, num_kv_heads] grid origin of each request's KV heads
  int64_t num_rows, num_q, max_raw, max_slots, num_tokens, comp_rows_per_page;
  int64_t stride_qt, stride_qh, stride_st, stride_sh, stride_ot, stride_oh;
  int64_t stride_rb, stride_rh, stride_rs, stride_cb, stride_ch, stride_cs;
  int64_t window, sink_tokens;
  int num_heads, num_kv_heads, head_d, head_dv;
  int chunk_size, hop, slots_per_group;
  int tile_q, num_splits, num_threads;
  float scale, log_weight;
  float softcap;       // the model's logit cap: logit = softcap * tanh(logit / softcap); 0: none
  const float* sinks;  // [num_heads] the model's learned sink logits (in each softmax's denominator), or null
  int64_t lookback;    // the layer's own sliding window: a query at t reads position j only if t - j < lookback; 0: none
  DType step_dtype, cache_dtype, out_dtype;
  int64_t* pair_tiles;  // out, or null: += the tiles whose values took bf16 pair products (chunked_kv_cpu_bf16.h)
};

// Merge the split partials of attend into out [n, num_heads, head_dv].
struct MergeArgs {
  const float* part_acc;
  const float* part_ml;
  void* out;
  int64_t num_tokens, stride_ot, stride_oh;
  int num_heads, head_dv, num_splits, num_threads;
  DType out_dtype;
};

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
