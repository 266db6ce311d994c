// Torch binding of the chunked KV CUDA kernels: checks the tensors, fills the
// launcher structs of chunked_kv.h and launches on the current CUDA stream.
// Built on demand by vllm_chunked_kv/ops/cuda_ext.py.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <vector>

#include "chunked_kv.h"

namespace {

chunked_kv::DType dtype_of(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return chunked_kv::DType::kFloat32;
    case at::kHalf: return chunked_kv::DType::kFloat16;
    case at::kBFloat16: return chunked_kv::DType::kBFloat16;
    default: TORCH_CHECK(false, "chunked_kv: unsupported dtype ", t.scalar_type());
  }
}

void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), "chunked_kv: ", name, " must be a CUDA tensor");
}

void check_index(const at::Tensor& t, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.scalar_type() == at::kInt && t.is_contiguous(), "chunked_kv: ", name, " must be contiguous int32");
}

chunked_kv::Pooling pooling(const at::Tensor& gains, int64_t chunk_size, int64_t hop, int64_t pool_lo, int64_t pool_hi,
                            bool key_norm, double log_weight) {
  check_cuda(gains, "gains");
  TORCH_CHECK(gains.scalar_type() == at::kFloat && gains.is_contiguous() && gains.numel() == chunk_size,
              "chunked_kv: gains must be contiguous fp32 of chunk_size elements");
  TORCH_CHECK(chunk_size >= 1 && chunk_size <= chunked_kv::kMaxChunk, "chunked_kv: chunk_size must be in [1, ",
              chunked_kv::kMaxChunk, "]");
  TORCH_CHECK(0 <= pool_lo && pool_lo < pool_hi && pool_hi <= chunk_size, "chunked_kv: bad pooled slots");
  return {gains.data_ptr<float>(), static_cast<int>(chunk_size), static_cast<int>(hop), static_cast<int>(pool_lo),
          static_cast<int>(pool_hi), key_norm, static_cast<float>(log_weight)};
}

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "chunked_kv: kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace

// keys [M, chunk_size, D], values [M, chunk_size, Dv] (same dtype, last dim
// contiguous) -> fp32 key rows [M, D], value rows [M, Dv], log weights [M].
std::vector<at::Tensor> pool_chunk(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& gains,
                                   int64_t hop, int64_t pool_lo, int64_t pool_hi, bool key_norm, double log_weight) {
  check_cuda(keys, "keys");
  check_cuda(values, "values");
  TORCH_CHECK(keys.dim() == 3 && values.dim() == 3 && keys.size(0) == values.size(0) && keys.size(1) == values.size(1),
              "chunked_kv: keys and values must be [M, chunk_size, D]");
  TORCH_CHECK(keys.scalar_type() == values.scalar_type(), "chunked_kv: keys and values differ in dtype");
  TORCH_CHECK(keys.stride(2) == 1 && values.stride(2) == 1, "chunked_kv: head dim must be contiguous");
  TORCH_CHECK(keys.size(2) <= chunked_kv::kMaxHeadSize && values.size(2) <= chunked_kv::kMaxHeadSize,
              "chunked_kv: head size above ", chunked_kv::kMaxHeadSize);
  const c10::cuda::CUDAGuard guard(keys.device());
  const auto opts = keys.options().dtype(at::kFloat);
  auto key_out = at::empty({keys.size(0), keys.size(2)}, opts);
  auto value_out = at::empty({keys.size(0), values.size(2)}, opts);
  auto log_out = at::empty({keys.size(0)}, opts);
  chunked_kv::PoolArgs args{};
  args.keys = keys.data_ptr();
  args.values = values.data_ptr();
  args.key_out = key_out.data_ptr<float>();
  args.value_out = value_out.data_ptr<float>();
  args.log_weight_out = log_out.data_ptr<float>();
  args.num_chunks = keys.size(0);
  args.stride_kc = keys.stride(0);
  args.stride_ks = keys.stride(1);
  args.stride_vc = values.stride(0);
  args.stride_vs = values.stride(1);
  args.head_d = static_cast<int>(keys.size(2));
  args.head_dv = static_cast<int>(values.size(2));
  args.pooling = pooling(gains, keys.size(1), hop, pool_lo, pool_hi, key_norm, log_weight);
  check_launch(chunked_kv::launch_pool(args, dtype_of(keys), c10::cuda::getCurrentCUDAStream().stream()));
  return {key_out, value_out, log_out};
}

