// What the two torch bindings (cuda/chunked_kv_ext.cpp for CUDA,
// cpu/chunked_kv_cpu_ext.cpp for the CPU) share: the tensor checks, and the
// filling of the kernels' argument structs (chunked_kv_args.h) from the
// tensors of a step's plan, written once here. Each binding passes its
// device check, `on_device(tensor, name)`, and then adds what only its own
// kernels need (CUDA: the dtypes it takes, the shared-memory limit, the
// stream; CPU: its tile and dtype limits, the OpenMP threads).
#pragma once

#include <ATen/ATen.h>

#include <limits>
#include <string>

#include "chunked_kv_args.h"

namespace chunked_kv_binding {

using at::Tensor;
using chunked_kv_types::AttendArgs;
using chunked_kv_types::DType;
using chunked_kv_types::MergeArgs;
using chunked_kv_types::WriteArgs;

// FP8 pages (vllm_chunked_kv/ops/fp8.py): vLLM's --kv-cache-dtype ("fp8", "fp8_e4m3", "fp8_e5m2") and the
// layer's scales; format "" for caches in the model's dtype. The caches are then uint8 tensors.
struct Pages {
  std::string format;
  double k_scale = 1.0, v_scale = 1.0;
};

inline DType fp8_dtype(const std::string& format) {
  if (format == "fp8" || format == "fp8_e4m3") return DType::kFloat8E4m3;
  TORCH_CHECK(format == "fp8_e5m2", "chunked_kv: unknown FP8 format ", format);
  return DType::kFloat8E5m2;
}

// A tensor's storage dtype: its own, or for bytes the FP8 format of the pages.
inline DType dtype_of(const Tensor& t, const char* name, const Pages& pages = {}) {
  if (t.scalar_type() == at::kByte && !pages.format.empty()) return fp8_dtype(pages.format);
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    default: TORCH_CHECK(false, "chunked_kv: ", name, " has unsupported dtype ", t.scalar_type());
  }
}

// Rows of K/V (or queries, outputs): `dim` dimensions, the last one contiguous.
inline void check_row_layout(const Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "chunked_kv: ", name, " must have ", dim, " dimensions, not ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, "chunked_kv: ", name, " must have contiguous rows (last-dim stride 1)");
}

// An int64 index table of `rows` x `cols` (cols < 0: one dimension of `rows`).
inline const int64_t* index_table(const Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "chunked_kv: ", name, " must be contiguous int64");
  const bool ok = cols < 0 ? t.dim() == 1 && t.size(0) == rows : t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
  TORCH_CHECK(ok, "chunked_kv: ", name, " has shape ", t.sizes(), ", expected [", rows, cols < 0 ? "" : ", ",
              cols < 0 ? "" : std::to_string(cols), "]");
  return t.data_ptr<int64_t>();
}

// A size, position or slot index as the argument structs hold it.
inline int to_int(int64_t value, const char* name) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), "chunked_kv: ", name, " = ", value,
              " is outside [0, 2^31)");
  return static_cast<int>(value);
}

// Token/head strides of the step's rows and block/head/row strides of both
// caches, into WriteArgs or AttendArgs.
template <typename Args>
void set_row_strides(Args& a, const Tensor& step_rows, const Tensor& raw_cache, const Tensor& comp_cache) {
  a.stride_st = step_rows.stride(0);
  a.stride_sh = step_rows.stride(1);
  a.stride_rb = raw_cache.stride(0);
  a.stride_rh = raw_cache.stride(1);
  a.stride_rs = raw_cache.stride(2);
  a.stride_cb = comp_cache.stride(0);
  a.stride_ch = comp_cache.stride(1);
  a.stride_cs = comp_cache.stride(2);
}

// The step rows' and caches' dtypes and the FP8 pages' scales, into WriteArgs or AttendArgs.
template <typename Args>
void set_pages(Args& a, const Tensor& step_rows, const Tensor& comp_cache, const Pages& pages) {
  a.step_dtype = dtype_of(step_rows, "step_rows", pages);
  a.cache_dtype = dtype_of(comp_cache, "comp_cache", pages);
  const bool fp8 = a.cache_dtype == DType::kFloat8E4m3 || a.cache_dtype == DType::kFloat8E5m2;
  TORCH_CHECK(fp8 || pages.format.empty(), "chunked_kv: FP8 pages must be uint8 tensors");
  TORCH_CHECK(pages.k_scale > 0 && pages.v_scale > 0, "chunked_kv: FP8 scales must be positive");
  a.key_scale = static_cast<float>(pages.k_scale);
  a.value_scale = static_cast<float>(pages.v_scale);
}

