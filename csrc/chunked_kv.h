// Launchers of the chunked KV kernels (DESIGN.md §3-4, §10), free of torch
// headers so that the kernels compile with nvcc alone. The torch binding
// (chunked_kv_ext.cpp) checks tensors and fills these structs.
#pragma once

#include <cuda_runtime_api.h>
#include <stdint.h>

namespace chunked_kv {

enum class DType : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

// Limits of these kernels (the dispatcher falls back to Triton beyond them).
constexpr int kMaxGroup = 8;      // query heads per KV head
constexpr int kMaxHeadSize = 256; // key and value widths
constexpr int kMaxChunk = 64;     // chunk_size

struct Pooling {
  const float* gains;  // [chunk_size] normalised fixed gains (unused for key_norm)
  int chunk_size;
  int hop;
  int pool_lo;  // pooled slots [pool_lo, pool_hi): the interior with keep_boundary
  int pool_hi;
  bool key_norm;
  float log_weight;  // logit bias of a pooled row
};

struct PoolArgs {
  const void* keys;    // [num_chunks, chunk_size, head_d], rows contiguous
  const void* values;  // [num_chunks, chunk_size, head_dv]
  float* key_out;      // [num_chunks, head_d]
  float* value_out;    // [num_chunks, head_dv]
  float* log_weight_out;  // [num_chunks]
  int64_t num_chunks;
  int64_t stride_kc, stride_ks, stride_vc, stride_vs;
  int head_d, head_dv;
  Pooling pooling;
};

struct AttendArgs {
  const void* query;  // [num_tokens, num_heads, head_d]
  const void* kv_cache;  // [num_blocks, num_kv_heads, block_size, head_d + head_dv]
  void* out;  // [num_tokens, num_heads, head_dv], query dtype
  float* part_acc;  // [num_splits, num_tokens, num_heads, head_dv] (num_splits > 1)
  float* part_ml;   // [2, num_splits, num_tokens, num_heads]: running max, then sum
  const int32_t* block_table;  // [num_reqs, max_blocks]
  const int32_t* token_req;    // [num_tokens] request of each query token
  const int32_t* query_start;  // [num_reqs + 1]
  const int32_t* seq_lens;     // [num_reqs]
  const int32_t* origins;      // [num_kv_heads] grid origin of each KV head
  int64_t stride_qt, stride_qh, stride_ot, stride_oh;
  int64_t stride_kb, stride_kh, stride_ks, stride_bt;
  int num_tokens, num_heads, num_kv_heads, head_d, head_dv, block_size, num_splits;
  float scale;
  int window, sink_tokens;
  bool keep_boundary;
  Pooling pooling;
};

// Both return cudaGetLastError() after the launch.
cudaError_t launch_pool(const PoolArgs& args, DType dtype, cudaStream_t stream);
cudaError_t launch_attend(const AttendArgs& args, DType dtype, cudaStream_t stream);

}  // namespace chunked_kv
