// CUDA kernels for chunked KV attention (DESIGN.md §3-4, §10): pooling of
// sealed chunks, and paged attention over raw prefix + pooled sealed chunks
// + raw tail with one softmax. Same math as vllm_chunked_kv/ops/reference.py
// and the Triton kernels; fp32 arithmetic whatever the storage dtype.
//
// Work split: a warp owns one "item" at a time (a raw row, or a sealed chunk
// with its pooled row and kept boundary rows); its 32 lanes stride over the
// head dimension (d = lane + 32 * i). Each warp keeps an online softmax per
// query head of the GQA group; the warps of a block, then the splits of a
// query, are merged at the end.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "chunked_kv.h"

namespace chunked_kv {
namespace {

constexpr int kWarp = 32;
constexpr int kWarps = 4;  // warps per block
constexpr int kPerLane = kMaxHeadSize / kWarp;  // head-dim elements per lane
constexpr float kNegBig = -1.0e30f;  // finite start of a running max: exp(-inf - kNegBig) == 0

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The seal rule (DESIGN.md §3, §10): for a query at t on a grid starting at
// origin, the number of sealed chunks and the first position of the raw tail.
__device__ __forceinline__ void seal(int t, int window, int origin, int chunk_size, int hop, int* sealed, int* raw_from) {
  const int slack = t - window - (origin + chunk_size - 1);
  *sealed = slack >= 0 ? slack / hop + 1 : 0;
  *raw_from = *sealed > 0 ? origin + (*sealed - 1) * hop + chunk_size : origin;
}

// Pool one chunk with one warp: kp, vp receive this lane's slice of the
// pooled key and value rows. rows.key(s) / rows.value(s) point at slot s.
template <typename T, typename Rows>
__device__ void pool_warp(const Rows& rows, const Pooling& p, int head_d, int head_dv, int lane,
                          float (&kp)[kPerLane], float (&vp)[kPerLane]) {
  float norms[kMaxChunk];
  float norm_max = kNegBig, norm_sum = 0.f;
  if (p.key_norm) {  // softmax of the keys' L2 norms over the pooled slots
    for (int s = p.pool_lo; s < p.pool_hi; ++s) {
      const T* k = rows.key(s);
      float sq = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) {
        const int d = lane + kWarp * i;
        if (d < head_d) { const float x = to_float(k[d]); sq += x * x; }
      }
      norms[s] = sqrtf(warp_sum(sq));
      norm_max = fmaxf(norm_max, norms[s]);
    }
    for (int s = p.pool_lo; s < p.pool_hi; ++s) norm_sum += expf(norms[s] - norm_max);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) { kp[i] = 0.f; vp[i] = 0.f; }
  for (int s = p.pool_lo; s < p.pool_hi; ++s) {
    const float w = p.key_norm ? expf(norms[s] - norm_max) / norm_sum : p.gains[s];
    const T* k = rows.key(s);
    const T* v = rows.value(s);
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kWarp * i;
      if (d < head_d) kp[i] += w * to_float(k[d]);
      if (d < head_dv) vp[i] += w * to_float(v[d]);
    }
  }
}

// ------------------------------------------------------------------ pooling

template <typename T>
struct ChunkRows {  // slots of one chunk of the pool kernel's dense input
  const T* keys;
  const T* values;
  int64_t stride_ks, stride_vs;
  __device__ const T* key(int s) const { return keys + s * stride_ks; }
  __device__ const T* value(int s) const { return values + s * stride_vs; }
};

template <typename T>
__global__ void pool_kernel(PoolArgs args) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t chunk = static_cast<int64_t>(blockIdx.x) * kWarps + warp;
  if (chunk >= args.num_chunks) return;
  ChunkRows<T> rows{static_cast<const T*>(args.keys) + chunk * args.stride_kc,
                    static_cast<const T*>(args.values) + chunk * args.stride_vc, args.stride_ks, args.stride_vs};
  float kp[kPerLane], vp[kPerLane];
  pool_warp<T>(rows, args.pooling, args.head_d, args.head_dv, lane, kp, vp);
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarp * i;
    if (d < args.head_d) args.key_out[chunk * args.head_d + d] = kp[i];
    if (d < args.head_dv) args.value_out[chunk * args.head_dv + d] = vp[i];
  }
  if (lane == 0) args.log_weight_out[chunk] = args.pooling.log_weight;
}

// ---------------------------------------------------------------- attention

template <typename T>
struct PagedRows {  // stored rows of one request and KV head, by position
  const T* cache;
  const int32_t* block_table_row;
  int64_t stride_kb, stride_ks;
  int block_size, head_d;
  __device__ const T* row(int pos) const {
    const int64_t page = block_table_row[pos / block_size];
    return cache + page * stride_kb + static_cast<int64_t>(pos % block_size) * stride_ks;
  }
};