// Rows of `dim` dimensions on the binding's device.
template <typename OnDevice>
void check_rows(const OnDevice& on_device, const Tensor& t, const char* name, int64_t dim) {
  on_device(t, name);
  check_row_layout(t, name, dim);
}

// An int64 index table on the binding's device.
template <typename OnDevice>
const int64_t* index(const OnDevice& on_device, const Tensor& t, const char* name, int64_t rows, int64_t cols = -1) {
  on_device(t, name);
  return index_table(t, name, rows, cols);
}

// The split partials of attend: contiguous fp32 part_acc [splits, n, Hq, Dv], part_ml [2, splits, n, Hq].
template <typename OnDevice>
void check_partials(const OnDevice& on_device, const Tensor& part_acc, const Tensor& part_ml, int64_t num_splits,
                    int64_t n, int64_t num_heads, int64_t head_dv) {
  on_device(part_acc, "part_acc");
  on_device(part_ml, "part_ml");
  TORCH_CHECK(part_acc.scalar_type() == at::kFloat && part_acc.is_contiguous() &&
                  part_acc.sizes() == at::IntArrayRef({num_splits, n, num_heads, head_dv}),
              "chunked_kv: part_acc must be contiguous fp32 [splits, n, Hq, Dv]");
  TORCH_CHECK(part_ml.scalar_type() == at::kFloat && part_ml.is_contiguous() &&
                  part_ml.sizes() == at::IntArrayRef({2, num_splits, n, num_heads}),
              "chunked_kv: part_ml must be contiguous fp32 [2, splits, n, Hq]");
}

// WriteArgs of the chunks of a step's ChunkWrites (see ops/kernels/compressed.py
// write_chunks): caches [blocks, Hkv, rows, D + Dv], step rows [n, Hkv, D + Dv]
// with contiguous rows; every field but the CPU's thread count.
template <typename OnDevice>
WriteArgs write_args(const OnDevice& on_device, const Tensor& comp_cache, const Tensor& raw_cache,
                     const Tensor& step_rows, const Tensor& gains, const Tensor& heads, const Tensor& src_blocks,
                     const Tensor& src_offsets, const Tensor& src_step, const Tensor& dst_blocks,
                     const Tensor& dst_offsets, int64_t head_d, int64_t pool_lo, int64_t pool_hi, bool key_norm,
                     const Pages& pages = {}) {
  check_rows(on_device, comp_cache, "comp_cache", 4);
  check_rows(on_device, raw_cache, "raw_cache", 4);
  check_rows(on_device, step_rows, "step_rows", 3);
  TORCH_CHECK(raw_cache.scalar_type() == comp_cache.scalar_type(), "chunked_kv: the two caches differ in dtype");
  const int64_t width = comp_cache.size(3), num_kv_heads = comp_cache.size(1);
  TORCH_CHECK(raw_cache.size(3) == width && step_rows.size(2) == width && raw_cache.size(1) == num_kv_heads &&
                  step_rows.size(1) == num_kv_heads,
              "chunked_kv: caches and step rows must agree in KV heads and row width");
  TORCH_CHECK(0 < head_d && head_d < width, "chunked_kv: head_d must be in (0, row width)");
  const int64_t num_chunks = heads.numel(), chunk_size = src_blocks.dim() == 2 ? src_blocks.size(1) : 0;
  const int64_t slots_per_group = dst_blocks.dim() == 2 ? dst_blocks.size(1) : 0;
  TORCH_CHECK(chunk_size >= 1, "chunked_kv: src_blocks must be [chunks, chunk_size]");
  TORCH_CHECK(slots_per_group == 1 || (slots_per_group == chunked_kv_types::kBoundarySlots && chunk_size >= 2),
              "chunked_kv: dst_blocks must be [chunks, 1] or [chunks, 3]");
  TORCH_CHECK(0 <= pool_lo && pool_lo <= pool_hi && pool_hi <= chunk_size, "chunked_kv: bad pooled slots");
  on_device(gains, "gains");
  TORCH_CHECK(gains.scalar_type() == at::kFloat && gains.is_contiguous() && gains.numel() == chunk_size,
              "chunked_kv: gains must be contiguous fp32 of chunk_size elements");
  WriteArgs a{};
  a.heads = index(on_device, heads, "heads", num_chunks);
  a.src_blocks = index(on_device, src_blocks, "src_blocks", num_chunks, chunk_size);
  a.src_offsets = index(on_device, src_offsets, "src_offsets", num_chunks, chunk_size);
  a.src_step = index(on_device, src_step, "src_step", num_chunks, chunk_size);
  a.dst_blocks = index(on_device, dst_blocks, "dst_blocks", num_chunks, slots_per_group);
  a.dst_offsets = index(on_device, dst_offsets, "dst_offsets", num_chunks, slots_per_group);
  a.step_rows = step_rows.data_ptr();
  a.raw_cache = raw_cache.data_ptr();
  a.comp_cache = comp_cache.data_ptr();
  a.gains = gains.data_ptr<float>();
  a.num_chunks = num_chunks;
  set_row_strides(a, step_rows, raw_cache, comp_cache);
  a.head_d = to_int(head_d, "head_d");
  a.head_dv = to_int(width - head_d, "head_dv");
  a.chunk_size = to_int(chunk_size, "chunk_size");
  a.slots_per_group = static_cast<int>(slots_per_group);
  a.pool_lo = static_cast<int>(pool_lo);
  a.pool_hi = static_cast<int>(pool_hi);
  a.key_norm = key_norm;
  set_pages(a, step_rows, comp_cache, pages);
  return a;
}

