// Tensor checks and stride copies shared by the two torch bindings
// (chunked_kv_ext.cpp for CUDA, chunked_kv_cpu_ext.cpp for the CPU); each
// binding adds its own device check in front of these.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "chunked_kv_types.h"

namespace chunked_kv_binding {

inline chunked_kv_types::DType dtype_of(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return chunked_kv_types::DType::kFloat32;
    case at::kHalf: return chunked_kv_types::DType::kFloat16;
    case at::kBFloat16: return chunked_kv_types::DType::kBFloat16;
    default: TORCH_CHECK(false, "chunked_kv: ", name, " has unsupported dtype ", t.scalar_type());
  }
}

// Rows of K/V (or queries, outputs): `dim` dimensions, the last one contiguous.
inline void check_row_layout(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.dim() == dim, "chunked_kv: ", name, " must have ", dim, " dimensions, not ", t.dim());
  TORCH_CHECK(t.stride(-1) == 1, "chunked_kv: ", name, " must have contiguous rows (last-dim stride 1)");
}

// An int64 index table of `rows` x `cols` (cols < 0: one dimension of `rows`).
inline const int64_t* index_table(const at::Tensor& t, const char* name, int64_t rows, int64_t cols) {
  TORCH_CHECK(t.scalar_type() == at::kLong && t.is_contiguous(), "chunked_kv: ", name, " must be contiguous int64");
  const bool ok = cols < 0 ? t.dim() == 1 && t.size(0) == rows : t.dim() == 2 && t.size(0) == rows && t.size(1) == cols;
  TORCH_CHECK(ok, "chunked_kv: ", name, " has shape ", t.sizes(), ", expected [", rows, cols < 0 ? "" : ", ",
              cols < 0 ? "" : std::to_string(cols), "]");
  return t.data_ptr<int64_t>();
}

// Token/head strides of the step's rows and block/head/row strides of both
// caches, into any argument struct with these fields.
template <typename Args>
void set_row_strides(Args& a, const at::Tensor& step_rows, const at::Tensor& raw_cache, const at::Tensor& comp_cache) {
  a.stride_st = step_rows.stride(0);
  a.stride_sh = step_rows.stride(1);
  a.stride_rb = raw_cache.stride(0);
  a.stride_rh = raw_cache.stride(1);
  a.stride_rs = raw_cache.stride(2);
  a.stride_cb = comp_cache.stride(0);
  a.stride_ch = comp_cache.stride(1);
  a.stride_cs = comp_cache.stride(2);
}

}  // namespace chunked_kv_binding