template <typename T>
struct PagedChunk {  // the slots of chunk starting at `start`, for pool_warp
  const PagedRows<T>* rows;
  int start;
  __device__ const T* key(int s) const { return rows->row(start + s); }
  __device__ const T* value(int s) const { return rows->row(start + s) + rows->head_d; }
};

// One warp's running softmax over the query heads of its GQA group.
struct WarpSoftmax {
  float m[kMaxGroup], l[kMaxGroup], acc[kMaxGroup][kPerLane];

  __device__ void init() {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      m[g] = kNegBig;
      l[g] = 0.f;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[g][i] = 0.f;
    }
  }

  // Fold in one row with (already reduced, warp-uniform) logits and this lane's value slice.
  __device__ void add(const float (&logit)[kMaxGroup], const float (&v)[kPerLane], int group) {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (g >= group) break;
      const float m_new = fmaxf(m[g], logit[g]);
      const float alpha = expf(m[g] - m_new), p = expf(logit[g] - m_new);
      m[g] = m_new;
      l[g] = l[g] * alpha + p;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i) acc[g][i] = acc[g][i] * alpha + p * v[i];
    }
  }
};

template <typename T>
__device__ void add_raw_row(WarpSoftmax& sm, const float (&q)[kMaxGroup][kPerLane], const T* row, int head_d, int head_dv,
                            int group, int lane) {
  float k[kPerLane], v[kPerLane], logit[kMaxGroup];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int d = lane + kWarp * i;
    k[i] = d < head_d ? to_float(row[d]) : 0.f;
    v[i] = d < head_dv ? to_float(row[head_d + d]) : 0.f;
  }
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot += q[g][i] * k[i];
    logit[g] = g < group ? warp_sum(dot) : 0.f;  // group is warp-uniform
  }
  sm.add(logit, v, group);
}

// grid (num_tokens, num_kv_heads, num_splits), kWarps warps per block; dynamic
// shared memory: kWarps * group * (head_dv + 2) floats.
template <typename T>
__global__ void attend_kernel(AttendArgs a) {
  extern __shared__ float smem[];
  const int token = blockIdx.x, head = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = a.num_heads / a.num_kv_heads;
  const int req = a.token_req[token];
  const int q_begin = a.query_start[req], q_len = a.query_start[req + 1] - q_begin;
  const int t = a.seq_lens[req] - q_len + (token - q_begin);  // this query's position
  const Pooling& p = a.pooling;
  const int origin = a.origins[head];
  int sealed, raw_from;
  seal(t, a.window, origin, p.chunk_size, p.hop, &sealed, &raw_from);
  const int prefix_end = max(a.sink_tokens, origin);  // sinks and positions before the origin stay raw
  const int pre_end = min(prefix_end, raw_from);
  const int below_sinks = a.sink_tokens - origin - p.chunk_size;  // chunks ending inside the sinks get no row
  const int c_first = below_sinks >= 0 ? below_sinks / p.hop + 1 : 0;
  const int n_chunks = max(sealed - c_first, 0);
  const int n_items = pre_end + n_chunks + (t + 1 - raw_from);

  float q[kMaxGroup][kPerLane];
  const T* query = static_cast<const T*>(a.query);
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kWarp * i;
      q[g][i] = (g < group && d < a.head_d)
                    ? to_float(query[token * a.stride_qt + (head * group + g) * a.stride_qh + d]) * a.scale
                    : 0.f;
    }
  }
  PagedRows<T> rows{static_cast<const T*>(a.kv_cache) + head * a.stride_kh, a.block_table + req * a.stride_bt,
                    a.stride_kb, a.stride_ks, a.block_size, a.head_d};
  WarpSoftmax sm;
  sm.init();
  for (int item = split * kWarps + warp; item < n_items; item += a.num_splits * kWarps) {
    if (item < pre_end) {
      add_raw_row(sm, q, rows.row(item), a.head_d, a.head_dv, group, lane);
    } else if (item < pre_end + n_chunks) {
      const int start = origin + (c_first + item - pre_end) * p.hop;
      PagedChunk<T> chunk{&rows, start};
      float kp[kPerLane], vp[kPerLane], logit[kMaxGroup];
      pool_warp<T>(chunk, p, a.head_d, a.head_dv, lane, kp, vp);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < kPerLane; ++i) dot += q[g][i] * kp[i];
        logit[g] = g < group ? warp_sum(dot) + p.log_weight : 0.f;
      }
      sm.add(logit, vp, group);
      if (a.keep_boundary) {  // first and last token stay raw unless the prefix has them
        if (start >= prefix_end) add_raw_row(sm, q, rows.row(start), a.head_d, a.head_dv, group, lane);
        const int last = start + p.chunk_size - 1;
        if (last >= prefix_end) add_raw_row(sm, q, rows.row(last), a.head_d, a.head_dv, group, lane);
      }
    } else {
      add_raw_row(sm, q, rows.row(raw_from + item - pre_end - n_chunks), a.head_d, a.head_dv, group, lane);
    }
  }

  // Merge the warps: smem = m [kWarps][group], l [kWarps][group], acc [kWarps][group][head_dv].
  float* sm_m = smem;
  float* sm_l = smem + kWarps * group;
  float* sm_acc = smem + 2 * kWarps * group;
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    if (g >= group) break;
    if (lane == 0) { sm_m[warp * group + g] = sm.m[g]; sm_l[warp * group + g] = sm.l[g]; }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      const int d = lane + kWarp * i;
      if (d < a.head_dv) sm_acc[(warp * group + g) * a.head_dv + d] = sm.acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < group * a.head_dv; idx += blockDim.x) {
    const int g = idx / a.head_dv, d = idx % a.head_dv;
    float m_all = kNegBig;
    for (int w = 0; w < kWarps; ++w) m_all = fmaxf(m_all, sm_m[w * group + g]);
    float l_all = 0.f, acc_all = 0.f;
    for (int w = 0; w < kWarps; ++w) {
      const float e = expf(sm_m[w * group + g] - m_all);
      l_all += e * sm_l[w * group + g];
      acc_all += e * sm_acc[(w * group + g) * a.head_dv + d];
    }
    const int q_head = head * group + g;
    if (a.num_splits == 1) {
      static_cast<T*>(a.out)[token * a.stride_ot + q_head * a.stride_oh + d] = from_float<T>(acc_all / l_all);
    } else {
      const int64_t flat = (static_cast<int64_t>(split) * a.num_tokens + token) * a.num_heads + q_head;
      a.part_acc[flat * a.head_dv + d] = acc_all;
      if (d == 0) {
        a.part_ml[flat] = m_all;
        a.part_ml[static_cast<int64_t>(a.num_splits) * a.num_tokens * a.num_heads + flat] = l_all;
      }
    }
  }
}