// AttendArgs of the queries of one KeySet (see ops/kernels/compressed.py attend):
// query [n, Hq, D], step rows [n, Hkv, D + Dv], caches [blocks, Hkv, rows,
// D + Dv], out [n, Hq, Dv], all with contiguous rows; the partials are read
// only with num_splits > 1. comp_rows_per_page > 0 (CPU): comp_blocks is each
// row's page table and comp_offsets is not read. Every field but the CPU's
// query_is_bf16, thread count and pair_tiles; the dtypes' combination is the
// binding's to check.
template <typename OnDevice>
AttendArgs attend_args(const OnDevice& on_device, const Tensor& query, const Tensor& step_rows,
                       const Tensor& comp_cache, const Tensor& raw_cache, const Tensor& out, const Tensor& part_acc,
                       const Tensor& part_ml, const Tensor& query_index, const Tensor& query_positions,
                       const Tensor& raw_blocks, const Tensor& raw_offsets, const Tensor& raw_positions,
                       const Tensor& num_raw, const Tensor& comp_blocks, const Tensor& comp_offsets,
                       const Tensor& num_slots, int64_t comp_rows_per_page, const Tensor& origins, double scale,
                       double log_weight, int64_t window, int64_t sink_tokens, int64_t chunk_size, int64_t hop,
                       int64_t slots_per_group, int64_t tile_q, int64_t num_splits, double softcap,
                       const Tensor& sinks, int64_t lookback, const Pages& pages = {}) {
  check_rows(on_device, query, "query", 3);
  check_rows(on_device, step_rows, "step_rows", 3);
  check_rows(on_device, comp_cache, "comp_cache", 4);
  check_rows(on_device, raw_cache, "raw_cache", 4);
  check_rows(on_device, out, "out", 3);
  TORCH_CHECK(raw_cache.scalar_type() == comp_cache.scalar_type(), "chunked_kv: the two caches differ in dtype");
  const int64_t n = query.size(0), num_heads = query.size(1), head_d = query.size(2);
  const int64_t num_kv_heads = comp_cache.size(1), width = comp_cache.size(3), head_dv = width - head_d;
  TORCH_CHECK(num_heads % num_kv_heads == 0, "chunked_kv: ", num_heads, " query heads are not a multiple of ",
              num_kv_heads, " KV heads");
  TORCH_CHECK(head_dv >= 1 && raw_cache.size(3) == width && raw_cache.size(1) == num_kv_heads &&
                  step_rows.size(0) == n && step_rows.size(1) == num_kv_heads && step_rows.size(2) == width,
              "chunked_kv: query, step rows and caches disagree in shape");
  TORCH_CHECK(out.size(0) == n && out.size(1) == num_heads && out.size(2) == head_dv, "chunked_kv: out has shape ",
              out.sizes(), ", expected [", n, ", ", num_heads, ", ", head_dv, "]");
  TORCH_CHECK(chunk_size >= 1 && hop >= 1 &&
                  (slots_per_group == 1 || slots_per_group == chunked_kv_types::kBoundarySlots) && tile_q >= 1 &&
                  num_splits >= 1,
              "chunked_kv: bad chunk_size, hop, slots_per_group, tile_q or num_splits");
  TORCH_CHECK(comp_rows_per_page >= 0, "chunked_kv: comp_rows_per_page must be >= 0");
  const int64_t num_rows = query_index.size(0), num_q = query_index.dim() == 2 ? query_index.size(1) : 0;
  const int64_t max_raw = raw_blocks.dim() == 2 ? raw_blocks.size(1) : 0;
  const int64_t comp_cols = comp_blocks.dim() == 2 ? comp_blocks.size(1) : 0;
  const int64_t max_slots = comp_rows_per_page ? comp_cols * comp_rows_per_page : comp_cols;
  AttendArgs a{};
  a.query_index = index(on_device, query_index, "query_index", num_rows, num_q);
  a.query_positions = index(on_device, query_positions, "query_positions", num_rows, num_q);
  a.raw_blocks = index(on_device, raw_blocks, "raw_blocks", num_rows, max_raw);
  a.raw_offsets = index(on_device, raw_offsets, "raw_offsets", num_rows, max_raw);
  a.raw_positions = index(on_device, raw_positions, "raw_positions", num_rows, max_raw);
  a.num_raw = index(on_device, num_raw, "num_raw", num_rows);
  a.comp_blocks = index(on_device, comp_blocks, "comp_blocks", num_rows, comp_cols);
  a.comp_offsets =
      comp_rows_per_page ? nullptr : index(on_device, comp_offsets, "comp_offsets", num_rows, max_slots);
  a.num_slots = index(on_device, num_slots, "num_slots", num_rows);
  a.origins = index(on_device, origins, "origins", num_rows, num_kv_heads);
  if (num_splits > 1) {
    check_partials(on_device, part_acc, part_ml, num_splits, n, num_heads, head_dv);
    a.part_acc = part_acc.data_ptr<float>();
    a.part_ml = part_ml.data_ptr<float>();
  }
  a.query = query.data_ptr();
  a.step_rows = step_rows.data_ptr();
  a.raw_cache = raw_cache.data_ptr();
  a.comp_cache = comp_cache.data_ptr();
  a.out = out.data_ptr();
  a.num_rows = to_int(num_rows, "key-set rows");
  a.num_q = to_int(num_q, "queries per key-set row");
  a.max_raw = to_int(max_raw, "stored raw rows per key-set row");
  a.max_slots = to_int(max_slots, "slots per key-set row");
  a.num_tokens = n;
  a.comp_rows_per_page = comp_rows_per_page;
  a.stride_qt = query.stride(0);
  a.stride_qh = query.stride(1);
  a.stride_ot = out.stride(0);
  a.stride_oh = out.stride(1);
  set_row_strides(a, step_rows, raw_cache, comp_cache);
  a.window = to_int(window, "window");
  a.sink_tokens = to_int(sink_tokens, "sink_tokens");
  a.num_heads = to_int(num_heads, "query heads");
  a.num_kv_heads = to_int(num_kv_heads, "KV heads");
  a.head_d = to_int(head_d, "head_d");
  a.head_dv = to_int(head_dv, "head_dv");
  a.chunk_size = to_int(chunk_size, "chunk_size");
  a.hop = to_int(hop, "hop");
  a.slots_per_group = static_cast<int>(slots_per_group);
  a.tile_q = to_int(tile_q, "tile_q");
  a.num_splits = to_int(num_splits, "num_splits");
  a.scale = static_cast<float>(scale);
  a.log_weight = static_cast<float>(log_weight);
  TORCH_CHECK(softcap >= 0, "chunked_kv: softcap must be >= 0");
  a.softcap = static_cast<float>(softcap);
  if (sinks.numel()) {
    on_device(sinks, "sinks");
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == num_heads,
                "chunked_kv: sinks must be fp32 [num_heads]");
    a.sinks = sinks.data_ptr<float>();
  }
  TORCH_CHECK(lookback >= 0, "chunked_kv: lookback must be >= 0");
  a.lookback = to_int(lookback, "lookback");
  a.query_dtype = dtype_of(query, "query");
  set_pages(a, step_rows, comp_cache, pages);
  a.out_dtype = dtype_of(out, "out");
  return a;
}

