// Torch binding of the chunked KV kernels: checks the tensors, fills the
// argument structs (common/chunked_kv_args.h, through the helpers the CPU
// binding shares, common/chunked_kv_binding.h) and launches on the current
// CUDA stream. Built on demand by vllm_chunked_kv/ops/kernels/cuda_ext.py,
// which turns a step's `StepPlan` into these calls. With
// CHUNKED_KV_CPU_EMULATION (tests only) the tensors are CPU tensors and the
// kernels run in cpu_emulation.h.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <string>
#include <tuple>

#ifndef CHUNKED_KV_CPU_EMULATION
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include "../common/chunked_kv_binding.h"
#include "chunked_kv.h"

namespace {

using at::Tensor;

using chunked_kv_types::DType;
using chunked_kv_binding::to_int;

bool is_fp8(DType t) { return t == DType::kFloat8E4m3 || t == DType::kFloat8E5m2; }

// On FP8 pages the kernels read the step's rows as the pages' bytes.
void check_fp8_step(DType step, DType cache) {
  TORCH_CHECK(!is_fp8(cache) || step == cache, "chunked_kv: on FP8 pages step_rows must be the step's stored bytes "
                                               "(uint8)");
}

void check_device(const Tensor& t, const Tensor& like, const char* name) {
#ifdef CHUNKED_KV_CPU_EMULATION
  TORCH_CHECK(t.is_cpu(), "chunked_kv (CPU emulation): ", name, " must be a CPU tensor");
#else
  TORCH_CHECK(t.is_cuda(), "chunked_kv: ", name, " must be a CUDA tensor");
#endif
  TORCH_CHECK(t.device() == like.device(), "chunked_kv: ", name, " is on ", t.device(), ", not ", like.device());
}

// The device check of the shared helpers: every tensor on the device of `like`.
struct OnDeviceOf {
  const Tensor& like;
  void operator()(const Tensor& t, const char* name) const { check_device(t, like, name); }
};

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
// compressed.write_chunks); the zero slots are the caller's. fp8: the FP8
// format of uint8 pages ("" for pages in the model's dtype), with the layer's
// scales; step_rows are then the step's stored bytes.
void write_chunks(const Tensor& comp_cache, const Tensor& raw_cache, const Tensor& step_rows, const Tensor& gains,
                  const Tensor& heads, const Tensor& src_blocks, const Tensor& src_offsets, const Tensor& src_step,
                  const Tensor& dst_blocks, const Tensor& dst_offsets, int64_t head_d, int64_t pool_lo,
                  int64_t pool_hi, bool key_norm, const std::string& fp8, double k_scale, double v_scale) {
  const chunked_kv::WriteArgs a = chunked_kv_binding::write_args(
      OnDeviceOf{comp_cache}, comp_cache, raw_cache, step_rows, gains, heads, src_blocks, src_offsets, src_step,
      dst_blocks, dst_offsets, head_d, pool_lo, pool_hi, key_norm, {fp8, k_scale, v_scale});
  check_fp8_step(a.step_dtype, a.cache_dtype);
  if (a.num_chunks == 0) return;
  const DeviceGuard guard(comp_cache.device());
  check_launch(chunked_kv::launch_write_chunks(a, current_stream(comp_cache)));
}

// Attention of the queries of one KeySet (see compressed.attend). With
// num_splits == 1 it writes `out` [n, Hq, Dv] (query dtype); else the fp32
// partials part_acc [S, n, Hq, Dv] and part_ml [2, S, n, Hq] for merge_splits.
// fp8 and the scales as for write_chunks: step_rows are then the step's stored
// bytes, and only the query and out share a dtype.
void attend(const Tensor& query, const Tensor& step_rows, const Tensor& comp_cache, const Tensor& raw_cache,
            const Tensor& out, const Tensor& part_acc, const Tensor& part_ml, const Tensor& query_index,
            const Tensor& query_positions, const Tensor& raw_blocks, const Tensor& raw_offsets,
            const Tensor& raw_positions, const Tensor& num_raw, const Tensor& comp_blocks, const Tensor& comp_offsets,
            const Tensor& num_slots, const Tensor& origins, double scale, double log_weight, int64_t window,
            int64_t sink_tokens, int64_t chunk_size, int64_t hop, int64_t slots_per_group,
            int64_t tile_q, int64_t num_splits, double softcap, const Tensor& sinks, int64_t lookback,
            const std::string& fp8, double k_scale, double v_scale) {
  const chunked_kv::AttendArgs a = chunked_kv_binding::attend_args(
      OnDeviceOf{query}, query, step_rows, comp_cache, raw_cache, out, part_acc, part_ml, query_index,
      query_positions, raw_blocks, raw_offsets, raw_positions, num_raw, comp_blocks, comp_offsets, num_slots,
      /*comp_rows_per_page=*/0, origins, scale, log_weight, window, sink_tokens, chunk_size, hop, slots_per_group,
      tile_q, num_splits, softcap, sinks, lookback, {fp8, k_scale, v_scale});
  check_fp8_step(a.step_dtype, a.cache_dtype);
  TORCH_CHECK((is_fp8(a.cache_dtype) || a.step_dtype == a.query_dtype) && a.out_dtype == a.query_dtype,
              "chunked_kv: query, out and (unless the pages are FP8) step_rows must share a dtype");
  if (a.num_rows == 0 || a.num_q == 0) return;
  const DeviceGuard guard(query.device());
  int multiprocessors = 0, max_shared = 0;
  check_launch(chunked_kv::device_limits(query.device().index(), &multiprocessors, &max_shared));
  const size_t shared = chunked_kv::attend_shared_bytes(a.tile_q * (a.num_heads / a.num_kv_heads), a.head_d, a.head_dv);
  TORCH_CHECK(shared <= static_cast<size_t>(max_shared), "chunked_kv: a tile of ", a.tile_q, " queries x ",
              a.num_heads / a.num_kv_heads, " heads needs ", shared, " bytes of shared memory; the device allows ",
              max_shared);
  check_launch(chunked_kv::launch_attend(a, current_stream(query)));
}

// Merge the split partials of attend into out [n, Hq, Dv].
void merge_splits(const Tensor& part_acc, const Tensor& part_ml, const Tensor& out) {
  const chunked_kv::MergeArgs a = chunked_kv_binding::merge_args(OnDeviceOf{out}, part_acc, part_ml, out);
  if (a.num_tokens == 0) return;
  const DeviceGuard guard(out.device());
  check_launch(chunked_kv::launch_merge_splits(a, current_stream(out)));
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
  m.def("write_chunks", &write_chunks,
        "Pool a step's completed chunks into the compressed pages (fp8: the FP8 format of uint8 pages, or '')");
  m.def("attend", &attend,
        "Chunked attention of one key set over the compressed layout (fp8: the FP8 format of uint8 pages, or '')");
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