// One thread per output element: merge the splits' partial softmaxes.
template <typename T>
__global__ void merge_splits_kernel(AttendArgs a) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t per_token = static_cast<int64_t>(a.num_heads) * a.head_dv;
  if (idx >= a.num_tokens * per_token) return;
  const int64_t token = idx / per_token;
  const int q_head = (idx % per_token) / a.head_dv, d = idx % a.head_dv;
  const int64_t plane = static_cast<int64_t>(a.num_tokens) * a.num_heads;  // entries per split
  const int64_t base = token * a.num_heads + q_head;
  float m_all = kNegBig;
  for (int s = 0; s < a.num_splits; ++s) m_all = fmaxf(m_all, a.part_ml[s * plane + base]);
  float l_all = 0.f, acc_all = 0.f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float e = expf(a.part_ml[s * plane + base] - m_all);
    l_all += e * a.part_ml[(a.num_splits + s) * plane + base];
    acc_all += e * a.part_acc[(s * plane + base) * a.head_dv + d];
  }
  static_cast<T*>(a.out)[token * a.stride_ot + q_head * a.stride_oh + d] = from_float<T>(acc_all / l_all);
}

template <typename T>
cudaError_t attend_typed(const AttendArgs& a, cudaStream_t stream) {
  const int group = a.num_heads / a.num_kv_heads;
  const size_t shared = sizeof(float) * kWarps * group * (a.head_dv + 2);
  const dim3 grid(a.num_tokens, a.num_kv_heads, a.num_splits);
  attend_kernel<T><<<grid, kWarps * kWarp, shared, stream>>>(a);
  if (a.num_splits > 1) {
    const int64_t total = static_cast<int64_t>(a.num_tokens) * a.num_heads * a.head_dv;
    const int threads = 256;
    merge_splits_kernel<T><<<static_cast<unsigned>((total + threads - 1) / threads), threads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t pool_typed(const PoolArgs& a, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>((a.num_chunks + kWarps - 1) / kWarps);
  pool_kernel<T><<<blocks, kWarps * kWarp, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_pool(const PoolArgs& args, DType dtype, cudaStream_t stream) {
  if (args.num_chunks == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat16: return pool_typed<__half>(args, stream);
    case DType::kBFloat16: return pool_typed<__nv_bfloat16>(args, stream);
    default: return pool_typed<float>(args, stream);
  }
}

cudaError_t launch_attend(const AttendArgs& args, DType dtype, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  switch (dtype) {
    case DType::kFloat16: return attend_typed<__half>(args, stream);
    case DType::kBFloat16: return attend_typed<__nv_bfloat16>(args, stream);
    default: return attend_typed<float>(args, stream);
  }
}

}  // namespace chunked_kv
