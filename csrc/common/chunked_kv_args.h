// The arguments of the chunked KV kernels, one definition for both families
// (CUDA: cuda/chunked_kv.h, CPU: cpu/chunked_kv_cpu.h), filled from torch
// tensors once, in common/chunked_kv_binding.h. Free of torch and CUDA
// headers: nvcc, the host compiler of the CUDA emulation and the CPU
// kernels' instruction-set units all include it.
//
// Sizes, positions and slot indices are int (the binding checks each is
// below 2^31): the CUDA kernels keep their index arithmetic in 32 bits, and
// the CPU kernels widen them where they meet int64 offsets. Index arrays are
// the int64 tensors of vllm_chunked_kv/ops/plans/step_plan.py (`ChunkWrites`,
// `KeySet`). A field marked "CPU" is read by the CPU kernels only (the CUDA
// binding leaves it at its zero value).
#pragma once

#include <stdint.h>

#include "chunked_kv_types.h"

namespace chunked_kv_types {

// Pool the chunks a step completes (`ChunkWrites`) into their compressed slots.
struct WriteArgs {
  const void* step_rows;  // [n, Hkv, head_d + head_dv] the step's K/V, step dtype
  const void* raw_cache;  // [raw_blocks, Hkv, raw_rows, head_d + head_dv], cache dtype
  void* comp_cache;       // [comp_blocks, Hkv, comp_rows, head_d + head_dv], cache dtype
  const float* gains;     // [chunk_size] normalised fixed gains (unused for key_norm)
  const int64_t* heads;        // [num_chunks] KV head of each chunk
  const int64_t* src_blocks;   // [num_chunks, chunk_size] raw page of each stored row
  const int64_t* src_offsets;  // [num_chunks, chunk_size]
  const int64_t* src_step;     // [num_chunks, chunk_size] step token of each own row, -1 if stored
  const int64_t* dst_blocks;   // [num_chunks, slots_per_group] compressed page of each slot
  const int64_t* dst_offsets;  // [num_chunks, slots_per_group]
  int64_t num_chunks;
  int64_t stride_st, stride_sh;             // step rows: token, head
  int64_t stride_rb, stride_rh, stride_rs;  // raw pages: block, head, row
  int64_t stride_cb, stride_ch, stride_cs;  // compressed pages: block, head, row
  int head_d, head_dv, chunk_size, slots_per_group;
  int pool_lo, pool_hi;  // pooled slots [pool_lo, pool_hi): the interior with keep_boundary
  bool key_norm;
  DType step_dtype, cache_dtype;
  // FP8 pages: a stored key element times key_scale is the key (values: value_scale); 1 otherwise.
  float key_scale, value_scale;
  int num_threads;  // CPU: OpenMP threads
};

// Attention of the queries of one `KeySet` over its stored raw rows, the
// step's own rows and its compressed slots, one online softmax per query row.
struct AttendArgs {
  const void* query;      // [num_tokens, num_heads, head_d], query dtype (fp32 on CPU)
  const void* step_rows;  // [num_tokens, num_kv_heads, head_d + head_dv], step dtype
  const void* raw_cache;  // [raw_blocks, num_kv_heads, raw_rows, head_d + head_dv], cache dtype
  const void* comp_cache; // [comp_blocks, num_kv_heads, comp_rows, head_d + head_dv], cache dtype
  void* out;              // [num_tokens, num_heads, head_dv], out dtype (num_splits == 1)
  float* part_acc;        // [num_splits, num_tokens, num_heads, head_dv] (num_splits > 1)
  float* part_ml;         // [2, num_splits, num_tokens, num_heads]: running max, then sum
  const int64_t* query_index;      // [num_rows, num_q] step token of each query
  const int64_t* query_positions;  // [num_rows, num_q] consecutive positions
  const int64_t* raw_blocks;       // [num_rows, max_raw]
  const int64_t* raw_offsets;      // [num_rows, max_raw]
  const int64_t* raw_positions;    // [num_rows, max_raw]
  const int64_t* num_raw;          // [num_rows] stored raw rows (padding follows)
  // Slot s of a row: page comp_blocks[s], row comp_offsets[s] ([num_rows,
  // max_slots] each); or (CPU), when comp_rows_per_page > 0, page
  // comp_blocks[s / comp_rows_per_page] of the row's page table ([num_rows,
  // max_slots / comp_rows_per_page]), row s % comp_rows_per_page (no offsets).
  const int64_t* comp_blocks;
  const int64_t* comp_offsets;
  const int64_t* num_slots;        // [num_rows] slots that may be visible
  const int64_t* origins;          // [num_rows, num_kv_heads] grid origin of each request's KV heads
  int num_rows, num_q, max_raw, max_slots;
  int64_t num_tokens, comp_rows_per_page;
  int64_t stride_qt, stride_qh, stride_st, stride_sh, stride_ot, stride_oh;
  int64_t stride_rb, stride_rh, stride_rs, stride_cb, stride_ch, stride_cs;
  int window, sink_tokens;
  int num_heads, num_kv_heads, head_d, head_dv;
  int chunk_size, hop, slots_per_group;
  int tile_q;       // queries of one tile
  int num_splits;   // work items per (tile, KV head), each over its share of the keys
  float scale, log_weight;
  float softcap;       // the model's logit cap: logit = softcap * tanh(logit / softcap); 0: none
  const float* sinks;  // [num_heads] the model's learned sink logits (in each softmax's denominator), or null
  int lookback;        // the layer's own sliding window: a query at t reads j only if t - j < lookback; 0: none
  DType query_dtype, step_dtype, cache_dtype, out_dtype;
  // FP8 pages: a stored key element times key_scale is the key (values: value_scale), the step's own
  // rows included (they are passed as their stored bytes); 1 otherwise.
  float key_scale, value_scale;
  bool query_is_bf16;   // CPU: the fp32 queries hold bf16 values exactly (bf16 dot products allowed)
  int num_threads;      // CPU: OpenMP threads
  int64_t* pair_tiles;  // CPU: out or null: += tiles whose values took bf16 pair products (chunked_kv_cpu_bf16.h)
};

// Merge the split partials of attend into out [num_tokens, num_heads, head_dv].
struct MergeArgs {
  const float* part_acc;  // [num_splits, num_tokens, num_heads, head_dv]
  const float* part_ml;   // [2, num_splits, num_tokens, num_heads]
  void* out;
  int64_t num_tokens, stride_ot, stride_oh;
  int num_heads, head_dv, num_splits;
  DType out_dtype;
  int num_threads;  // CPU: OpenMP threads
};

}  // namespace chunked_kv_types
