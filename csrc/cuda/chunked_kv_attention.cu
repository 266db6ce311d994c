// Chunked attention over the compressed layout (docs/design.md §3-4, §10; what
// ops/kernels/compressed.py `attend` computes, from the same KeySet, without its
// dense bias). fp32 arithmetic whatever the storage dtypes. FP8 pages: the step's
// rows come as their stored bytes too, k_scale is folded into the query scale
// and v_scale into the output (and the split partials).
//
// A block handles a tile of up to tile_q consecutive queries of one key-set
// row on one KV head: tile_q x group query rows (GQA), kept in shared memory
// with their running softmax (max, sum, weighted values). It folds in key
// rows kBlockKeys at a time from three sources:
//   1. the stored raw rows (sinks, rows before the head's grid origin, the
//      raw region before the step), through their (block, offset);
//   2. the step's own rows: only the index ranges that can be visible to the
//      tile (the leading forever-raw positions and the raw region from the
//      tile's first query on);
//   3. the compressed slots up to the last group sealed for the tile; a
//      pooled row enters with logit bias log_weight, boundary rows raw.
// Each key block is loaded once (coalesced, into shared memory as fp32),
// scored against every query row (one thread per row and key), folded into
// the row's softmax (one thread per row) and into its weighted values (one
// thread per row and value column). Visibility per row and key follows from
// positions (raw rows) or slot indices (compressed rows) and the config.
// With num_splits > 1 each block takes every num_splits-th key block of each
// source and writes a partial softmax that merge_splits_kernel combines.
#include <map>
#include <mutex>
#include <utility>

#include "chunked_kv_common.cuh"

namespace chunked_kv {
namespace {

enum class Source { kStored, kOwn, kSlots };

constexpr int kKeyStridePad = 1;  // shared key rows of width + 1 floats: no bank conflicts across keys
constexpr int kProbStride = kBlockKeys + 1;  // likewise across the query rows of the probabilities

// Shared memory of one block (carved in this order; attend_shared_bytes sums it).
struct Shared {
  int* key_tag;          // [kBlockKeys] position (raw) or slot index (compressed); -1: no row
  float* key_bias;       // [kBlockKeys]
  int* row_token;        // [rows] step token of each query row
  int* row_head;         // [rows] query head of each query row
  int* row_t;            // [rows] position of each query row
  int* row_raw_from;     // [rows] first position of its raw region
  int* row_slot_limit;   // [rows] slots below this are sealed for the row
  float* q;      // [rows, head_d] scaled queries
  float* acc;    // [rows, head_dv] weighted values
  float* kv;     // [kBlockKeys, head_d + head_dv + kKeyStridePad] the key block
  float* p;      // [rows, kProbStride] logits, then probabilities (first kBlockKeys columns)
  float* m;      // [rows] running max
  float* l;      // [rows] running sum
  float* alpha;  // [rows] rescaling of the last fold

