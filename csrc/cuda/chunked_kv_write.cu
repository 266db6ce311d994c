// Pooling of the chunks a step completes into the compressed pages
// (docs/design.md §3-4; what ops/kernels/compressed.py `write_chunks` does): one block per
// chunk gathers its chunk_size rows (the step's own row, rounded to the cache
// dtype, or the stored raw row), weighs the pooled slots (fixed normalised
// gains, or the softmax of the keys' L2 norms for key_norm) and stores the
// pooled row, then, with boundary retention, the chunk's first and last rows.
// fp32 arithmetic whatever the storage dtypes. FP8 pages: the step's rows come
// as their stored bytes, every row is read as bytes times its scale (keys
// k_scale, values v_scale) and a stored row is divided by them and rounded
// once (the boundary rows: their own bytes again).
#include "chunked_kv_common.cuh"

namespace chunked_kv {
namespace {

template <typename TS, typename TC>
struct ChunkRows {  // the rows of one chunk, by slot
  const TS* step;
  const TC* raw;
  const int64_t* offset;  // [chunk_size] element offset of each row in `step` or `raw`
  const int* own;         // [chunk_size] whether the row is the step's own
  int head_d;
  float key_scale, value_scale;  // FP8 pages: a stored element times its scale is its value; 1 otherwise

  __device__ float scale(int col) const { return col < head_d ? key_scale : value_scale; }
  __device__ float at(int slot, int col) const {  // FP8: TS is TC, the step's stored bytes (round_to keeps them)
    const float x = own[slot] ? round_to<TC>(to_float(step[offset[slot] + col])) : to_float(raw[offset[slot] + col]);
    if constexpr (IsFp8<TC>::value) return x * scale(col);
    return x;
  }
  // Value x of column `col` as stored (on FP8 pages divided by its scale: a row read by `at` gets its bytes back).
  __device__ TC store(float x, int col) const {
    if constexpr (IsFp8<TC>::value) return from_float<TC>(x / scale(col));
    return from_float<TC>(x);
  }
};

// grid (num_chunks); dynamic shared memory: write_shared_bytes(chunk_size).
template <typename TS, typename TC>
__global__ void __launch_bounds__(kThreads) write_chunks_kernel(const WriteArgs a) {
  const int tid = threadIdx.x;
  const int64_t chunk = blockIdx.x;
  const int cs = a.chunk_size, width = a.head_d + a.head_dv;
  SharedCarver carver{dynamic_shared()};
  int64_t* offset = carver.take<int64_t>(cs);
  int* own = carver.take<int>(cs);
  float* weight = carver.take<float>(cs);
  const int64_t head = a.heads[chunk];

  for (int s = tid; s < cs; s += kThreads) {
    const int64_t src = chunk * cs + s;
    const int64_t token = a.src_step[src];
    own[s] = token >= 0;
    offset[s] = token >= 0 ? token * a.stride_st + head * a.stride_sh
                           : a.src_blocks[src] * a.stride_rb + head * a.stride_rh + a.src_offsets[src] * a.stride_rs;
  }
  __syncthreads();
  const ChunkRows<TS, TC> rows{static_cast<const TS*>(a.step_rows), static_cast<const TC*>(a.raw_cache), offset, own,
                               a.head_d, a.key_scale, a.value_scale};

  // Pooling weight of each slot (0 outside the pooled slots).
  for (int s = tid; s < cs; s += kThreads) {
    const bool pooled = s >= a.pool_lo && s < a.pool_hi;
    if (a.key_norm && pooled) {
      float squares = 0.f;
      for (int d = 0; d < a.head_d; ++d) {
        const float x = rows.at(s, d);
        squares += x * x;
      }
      weight[s] = sqrtf(squares);  // the norm, turned into a softmax below
    } else {
      weight[s] = pooled && !a.key_norm ? a.gains[s] : 0.f;
    }
  }
  __syncthreads();
  if (a.key_norm && tid == 0 && a.pool_hi > a.pool_lo) {
    float top = kNegBig, total = 0.f;
    for (int s = a.pool_lo; s < a.pool_hi; ++s) top = fmaxf(top, weight[s]);
    for (int s = a.pool_lo; s < a.pool_hi; ++s) total += expf(weight[s] - top);
    for (int s = a.pool_lo; s < a.pool_hi; ++s) weight[s] = expf(weight[s] - top) / total;
  }
  __syncthreads();

  TC* comp = static_cast<TC*>(a.comp_cache);
  const int64_t* dst_block = a.dst_blocks + chunk * a.slots_per_group;
  const int64_t* dst_offset = a.dst_offsets + chunk * a.slots_per_group;
  const auto slot_row = [&](int i) {
    return comp + dst_block[i] * a.stride_cb + head * a.stride_ch + dst_offset[i] * a.stride_cs;
  };
  TC* pooled_row = slot_row(kPooled);
  for (int col = tid; col < width; col += kThreads) {
    float sum = 0.f;
    for (int s = a.pool_lo; s < a.pool_hi; ++s) sum += weight[s] * rows.at(s, col);
    pooled_row[col] = rows.store(sum, col);
  }
  if (a.slots_per_group == kBoundarySlots) {  // boundary retention: the first and last raw rows follow
    TC* first_row = slot_row(kFirst);
    TC* last_row = slot_row(kLast);
    for (int col = tid; col < width; col += kThreads) {
      first_row[col] = rows.store(rows.at(0, col), col);
      last_row[col] = rows.store(rows.at(cs - 1, col), col);
    }
  }
}

size_t write_shared_bytes(int chunk_size) {
  return align16(sizeof(int64_t) * chunk_size) + align16(sizeof(int) * chunk_size) +
         align16(sizeof(float) * chunk_size);
}

template <typename TS, typename TC>
cudaError_t write_typed(const WriteArgs& a, cudaStream_t stream) {
  return launch(&write_chunks_kernel<TS, TC>, dim3(static_cast<unsigned>(a.num_chunks)),
                write_shared_bytes(a.chunk_size), stream, a);
}

template <typename TS>
cudaError_t write_step_typed(const WriteArgs& a, cudaStream_t stream) {
  switch (a.cache_dtype) {
    case DType::kFloat16: return write_typed<TS, __half>(a, stream);
    case DType::kBFloat16: return write_typed<TS, __nv_bfloat16>(a, stream);
    default: return write_typed<TS, float>(a, stream);
  }
}

}  // namespace

cudaError_t launch_write_chunks(const WriteArgs& args, cudaStream_t stream) {
  if (args.num_chunks == 0) return cudaSuccess;
  switch (args.step_dtype) {  // FP8 pages: the step rows are their bytes (the binding checks)
    case DType::kFloat8E4m3: return write_typed<E4m3, E4m3>(args, stream);
    case DType::kFloat8E5m2: return write_typed<E5m2, E5m2>(args, stream);
    case DType::kFloat16: return write_step_typed<__half>(args, stream);
    case DType::kBFloat16: return write_step_typed<__nv_bfloat16>(args, stream);
    default: return write_step_typed<float>(args, stream);
  }
}

}  // namespace chunked_kv