// Paged chunked attention; writes `out` [n, Hq, Dv] (query dtype). With
// num_splits > 1, part_acc [S, n, Hq, Dv] and part_ml [2, S, n, Hq] (fp32)
// hold the partial softmaxes that a second kernel merges.
void attend(const at::Tensor& query, const at::Tensor& kv_cache, at::Tensor& out, const at::Tensor& block_table,
            const at::Tensor& token_req, const at::Tensor& query_start, const at::Tensor& seq_lens,
            const at::Tensor& origins, const at::Tensor& gains, at::Tensor& part_acc, at::Tensor& part_ml, double scale,
            int64_t window, int64_t sink_tokens, int64_t chunk_size, int64_t hop, int64_t pool_lo, int64_t pool_hi,
            bool key_norm, bool keep_boundary, double log_weight, int64_t num_splits) {
  check_cuda(query, "query");
  check_cuda(kv_cache, "kv_cache");
  check_cuda(out, "out");
  check_index(token_req, "token_req");
  check_index(query_start, "query_start");
  check_index(seq_lens, "seq_lens");
  check_index(origins, "origins");
  check_cuda(block_table, "block_table");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.stride(1) == 1, "chunked_kv: block_table must be int32 rows");
  TORCH_CHECK(query.dim() == 3 && kv_cache.dim() == 4 && out.dim() == 3, "chunked_kv: bad ranks");
  TORCH_CHECK(query.scalar_type() == kv_cache.scalar_type() && out.scalar_type() == query.scalar_type(),
              "chunked_kv: query, cache and out must share a dtype");
  TORCH_CHECK(query.stride(2) == 1 && kv_cache.stride(3) == 1 && out.stride(2) == 1, "chunked_kv: head dim must be contiguous");
  const int64_t num_heads = query.size(1), num_kv_heads = kv_cache.size(1);
  const int64_t head_d = query.size(2), head_dv = kv_cache.size(3) - head_d;
  TORCH_CHECK(num_heads % num_kv_heads == 0 && num_heads / num_kv_heads <= chunked_kv::kMaxGroup,
              "chunked_kv: query heads per KV head must divide evenly and be at most ", chunked_kv::kMaxGroup);
  TORCH_CHECK(head_d <= chunked_kv::kMaxHeadSize && head_dv >= 1 && head_dv <= chunked_kv::kMaxHeadSize,
              "chunked_kv: head sizes must be at most ", chunked_kv::kMaxHeadSize);
  TORCH_CHECK(out.size(0) == query.size(0) && out.size(1) == num_heads && out.size(2) == head_dv, "chunked_kv: bad out shape");
  TORCH_CHECK(origins.numel() == num_kv_heads, "chunked_kv: one origin per KV head");
  if (num_splits > 1) {
    TORCH_CHECK(part_acc.scalar_type() == at::kFloat && part_acc.is_contiguous() &&
                    part_acc.numel() == num_splits * query.size(0) * num_heads * head_dv,
                "chunked_kv: part_acc must be contiguous fp32 [S, n, Hq, Dv]");
    TORCH_CHECK(part_ml.scalar_type() == at::kFloat && part_ml.is_contiguous() &&
                    part_ml.numel() == 2 * num_splits * query.size(0) * num_heads,
                "chunked_kv: part_ml must be contiguous fp32 [2, S, n, Hq]");
  }
  const c10::cuda::CUDAGuard guard(query.device());
  chunked_kv::AttendArgs a{};
  a.query = query.data_ptr();
  a.kv_cache = kv_cache.data_ptr();
  a.out = out.data_ptr();
  a.part_acc = num_splits > 1 ? part_acc.data_ptr<float>() : nullptr;
  a.part_ml = num_splits > 1 ? part_ml.data_ptr<float>() : nullptr;
  a.block_table = block_table.data_ptr<int32_t>();
  a.token_req = token_req.data_ptr<int32_t>();
  a.query_start = query_start.data_ptr<int32_t>();
  a.seq_lens = seq_lens.data_ptr<int32_t>();
  a.origins = origins.data_ptr<int32_t>();
  a.stride_qt = query.stride(0);
  a.stride_qh = query.stride(1);
  a.stride_ot = out.stride(0);
  a.stride_oh = out.stride(1);
  a.stride_kb = kv_cache.stride(0);
  a.stride_kh = kv_cache.stride(1);
  a.stride_ks = kv_cache.stride(2);
  a.stride_bt = block_table.stride(0);
  a.num_tokens = static_cast<int>(query.size(0));
  a.num_heads = static_cast<int>(num_heads);
  a.num_kv_heads = static_cast<int>(num_kv_heads);
  a.head_d = static_cast<int>(head_d);
  a.head_dv = static_cast<int>(head_dv);
  a.block_size = static_cast<int>(kv_cache.size(2));
  a.num_splits = static_cast<int>(num_splits);
  a.scale = static_cast<float>(scale);
  a.window = static_cast<int>(window);
  a.sink_tokens = static_cast<int>(sink_tokens);
  a.keep_boundary = keep_boundary;
  a.pooling = pooling(gains, chunk_size, hop, pool_lo, pool_hi, key_norm, log_weight);
  check_launch(chunked_kv::launch_attend(a, dtype_of(query), c10::cuda::getCurrentCUDAStream().stream()));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pool_chunk", &pool_chunk, "Pool chunks into compressed rows (DESIGN.md §3)");
  m.def("attend", &attend, "Paged chunked attention (DESIGN.md §3-4, §10)");
}