  __device__ static Shared carve(int rows, int head_d, int head_dv) {
    SharedCarver c{dynamic_shared()};
    Shared s;
    s.key_tag = c.take<int>(kBlockKeys);
    s.key_bias = c.take<float>(kBlockKeys);
    s.row_token = c.take<int>(rows);
    s.row_head = c.take<int>(rows);
    s.row_t = c.take<int>(rows);
    s.row_raw_from = c.take<int>(rows);
    s.row_slot_limit = c.take<int>(rows);
    s.q = c.take<float>(static_cast<int64_t>(rows) * head_d);
    s.acc = c.take<float>(static_cast<int64_t>(rows) * head_dv);
    s.kv = c.take<float>(static_cast<int64_t>(kBlockKeys) * (head_d + head_dv + kKeyStridePad));
    s.p = c.take<float>(static_cast<int64_t>(rows) * kProbStride);
    s.m = c.take<float>(rows);
    s.l = c.take<float>(rows);
    s.alpha = c.take<float>(rows);
    return s;
  }
};

// Element e = tid, tid + kThreads, ... of a [rows, cols] array as (r, c),
// without a division per step.
struct Walk {
  int e, r, c;
  __device__ Walk(int first, int cols) : e(first), r(first / cols), c(first % cols) {}
  __device__ void next(int cols) {
    e += kThreads;
    for (c += kThreads; c >= cols; c -= cols) ++r;
  }
};

// What every thread of a block knows about its tile.
struct Tile {
  int64_t row;     // key-set row (a request)
  int first;       // the tile's first query within the row
  int p0;          // position of the row's first query
  int origin, first_group, prefix_end;  // this KV head's grid; forever raw before prefix_end
  int head, rows, group, split;
};

// The key at index `idx` of `source` (all lanes of a warp ask for the same key).
__device__ __forceinline__ void key_meta(const AttendArgs& a, const Tile& t, Source source, int idx,
                                         int64_t* offset, int* tag, float* bias) {
  *bias = 0.f;
  if (source == Source::kStored) {
    const int64_t at = t.row * a.max_raw + idx;
    *offset = a.raw_blocks[at] * a.stride_rb + t.head * a.stride_rh + a.raw_offsets[at] * a.stride_rs;
    *tag = static_cast<int>(a.raw_positions[at]);
  } else if (source == Source::kOwn) {
    *offset = a.query_index[t.row * a.num_q + idx] * a.stride_st + t.head * a.stride_sh;
    *tag = t.p0 + idx;
  } else {
    const int64_t at = t.row * a.max_slots + idx;
    *offset = a.comp_blocks[at] * a.stride_cb + t.head * a.stride_ch + a.comp_offsets[at] * a.stride_cs;
    const bool exists = slot_exists(idx, t.origin, t.first_group, a.sink_tokens, a.chunk_size, a.hop,
                                    a.slots_per_group);
    *tag = exists ? idx : -1;
    *bias = slot_kind(idx, a.slots_per_group) == kPooled ? a.log_weight : 0.f;
  }
}

// Fold keys [lo, hi) of `source` (every num_splits-th block of them) into the tile's softmax.
template <typename TS, typename TC>
__device__ __forceinline__ void fold(const AttendArgs& a, const Tile& t, const Shared& sh, Source source, int lo,
                                     int hi) {
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int width = a.head_d + a.head_dv, kv_stride = width + kKeyStridePad;
  const int num_blocks = hi > lo ? (hi - lo + kBlockKeys - 1) / kBlockKeys : 0;
  for (int b = t.split; b < num_blocks; b += a.num_splits) {
    __syncthreads();  // the previous key block is no longer read
    for (int n = warp; n < kBlockKeys; n += kThreads / 32) {  // one warp per key row, lanes over columns
      const int idx = lo + b * kBlockKeys + n;
      int64_t offset = 0;
      int tag = -1;
      float bias = 0.f;
      if (idx < hi) key_meta(a, t, source, idx, &offset, &tag, &bias);
      float* dst = sh.kv + n * kv_stride;
      if (tag < 0) {  // no row: never visible; zeros keep 0 * value finite
        for (int c = lane; c < width; c += 32) dst[c] = 0.f;
      } else if (source == Source::kOwn) {
        const TS* src = static_cast<const TS*>(a.step_rows) + offset;
        for (int c = lane; c < width; c += 32) dst[c] = to_float(src[c]);
      } else {
        const TC* src = static_cast<const TC*>(source == Source::kStored ? a.raw_cache : a.comp_cache) + offset;
        for (int c = lane; c < width; c += 32) dst[c] = to_float(src[c]);
      }
      if (lane == 0) {
        sh.key_tag[n] = tag;
        sh.key_bias[n] = bias;
      }
    }
    __syncthreads();
    for (int e = tid; e < t.rows * kBlockKeys; e += kThreads) {  // logits of every (query row, key)
      const int r = e / kBlockKeys, n = e % kBlockKeys;
      const int tag = sh.key_tag[n];
      bool visible = source == Source::kSlots
                         ? tag >= 0 && tag < sh.row_slot_limit[r]
                         : tag >= 0 && tag <= sh.row_t[r] && (tag < t.prefix_end || tag >= sh.row_raw_from[r]);
      if (visible && a.lookback > 0) {  // the layer's own sliding window: the position a row leaves it by
        int leaves = tag;
        if (source == Source::kSlots) {  // grid.slot_position: a kept first token's own, else its chunk's last
          const int first = t.origin + (slot_group(tag, a.slots_per_group) - t.first_group) * a.hop;
          leaves = slot_kind(tag, a.slots_per_group) == kFirst ? first : first + a.chunk_size - 1;
        }
        visible = sh.row_t[r] - leaves < a.lookback;
      }
      float logit = -INFINITY;
      if (visible) {
        const float* q = sh.q + r * a.head_d;
        const float* k = sh.kv + n * kv_stride;
        float dot = 0.f;
        for (int d = 0; d < a.head_d; ++d) dot += q[d] * k[d];
        if (a.softcap > 0.f) dot = a.softcap * tanhf(dot / a.softcap);  // the model's logit cap, before the bias
        logit = dot + sh.key_bias[n];
      }
      sh.p[r * kProbStride + n] = logit;
    }
    __syncthreads();
    for (int r = tid; r < t.rows; r += kThreads) {  // online softmax of each query row
      float* p = sh.p + r * kProbStride;
      float top = sh.m[r];
      for (int n = 0; n < kBlockKeys; ++n) top = fmaxf(top, p[n]);
      float sum = 0.f;
      for (int n = 0; n < kBlockKeys; ++n) {
        p[n] = expf(p[n] - top);
        sum += p[n];
      }
      sh.alpha[r] = expf(sh.m[r] - top);
      sh.l[r] = sh.l[r] * sh.alpha[r] + sum;
      sh.m[r] = top;
    }
    __syncthreads();
    for (Walk w(tid, a.head_dv); w.e < t.rows * a.head_dv; w.next(a.head_dv)) {  // weighted values
      const float* p = sh.p + w.r * kProbStride;
      const float* v = sh.kv + a.head_d + w.c;
      float sum = sh.acc[w.e] * sh.alpha[w.r];
      for (int n = 0; n < kBlockKeys; ++n) sum += p[n] * v[n * kv_stride];
      sh.acc[w.e] = sum;
    }
  }
}

// grid (num_rows * tiles_per_row, num_kv_heads, num_splits); dynamic shared
// memory: attend_shared_bytes(tile_q * group, head_d, head_dv). TQ: queries
// and out; TS: step rows (TQ, or on FP8 pages TC); TC: caches.
template <typename TQ, typename TS, typename TC>
__global__ void __launch_bounds__(kThreads) attend_kernel(const AttendArgs a) {
  const int tid = threadIdx.x;
  const unsigned tiles_per_row = static_cast<unsigned>((a.num_q + a.tile_q - 1) / a.tile_q);  // 32-bit division
  Tile t;
  t.group = a.num_heads / a.num_kv_heads;
  t.head = blockIdx.y;
  t.split = blockIdx.z;
  t.row = blockIdx.x / tiles_per_row;
  t.first = static_cast<int>(blockIdx.x % tiles_per_row) * a.tile_q;
  const int count = min(a.num_q - t.first, a.tile_q);
  t.rows = count * t.group;
  t.p0 = static_cast<int>(a.query_positions[t.row * a.num_q]);
  t.origin = static_cast<int>(a.origins[t.row * a.num_kv_heads + t.head]);  // the request's grid on this KV head
  t.first_group = (t.origin + a.chunk_size - 1) / a.hop;
  t.prefix_end = max(a.sink_tokens, t.origin);
  const int t_lo = t.p0 + t.first, t_hi = t_lo + count - 1;
  const Shared sh = Shared::carve(a.tile_q * t.group, a.head_d, a.head_dv);
  const int64_t* tokens = a.query_index + t.row * a.num_q + t.first;  // [count]

#pragma unroll 1
  for (int r = tid; r < t.rows; r += kThreads) {  // row r: query first + r / group, query head head * group + r % group
    const int m = r / t.group;
    const Seal s = seal(t_lo + m, a.window, t.origin, a.chunk_size, a.hop);
    sh.row_token[r] = static_cast<int>(tokens[m]);
    sh.row_head[r] = t.head * t.group + (r - m * t.group);
    sh.row_t[r] = t_lo + m;
    sh.row_raw_from[r] = s.raw_from;
    sh.row_slot_limit[r] = a.slots_per_group * (s.sealed + t.first_group);
    const bool sink = a.sinks != nullptr && t.split == 0;  // a learned sink logit: in the denominator, no value
    sh.m[r] = sink ? a.sinks[sh.row_head[r]] : kNegBig;
    sh.l[r] = sink ? 1.f : 0.f;
  }
  for (int e = tid; e < t.rows * a.head_dv; e += kThreads) sh.acc[e] = 0.f;
  __syncthreads();
  const TQ* query = static_cast<const TQ*>(a.query);
  const float q_scale = a.scale * a.key_scale;  // FP8 pages: keys are stored elements times key_scale
  for (Walk w(tid, a.head_d); w.e < t.rows * a.head_d; w.next(a.head_d)) {
    const int64_t token = sh.row_token[w.r], q_head = sh.row_head[w.r];
    sh.q[w.e] = to_float(query[token * a.stride_qt + q_head * a.stride_qh + w.c]) * q_scale;
  }
  __syncthreads();

  // The key ranges of the three sources: 1. the stored raw rows; 2. the
  // step's own rows (own row i is at position p0 + i) of the forever-raw
  // prefix and of the raw region from the tile's first query on, causally;
  // 3. the compressed slots up to the last group sealed for the tile.
  const Seal lo_seal = seal(t_lo, a.window, t.origin, a.chunk_size, a.hop);
  const Seal hi_seal = seal(t_hi, a.window, t.origin, a.chunk_size, a.hop);
  const int tail_hi = t_hi - t.p0 + 1;
  const int pre_hi = min(max(min(t.prefix_end, lo_seal.raw_from) - t.p0, 0), tail_hi);
  const int tail_lo = max(lo_seal.raw_from - t.p0, 0);
  const int limit = min(static_cast<int>(a.num_slots[t.row]), a.slots_per_group * (hi_seal.sealed + t.first_group));
  // With a sliding window, slots start at the first chunk whose last token the first query still sees
  // (grid.first_lookback_slot): vLLM may have freed the pages below it.
  const int behind = t_lo - a.lookback - t.origin - a.chunk_size + 1;
  const int slot_lo = a.lookback > 0 ? a.slots_per_group * ((behind >= 0 ? behind / a.hop + 1 : 0) + t.first_group) : 0;
  for (int part = 0; part < 4; ++part) {
    const Source source = part == 0 ? Source::kStored : part == 3 ? Source::kSlots : Source::kOwn;
    const int lo = part == 2 ? tail_lo : part == 3 ? slot_lo : 0;
    const int hi = part == 0 ? static_cast<int>(a.num_raw[t.row]) : part == 1 ? pre_hi : part == 2 ? tail_hi : limit;
    fold<TS, TC>(a, t, sh, source, lo, hi);
  }
  __syncthreads();
  if (a.num_splits == 1) {  // alpha becomes value_scale / sum (0 for a row that saw nothing)
    for (int r = tid; r < t.rows; r += kThreads)
      sh.alpha[r] = sh.l[r] > 0.f ? a.value_scale * reciprocal(sh.l[r]) : 0.f;
    __syncthreads();
  }

  for (Walk w(tid, a.head_dv); w.e < t.rows * a.head_dv; w.next(a.head_dv)) {
    const int64_t token = sh.row_token[w.r], q_head = sh.row_head[w.r];
    if (a.num_splits == 1) {
      static_cast<TQ*>(a.out)[token * a.stride_ot + q_head * a.stride_oh + w.c] =
          from_float<TQ>(sh.acc[w.e] * sh.alpha[w.r]);
    } else {
      const int64_t flat = (t.split * a.num_tokens + token) * a.num_heads + q_head;
      a.part_acc[flat * a.head_dv + w.c] = sh.acc[w.e] * a.value_scale;
      if (w.c == 0) {
        a.part_ml[flat] = sh.m[w.r];
        a.part_ml[a.num_splits * a.num_tokens * a.num_heads + flat] = sh.l[w.r];
      }
    }
  }
}

// One thread per output element: merge the splits' partial softmaxes.
template <typename T>
__global__ void __launch_bounds__(kThreads) merge_splits_kernel(const MergeArgs a) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t per_token = static_cast<int64_t>(a.num_heads) * a.head_dv;
  if (idx >= a.num_tokens * per_token) return;
  const int64_t token = idx / per_token;
  const int64_t q_head = idx % per_token / a.head_dv, d = idx % a.head_dv;
  const int64_t plane = a.num_tokens * a.num_heads;  // entries per split
  const int64_t at = token * a.num_heads + q_head;
  float top = kNegBig;
  for (int s = 0; s < a.num_splits; ++s) top = fmaxf(top, a.part_ml[s * plane + at]);
  float l = 0.f, acc = 0.f;
  for (int s = 0; s < a.num_splits; ++s) {
    const float w = expf(a.part_ml[s * plane + at] - top);
    l += w * a.part_ml[(a.num_splits + s) * plane + at];
    acc += w * a.part_acc[(s * plane + at) * a.head_dv + d];
  }
  static_cast<T*>(a.out)[token * a.stride_ot + q_head * a.stride_oh + d] = from_float<T>(l > 0.f ? acc / l : 0.f);
}

template <typename TQ, typename TS, typename TC>
cudaError_t attend_typed(const AttendArgs& a, cudaStream_t stream) {
  const int64_t tiles = static_cast<int64_t>(a.num_rows) * ((a.num_q + a.tile_q - 1) / a.tile_q);
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(a.num_kv_heads),
                  static_cast<unsigned>(a.num_splits));
  const int rows = a.tile_q * (a.num_heads / a.num_kv_heads);
  return launch(&attend_kernel<TQ, TS, TC>, grid, attend_shared_bytes(rows, a.head_d, a.head_dv), stream, a);
}

