// Torch binding of the chunked KV kernels: checks the tensors, fills the
// launcher structs of chunked_kv.h and launches on the current CUDA stream.
// Built on demand by vllm_chunked_kv/ops/kernels/cuda_ext.py, which turns a step's
// `StepPlan` into these calls. With CHUNKED_KV_CPU_EMULATION (tests only)
// the tensors are CPU tensors and the kernels run in cpu_emulation.h.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <limits>
#include <tuple>

#ifndef CHUNKED_KV_CPU_EMULATION
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "chunked_kv.h"
#include "../common/chunked_kv_binding.h"

namespace {

using at::Tensor;

using chunked_kv_binding::dtype_of;
using chunked_kv_binding::set_row_strides;

void check_device(const Tensor& t, const Tensor& like, const char* name) {
#ifdef CHUNKED_KV_CPU_EMULATION
  TORCH_CHECK(t.is_cpu(), "chunked_kv (CPU emulation): ", name, " must be a CPU tensor");
#else
  TORCH_CHECK(t.is_cuda(), "chunked_kv: ", name, " must be a CUDA tensor");
#endif
  TORCH_CHECK(t.device() == like.device(), "chunked_kv: ", name, " is on ", t.device(), ", not ", like.device());
}

// Rows of K/V (or queries, outputs) on the device of `like`.
void check_rows(const Tensor& t, const Tensor& like, const char* name, int64_t dim) {
  check_device(t, like, name);
  chunked_kv_binding::check_row_layout(t, name, dim);
}

// An int64 index table on the device of `like`.
const int64_t* index(const Tensor& t, const Tensor& like, const char* name, int64_t rows, int64_t cols = -1) {
  check_device(t, like, name);
  return chunked_kv_binding::index_table(t, name, rows, cols);
}

int to_int(int64_t value, const char* name) {
  TORCH_CHECK(value >= 0 && value <= std::numeric_limits<int>::max(), "chunked_kv: ", name, " = ", value,
              " is outside [0, 2^31)");
  return static_cast<int>(value);
}

cudaStream_t current_stream(const Tensor& t) {
#ifdef CHUNKED_KV_CPU_EMULATION
  (void)t;
  return nullptr;
#else
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
#endif
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "chunked_kv: kernel launch failed: ", chunked_kv::error_string(err));
}

#ifdef CHUNKED_KV_CPU_EMULATION
struct DeviceGuard {
  explicit DeviceGuard(at::Device) {}
};
#else
using DeviceGuard = c10::cuda::CUDAGuard;
#endif

}  // namespace

// Pool the chunks of a step's ChunkWrites into the compressed pages (see
// compressed.write_chunks); the zero slots are the caller's.
void write_chunks(const Tensor& comp_cache, const Tensor& raw_cache, const Tensor& step_rows, const Tensor& gains,
                  const Tensor& heads, const Tensor& src_blocks, const Tensor& src_offsets, const Tensor& src_step,
                  const Tensor& dst_blocks, const Tensor& dst_offsets, int64_t head_d, int64_t pool_lo,
                  int64_t pool_hi, bool key_norm) {
  check_rows(comp_cache, comp_cache, "comp_cache", 4);
  check_rows(raw_cache, comp_cache, "raw_cache", 4);
  check_rows(step_rows, comp_cache, "step_rows", 3);
  TORCH_CHECK(raw_cache.scalar_type() == comp_cache.scalar_type(), "chunked_kv: the two caches differ in dtype");
  const int64_t width = comp_cache.size(3), num_kv_heads = comp_cache.size(1);
  TORCH_CHECK(raw_cache.size(3) == width && step_rows.size(2) == width && raw_cache.size(1) == num_kv_heads &&
                  step_rows.size(1) == num_kv_heads,
              "chunked_kv: caches and step rows must agree in KV heads and row width");
  TORCH_CHECK(0 < head_d && head_d < width, "chunked_kv: head_d must be in (0, row width)");
  const int64_t num_chunks = heads.numel(), chunk_size = src_blocks.dim() == 2 ? src_blocks.size(1) : 0;
  const int64_t slots_per_group = dst_blocks.dim() == 2 ? dst_blocks.size(1) : 0;
  TORCH_CHECK(chunk_size >= 1, "chunked_kv: src_blocks must be [chunks, chunk_size]");
  TORCH_CHECK(slots_per_group == 1 || (slots_per_group == chunked_kv::kBoundarySlots && chunk_size >= 2),
              "chunked_kv: dst_blocks must be [chunks, 1] or [chunks, 3]");
  TORCH_CHECK(0 <= pool_lo && pool_lo <= pool_hi && pool_hi <= chunk_size, "chunked_kv: bad pooled slots");
  check_device(gains, comp_cache, "gains");
  TORCH_CHECK(gains.scalar_type() == at::kFloat && gains.is_contiguous() && gains.numel() == chunk_size,
              "chunked_kv: gains must be contiguous fp32 of chunk_size elements");
  chunked_kv::WriteArgs a{};
  a.heads = index(heads, comp_cache, "heads", num_chunks);
  a.src_blocks = index(src_blocks, comp_cache, "src_blocks", num_chunks, chunk_size);
  a.src_offsets = index(src_offsets, comp_cache, "src_offsets", num_chunks, chunk_size);
  a.src_step = index(src_step, comp_cache, "src_step", num_chunks, chunk_size);
  a.dst_blocks = index(dst_blocks, comp_cache, "dst_blocks", num_chunks, slots_per_group);
  a.dst_offsets = index(dst_offsets, comp_cache, "dst_offsets", num_chunks, slots_per_group);
  if (num_chunks == 0) return;
  const DeviceGuard guard(comp_cache.device());
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
  check_launch(chunked_kv::launch_write_chunks(a, dtype_of(step_rows, "step_rows"), dtype_of(comp_cache, "comp_cache"),
                                               current_stream(comp_cache)));
}

