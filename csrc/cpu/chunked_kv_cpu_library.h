// A multi-token bf16 tile's two products through the library GEMM
// (chunked_kv_cpu.h `LibraryGemm`: oneDNN's batch-reduce GEMM, on the matrix
// units where the CPU has them), instead of the hand-written register tiles:
//
// 1. logits [R, N] = q_bf16 [R, D] . K^T [D, N], the block's keys packed
//    as B: row-major [D][N], or VNNI pairs [D / 2][N][2] (an odd head's last
//    dim paired with 0); then times the softmax scale;
// 2. acc [R, Dv] += P [R, N] . V [N, Dv], P rounded to bf16 (as
//    FlashAttention rounds it) and the block's values packed as B: [N][Dv],
//    or VNNI pairs of keys [N / 2][Dv][2].
//
// A row no query sees is packed as zeros (its probability is 0, and 0 times
// stale data could be NaN). FP8 pages are packed as bf16, which holds every
// E4M3 and E5M2 value exactly (their scales are applied outside the
// products: k_scale in post_scale, v_scale at the output). Included by
// chunked_kv_cpu_block.h.
#pragma once

#include "chunked_kv_cpu_tile.h"

namespace chunked_kv_cpu {
namespace {

// Element d of a stored row as bf16 bits (exact: bf16 rows as they are, FP8 bytes converted).
template <typename T>
static inline uint16_t bf16_bits(const T* row, int d) {
  if constexpr (IsBf16<T>::value) return row[d].bits;
  else if constexpr (IsFp8<T>::value) return fp8_as_bf16(row[d]);
  else return from_float<Bf16>(to_float(row[d])).bits;  // compiled for every type; only bf16 and FP8 come here
}

template <typename T>
static void library_logits(Tile& t, const Block& b) {
  const bool vnni = g_library->vnni;
  const int k_dims = vnni ? round_up(t.head_d, 2) : t.head_d;
  uint16_t* kt = reinterpret_cast<uint16_t*>(t.kt);      // [k_dims, kBlockKeys] or pairs
  uint16_t* vp = reinterpret_cast<uint16_t*>(t.vp);      // [kBlockKeys, head_dv] or pairs
  for (int n = 0; n < kBlockKeys; ++n) {
    prefetch_ahead(t, n);
    const T* row = n < b.n && b.row[n] ? static_cast<const T*>(b.row[n]) : nullptr;
    for (int d = 0; d < k_dims; ++d) {
      const uint16_t x = row && d < t.head_d ? bf16_bits(row, d) : 0;
      kt[vnni ? ((d / 2) * kBlockKeys + n) * 2 + d % 2 : d * kBlockKeys + n] = x;
    }
    for (int d = 0; d < t.head_dv; ++d) {
      const uint16_t x = row ? bf16_bits(row, t.head_d + d) : 0;
      vp[vnni ? ((n / 2) * t.head_dv + d) * 2 + n % 2 : n * t.head_dv + d] = x;
    }
  }
  g_library->bf16(t.rows, kBlockKeys, k_dims, t.q_stride, kBlockKeys, kBlockKeys, false, t.q_bf16, kt,
                  &t.p[0][0], vnni);
  const vf scale = vset(t.post_scale);
  for (int r = 0; r < t.rows; ++r)
    for (int n = 0; n < kBlockKeys; n += W) vstore(&t.p[r][n], vmul(vload(&t.p[r][n]), scale));
}

static void library_values(Tile& t) {
  for (int r = 0; r < t.rows; ++r)
    for (int n = 0; n < kBlockKeys; ++n) t.p_bf16[r * kBlockKeys + n] = from_float<Bf16>(t.p[r][n]).bits;
  g_library->bf16(t.rows, t.head_dv, kBlockKeys, kBlockKeys, t.head_dv, t.dvp, true, t.p_bf16,
                  reinterpret_cast<const uint16_t*>(t.vp), t.acc, g_library->vnni);
}

}  // namespace
}  // namespace chunked_kv_cpu