template <typename TQ>
cudaError_t attend_query_typed(const AttendArgs& a, cudaStream_t stream) {
  switch (a.cache_dtype) {  // FP8 pages: the step rows are their bytes (the binding checks)
    case DType::kFloat16: return attend_typed<TQ, TQ, __half>(a, stream);
    case DType::kBFloat16: return attend_typed<TQ, TQ, __nv_bfloat16>(a, stream);
    case DType::kFloat8E4m3: return attend_typed<TQ, E4m3, E4m3>(a, stream);
    case DType::kFloat8E5m2: return attend_typed<TQ, E5m2, E5m2>(a, stream);
    default: return attend_typed<TQ, TQ, float>(a, stream);
  }
}

template <typename T>
cudaError_t merge_typed(const MergeArgs& a, cudaStream_t stream) {
  const int64_t total = a.num_tokens * a.num_heads * a.head_dv;
  return launch(&merge_splits_kernel<T>, dim3(static_cast<unsigned>((total + kThreads - 1) / kThreads)), 0, stream, a);
}

}  // namespace

size_t attend_shared_bytes(int tile_rows, int head_d, int head_dv) {
  const size_t rows = tile_rows, keys = kBlockKeys;
  return align16(sizeof(int) * keys) + align16(sizeof(float) * keys)  // key tags, biases
         + 5 * align16(sizeof(int) * rows)                              // row tokens, heads, t, raw_from, slot limit
         + align16(sizeof(float) * rows * head_d) + align16(sizeof(float) * rows * head_dv)  // q, acc
         + align16(sizeof(float) * keys * (head_d + head_dv + kKeyStridePad))  // key block
         + align16(sizeof(float) * rows * kProbStride)                         // probabilities
         + 3 * align16(sizeof(float) * rows);                                  // m, l, alpha
}