// Attention of the queries of one KeySet (see compressed.attend). With
// num_splits == 1 it writes `out` [n, Hq, Dv] (query dtype); else the fp32
// partials part_acc [S, n, Hq, Dv] and part_ml [2, S, n, Hq] for merge_splits.
void attend(const Tensor& query, const Tensor& step_rows, const Tensor& comp_cache, const Tensor& raw_cache,
            const Tensor& out, const Tensor& part_acc, const Tensor& part_ml, const Tensor& query_index,
            const Tensor& query_positions, const Tensor& raw_blocks, const Tensor& raw_offsets,
            const Tensor& raw_positions, const Tensor& num_raw, const Tensor& comp_blocks, const Tensor& comp_offsets,
            const Tensor& num_slots, const Tensor& origins, double scale, double log_weight, int64_t window,
            int64_t sink_tokens, int64_t chunk_size, int64_t hop, int64_t slots_per_group,
            int64_t tile_q, int64_t num_splits, double softcap, const Tensor& sinks, int64_t lookback) {
  check_rows(query, query, "query", 3);
  check_rows(step_rows, query, "step_rows", 3);
  check_rows(comp_cache, query, "comp_cache", 4);
  check_rows(raw_cache, query, "raw_cache", 4);
  check_rows(out, query, "out", 3);
  TORCH_CHECK(step_rows.scalar_type() == query.scalar_type() && out.scalar_type() == query.scalar_type(),
              "chunked_kv: query, step_rows and out must share a dtype");
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
  TORCH_CHECK(chunk_size >= 1 && hop >= 1 && (slots_per_group == 1 || slots_per_group == chunked_kv::kBoundarySlots) && tile_q >= 1 &&
                  num_splits >= 1,
              "chunked_kv: bad chunk_size, hop, slots_per_group, tile_q or num_splits");
  const int64_t num_rows = query_index.size(0), num_q = query_index.dim() == 2 ? query_index.size(1) : 0;
  const int64_t max_raw = raw_blocks.dim() == 2 ? raw_blocks.size(1) : 0;
  const int64_t max_slots = comp_blocks.dim() == 2 ? comp_blocks.size(1) : 0;
  chunked_kv::AttendArgs a{};
  a.query_index = index(query_index, query, "query_index", num_rows, num_q);
  a.query_positions = index(query_positions, query, "query_positions", num_rows, num_q);
  a.raw_blocks = index(raw_blocks, query, "raw_blocks", num_rows, max_raw);
  a.raw_offsets = index(raw_offsets, query, "raw_offsets", num_rows, max_raw);
  a.raw_positions = index(raw_positions, query, "raw_positions", num_rows, max_raw);
  a.num_raw = index(num_raw, query, "num_raw", num_rows);
  a.comp_blocks = index(comp_blocks, query, "comp_blocks", num_rows, max_slots);
  a.comp_offsets = index(comp_offsets, query, "comp_offsets", num_rows, max_slots);
  a.num_slots = index(num_slots, query, "num_slots", num_rows);
  a.origins = index(origins, query, "origins", num_rows, num_kv_heads);
  if (num_splits > 1) {
    check_device(part_acc, query, "part_acc");
    check_device(part_ml, query, "part_ml");
    TORCH_CHECK(part_acc.scalar_type() == at::kFloat && part_acc.is_contiguous() &&
                    part_acc.sizes() == at::IntArrayRef({num_splits, n, num_heads, head_dv}),
                "chunked_kv: part_acc must be contiguous fp32 [splits, n, Hq, Dv]");
    TORCH_CHECK(part_ml.scalar_type() == at::kFloat && part_ml.is_contiguous() &&
                    part_ml.sizes() == at::IntArrayRef({2, num_splits, n, num_heads}),
                "chunked_kv: part_ml must be contiguous fp32 [2, splits, n, Hq]");
    a.part_acc = part_acc.data_ptr<float>();
    a.part_ml = part_ml.data_ptr<float>();
  }
  if (num_rows == 0 || num_q == 0) return;
  const DeviceGuard guard(query.device());
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
    TORCH_CHECK(sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == a.num_heads &&
                    sinks.device() == query.device(),
                "chunked_kv: sinks must be fp32 [num_heads] on the query's device");
    a.sinks = sinks.data_ptr<float>();
  }
  TORCH_CHECK(lookback >= 0, "chunked_kv: lookback must be >= 0");
  a.lookback = to_int(lookback, "lookback");
  int multiprocessors = 0, max_shared = 0;
  check_launch(chunked_kv::device_limits(query.device().index(), &multiprocessors, &max_shared));
  const size_t shared = chunked_kv::attend_shared_bytes(a.tile_q * (a.num_heads / a.num_kv_heads), a.head_d, a.head_dv);
  TORCH_CHECK(shared <= static_cast<size_t>(max_shared), "chunked_kv: a tile of ", a.tile_q, " queries x ",
              a.num_heads / a.num_kv_heads, " heads needs ", shared, " bytes of shared memory; the device allows ",
              max_shared);
  check_launch(chunked_kv::launch_attend(a, dtype_of(query, "query"), dtype_of(comp_cache, "comp_cache"),
                                         current_stream(query)));
}