// MergeArgs of attend's split partials into out [n, Hq, Dv]; every field but the CPU's thread count.
template <typename OnDevice>
MergeArgs merge_args(const OnDevice& on_device, const Tensor& part_acc, const Tensor& part_ml, const Tensor& out) {
  check_rows(on_device, out, "out", 3);
  const int64_t n = out.size(0), num_heads = out.size(1), head_dv = out.size(2);
  const int64_t num_splits = part_acc.dim() == 4 ? part_acc.size(0) : 0;
  TORCH_CHECK(num_splits >= 1, "chunked_kv: part_acc must be contiguous fp32 [splits, n, Hq, Dv]");
  check_partials(on_device, part_acc, part_ml, num_splits, n, num_heads, head_dv);
  MergeArgs a{};
  a.part_acc = part_acc.data_ptr<float>();
  a.part_ml = part_ml.data_ptr<float>();
  a.out = out.data_ptr();
  a.num_tokens = n;
  a.stride_ot = out.stride(0);
  a.stride_oh = out.stride(1);
  a.num_heads = to_int(num_heads, "query heads");
  a.head_dv = to_int(head_dv, "head_dv");
  a.num_splits = to_int(num_splits, "num_splits");
  a.out_dtype = dtype_of(out, "out");
  return a;
}

}  // namespace chunked_kv_binding