cudaError_t launch_attend(const AttendArgs& args, cudaStream_t stream) {
  if (args.num_rows == 0 || args.num_q == 0) return cudaSuccess;
  switch (args.query_dtype) {
    case DType::kFloat16: return attend_query_typed<__half>(args, stream);
    case DType::kBFloat16: return attend_query_typed<__nv_bfloat16>(args, stream);
    default: return attend_query_typed<float>(args, stream);
  }
}

cudaError_t launch_merge_splits(const MergeArgs& args, cudaStream_t stream) {
  if (args.num_tokens == 0) return cudaSuccess;
  switch (args.out_dtype) {
    case DType::kFloat16: return merge_typed<__half>(args, stream);
    case DType::kBFloat16: return merge_typed<__nv_bfloat16>(args, stream);
    default: return merge_typed<float>(args, stream);
  }
}

cudaError_t device_limits(int device, int* multiprocessors, int* max_shared_bytes) {
#ifdef CHUNKED_KV_CPU_EMULATION
  (void)device;
  *multiprocessors = emu::kMultiprocessors;
  *max_shared_bytes = emu::kMaxSharedBytes;
  return cudaSuccess;
#else
  static std::mutex lock;
  static std::map<int, std::pair<int, int>> known;  // asked once per device
  const std::lock_guard<std::mutex> guard(lock);
  auto found = known.find(device);
  if (found == known.end()) {
    int sms = 0, shared = 0;
    cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (err == cudaSuccess) err = cudaDeviceGetAttribute(&shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
    if (err != cudaSuccess) return err;
    found = known.emplace(device, std::make_pair(sms, shared)).first;
  }
  *multiprocessors = found->second.first;
  *max_shared_bytes = found->second.second;
  return cudaSuccess;
#endif
}

const char* error_string(cudaError_t err) {
#ifdef CHUNKED_KV_CPU_EMULATION
  return err == cudaSuccess ? "no error" : emu::state().last_error.c_str();
#else
  return cudaGetErrorString(err);
#endif
}

}  // namespace chunked_kv