// Merge the split partials of attend into out [n, Hq, Dv].
void merge_splits(const Tensor& part_acc, const Tensor& part_ml, const Tensor& out) {
  check_rows(out, out, "out", 3);
  check_device(part_acc, out, "part_acc");
  check_device(part_ml, out, "part_ml");
  const int64_t n = out.size(0), num_heads = out.size(1), head_dv = out.size(2);
  const int64_t num_splits = part_acc.dim() == 4 ? part_acc.size(0) : 0;
  TORCH_CHECK(num_splits >= 1 && part_acc.scalar_type() == at::kFloat && part_acc.is_contiguous() &&
                  part_acc.sizes() == at::IntArrayRef({num_splits, n, num_heads, head_dv}),
              "chunked_kv: part_acc must be contiguous fp32 [splits, n, Hq, Dv]");
  TORCH_CHECK(part_ml.scalar_type() == at::kFloat && part_ml.is_contiguous() &&
                  part_ml.sizes() == at::IntArrayRef({2, num_splits, n, num_heads}),
              "chunked_kv: part_ml must be contiguous fp32 [2, splits, n, Hq]");
  if (n == 0) return;
  const DeviceGuard guard(out.device());
  chunked_kv::MergeArgs a{};
  a.part_acc = part_acc.data_ptr<float>();
  a.part_ml = part_ml.data_ptr<float>();
  a.out = out.data_ptr();
  a.num_tokens = n;
  a.stride_ot = out.stride(0);
  a.stride_oh = out.stride(1);
  a.num_heads = to_int(num_heads, "query heads");
  a.head_dv = to_int(head_dv, "head_dv");
  a.num_splits = to_int(num_splits, "num_splits");
  check_launch(chunked_kv::launch_merge_splits(a, dtype_of(out, "out"), current_stream(out)));
}

// Shared memory of an attention block of `tile_rows` query rows, in bytes.
int64_t attend_shared_bytes(int64_t tile_rows, int64_t head_d, int64_t head_dv) {
  return static_cast<int64_t>(chunked_kv::attend_shared_bytes(to_int(tile_rows, "tile_rows"), to_int(head_d, "head_d"),
                                                              to_int(head_dv, "head_dv")));
}

// (multiprocessors, opt-in shared memory per block in bytes) of CUDA device `device`.
std::tuple<int64_t, int64_t> device_limits(int64_t device) {
  int multiprocessors = 0, max_shared = 0;
  check_launch(chunked_kv::device_limits(static_cast<int>(device), &multiprocessors, &max_shared));
  return {multiprocessors, max_shared};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_chunks", &write_chunks, "Pool a step's completed chunks into the compressed pages");
  m.def("attend", &attend, "Chunked attention of one key set over the compressed layout");
  m.def("merge_splits", &merge_splits, "Merge the split partials of attend");
  m.def("attend_shared_bytes", &attend_shared_bytes, "Shared memory of an attention block");
  m.def("device_limits", &device_limits, "(multiprocessors, opt-in shared memory per block)");
  m.attr("BLOCK_KEYS") = chunked_kv::kBlockKeys;
  m.attr("MAX_TILE_ROWS") = chunked_kv::kMaxTileRows;
#ifdef CHUNKED_KV_CPU_EMULATION
  m.attr("EMULATED") = true;
#else
  m.attr("EMULATED") = false;
#endif
}
