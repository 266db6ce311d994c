// Launchers of the chunked KV kernels over the compressed layout
// (vllm_chunked_kv/layout.py and grid.py, docs/design.md §3-4, §10), free of torch headers so
// that the kernels compile with nvcc alone, or with a host compiler for the
// CPU emulation the tests use (CHUNKED_KV_CPU_EMULATION, cpu_emulation.h).
// The torch binding (chunked_kv_ext.cpp) checks tensors and fills these
// structs; index arrays are the int64 tensors of ops/step_plan.py.
#pragma once

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#include "../common/chunked_kv_types.h"

namespace chunked_kv {

using namespace chunked_kv_types;  // DType, SlotKind, kBoundarySlots: shared with the other kernel family

constexpr int kThreads = 128;     // threads of every block
constexpr int kBlockKeys = 32;    // key rows an attention block folds in at a time
constexpr int kMaxTileRows = 32;  // query rows (queries x GQA group) of a multi-query tile, by default

// Pool the chunks a step completes (`ChunkWrites`) into their compressed slots.
struct WriteArgs {
  const void* step_rows;  // [n, Hkv, head_d + head_dv] the step's K/V, step dtype
  const void* raw_cache;  // [raw_blocks, Hkv, raw_rows, head_d + head_dv], cache dtype
  void* comp_cache;       // [comp_blocks, Hkv, comp_rows, head_d + head_dv], cache dtype
  const float* gains;     // [chunk_size] normalised fixed gains (unused for key_norm)
  const int64_t* heads;   // [num_chunks] KV head of each chunk
  const int64_t* src_blocks;   // [num_chunks, chunk_size] raw page of each stored row
  const int64_t* src_offsets;  // [num_chunks, chunk_size]
  const int64_t* src_step;     // [num_chunks, chunk_size] step token of each own row, -1 if stored
  const int64_t* dst_blocks;   // [num_chunks, slots_per_group] compressed page of each slot
  const int64_t* dst_offsets;  // [num_chunks, slots_per_group]
  int64_t num_chunks;
  int64_t stride_st, stride_sh;                // step rows: token, head
  int64_t stride_rb, stride_rh, stride_rs;     // raw pages: block, head, row
  int64_t stride_cb, stride_ch, stride_cs;     // compressed pages: block, head, row
  int head_d, head_dv, chunk_size, slots_per_group;
  int pool_lo, pool_hi;  // pooled slots [pool_lo, pool_hi): the interior with keep_boundary
  bool key_norm;
};

// Attention of the queries of one `KeySet` over its stored raw rows, the
// step's own rows and its compressed slots, one online softmax per query row.
struct AttendArgs {
  const void* query;      // [num_tokens, num_heads, head_d], query dtype
  const void* step_rows;  // [num_tokens, num_kv_heads, head_d + head_dv], query dtype
  const void* raw_cache;  // [raw_blocks, num_kv_heads, raw_rows, head_d + head_dv], cache dtype
  const void* comp_cache; // [comp_blocks, num_kv_heads, comp_rows, head_d + head_dv], cache dtype
  void* out;              // [num_tokens, num_heads, head_dv], query dtype (num_splits == 1)
  float* part_acc;        // [num_splits, num_tokens, num_heads, head_dv] (num_splits > 1)
  float* part_ml;         // [2, num_splits, num_tokens, num_heads]: running max, then sum
  const int64_t* query_index;      // [num_rows, num_q] step token of each query
  const int64_t* query_positions;  // [num_rows, num_q] consecutive positions
  const int64_t* raw_blocks;       // [num_rows, max_raw]
  const int64_t* raw_offsets;      // [num_rows, max_raw]
  const int64_t* raw_positions;    // [num_rows, max_raw]
  const int64_t* num_raw;          // [num_rows] stored raw rows (padding follows)
  const int64_t* comp_blocks;      // [num_rows, max_slots]
  const int64_t* comp_offsets;     // [num_rows, max_slots]
  const int64_t* num_slots;        // [num_rows] slots that may be visible
  const int64_t* origins;          // [num_rows, num_kv_heads] grid origin of each request's KV heads
  int num_rows, num_q, max_raw, max_slots;
  int64_t num_tokens;
  int64_t stride_qt, stride_qh, stride_st, stride_sh, stride_ot, stride_oh;
  int64_t stride_rb, stride_rh, stride_rs, stride_cb, stride_ch, stride_cs;
  int window, sink_tokens;  // positions and slot indices are below 2^31
  int num_heads, num_kv_heads, head_d, head_dv;
  int chunk_size, hop, slots_per_group;
  int tile_q;       // queries of one block
  int num_splits;   // blocks per (tile, KV head), each folding every num_splits-th key block
  float scale, log_weight;
  float softcap;       // the model's logit cap: logit = softcap * tanh(logit / softcap); 0: none
  const float* sinks;  // [num_heads] the model's learned sink logits (in each softmax's denominator), or null
  int lookback;        // the layer's own sliding window: a query at t reads position j only if t - j < lookback; 0: none
};

// Merge the split partials of attend into out [num_tokens, num_heads, head_dv].
struct MergeArgs {
  const float* part_acc;  // [num_splits, num_tokens, num_heads, head_dv]
  const float* part_ml;   // [2, num_splits, num_tokens, num_heads]
  void* out;
  int64_t num_tokens, stride_ot, stride_oh;
  int num_heads, head_dv, num_splits;
};

// Dynamic shared memory of an attention block with `tile_rows` query rows.
size_t attend_shared_bytes(int tile_rows, int head_d, int head_dv);

// Each returns the launch's error (cudaSuccess when nothing was launched).
cudaError_t launch_write_chunks(const WriteArgs& args, DType step_dtype, DType cache_dtype, cudaStream_t stream);
cudaError_t launch_attend(const AttendArgs& args, DType query_dtype, DType cache_dtype, cudaStream_t stream);
cudaError_t launch_merge_splits(const MergeArgs& args, DType out_dtype, cudaStream_t stream);

// (multiprocessors, opt-in shared memory per block in bytes) of a device.
cudaError_t device_limits(int device, int* multiprocessors, int* max_shared_bytes);
// What went wrong in a failed launch.
const char* error_string(cudaError_t err);

}  // namespace chunked_kv
