// Pooling of the chunks a step completes into the compressed pages on CPU
// (docs/design.md §3-4; what ops/kernels/compressed.py `write_chunks` does), one
// OpenMP iteration per chunk: gather its chunk_size rows (the step's own
// row, rounded to the cache dtype, or the stored raw row) in fp32, weigh the
// pooled slots (fixed normalised gains, or the softmax of the keys' L2
// norms for key_norm), store the pooled row and, with boundary retention,
// the chunk's first and last rows. FP8 pages: the step's rows come as their
// stored bytes, every row is read as bytes times its scale (keys k_scale,
// values v_scale) and the pooled row is divided by them and rounded once. Included by each instruction set's
// translation unit; then the table of that instruction set's kernels.
#pragma once

#include <stdlib.h>

#include "chunked_kv_cpu_attend.h"

namespace chunked_kv_cpu {
namespace {

template <typename TC, typename TS>
static void write_chunk(const WriteArgs& a, int64_t c, float* rows) {
  const int cs = a.chunk_size, width = a.head_d + a.head_dv;
  const int64_t head = a.heads[c];
  // Element d of a stored row times scale(d) is its value (1 unless the pages are FP8).
  const auto scale = [&](int d) { return d < a.head_d ? a.key_scale : a.value_scale; };
  for (int s = 0; s < cs; ++s) {
    const int64_t src = c * cs + s, token = a.src_step[src];
    float* dst = rows + (int64_t)s * width;
    if (token >= 0) {  // FP8: TS is TC, the step's stored bytes
      const TS* row = static_cast<const TS*>(a.step_rows) + token * a.stride_st + head * a.stride_sh;
      for (int d = 0; d < width; ++d) dst[d] = round_to<TC>(to_float(row[d])) * scale(d);
    } else {
      const TC* row = static_cast<const TC*>(a.raw_cache) + a.src_blocks[src] * a.stride_rb + head * a.stride_rh +
                      a.src_offsets[src] * a.stride_rs;
      for (int d = 0; d < width; ++d) dst[d] = to_float(row[d]) * scale(d);
    }
  }
  float weight[kMaxChunk];
  for (int s = a.pool_lo; s < a.pool_hi; ++s) weight[s] = a.key_norm ? 0.f : a.gains[s];
  if (a.key_norm && a.pool_hi > a.pool_lo) {
    float top = -INFINITY, total = 0.f;
    for (int s = a.pool_lo; s < a.pool_hi; ++s) {
      float squares = 0.f;
      for (int d = 0; d < a.head_d; ++d) squares += rows[(int64_t)s * width + d] * rows[(int64_t)s * width + d];
      weight[s] = sqrtf(squares);
      top = weight[s] > top ? weight[s] : top;
    }
    for (int s = a.pool_lo; s < a.pool_hi; ++s) total += (weight[s] = expf(weight[s] - top));
    for (int s = a.pool_lo; s < a.pool_hi; ++s) weight[s] /= total;
  }
  TC* comp = static_cast<TC*>(a.comp_cache);
  const auto slot_row = [&](int kind) {
    const int64_t at = c * a.slots_per_group + kind;
    return comp + a.dst_blocks[at] * a.stride_cb + head * a.stride_ch + a.dst_offsets[at] * a.stride_cs;
  };
  TC* pooled = slot_row(kPooled);
  for (int d = 0; d < width; ++d) {
    float sum = 0.f;
    for (int s = a.pool_lo; s < a.pool_hi; ++s) sum += weight[s] * rows[(int64_t)s * width + d];
    pooled[d] = from_float<TC>(sum / scale(d));
  }
  if (a.slots_per_group == kBoundarySlots) {  // stored rows again: the same bytes (value / scale is exact)
    TC* first = slot_row(kFirst);
    TC* last = slot_row(kLast);
    for (int d = 0; d < width; ++d) {
      first[d] = from_float<TC>(rows[d] / scale(d));
      last[d] = from_float<TC>(rows[(int64_t)(cs - 1) * width + d] / scale(d));
    }
  }
}

template <typename TC, typename TS>
static void write_typed(const WriteArgs& a) {
#pragma omp parallel num_threads(a.num_threads)
  {
    float* rows = static_cast<float*>(malloc(sizeof(float) * a.chunk_size * (a.head_d + a.head_dv)));
#pragma omp for schedule(static)
    for (int64_t c = 0; c < a.num_chunks; ++c) write_chunk<TC, TS>(a, c, rows);
    free(rows);
  }
}

// The step rows are in the cache dtype or in fp32 (the binding converts others); on FP8 pages, bytes.
template <typename TC>
static void write_cache_typed(const WriteArgs& a) {
  if constexpr (!IsFp8<TC>::value) {
    if (a.step_dtype == DType::kFloat32) return write_typed<TC, float>(a);
  }
  return write_typed<TC, TC>(a);
}

static void write_chunks_impl(const WriteArgs& a) {
  switch (a.cache_dtype) {
    case DType::kBFloat16: return write_cache_typed<Bf16>(a);
    case DType::kFloat16: return write_cache_typed<Half>(a);
    case DType::kFloat8E4m3: return write_cache_typed<E4m3>(a);
    case DType::kFloat8E5m2: return write_cache_typed<E5m2>(a);
    default: return write_cache_typed<float>(a);
  }
}

template <typename TC>
static void attend_cache_typed(const AttendArgs& a) {
  if constexpr (!IsFp8<TC>::value) {
    if (a.step_dtype == DType::kFloat32) return attend_typed<TC, float>(a);
  }
  return attend_typed<TC, TC>(a);
}

static void attend_impl(const AttendArgs& a) {
  switch (a.cache_dtype) {
    case DType::kBFloat16: return attend_cache_typed<Bf16>(a);
    case DType::kFloat16: return attend_cache_typed<Half>(a);
    case DType::kFloat8E4m3: return attend_cache_typed<E4m3>(a);
    case DType::kFloat8E5m2: return attend_cache_typed<E5m2>(a);
    default: return attend_cache_typed<float>(a);
  }
}

}  // namespace
}  // namespace chunked_kv_cpu

// The including translation unit names its table: CHUNKED_KV_TABLE(kAvx2Table, "avx2").
#define CHUNKED_KV_TABLE(name, isa)                                                                  \
  namespace chunked_kv_cpu {                                                                         \
  const KernelTable name = {isa, &write_chunks_impl, &attend_impl, &merge_splits_impl};              \
  }
