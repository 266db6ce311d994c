// The AVX-512 BF16 products of the CPU attention kernels (included by
// chunked_kv_cpu_block.h; empty unless the translation unit defines
// CHUNKED_KV_AVX512_BF16): bf16 queries, keys, values and probabilities
// multiplied in pairs by one instruction, the sums kept in fp32; FP8 keys and
// values converted to bf16 lanes on the way (VBMI byte tables).
#pragma once

#include "chunked_kv_cpu_tile.h"

#if defined(CHUNKED_KV_AVX512_BF16)
namespace chunked_kv_cpu {
namespace {

// FP8 bytes as bf16 lanes, exactly, through the byte tables of
// chunked_kv_cpu_simd.h: 64 codes' high and low bytes looked up by one
// two-table byte permute each (AVX-512 VBMI); the sign bit is the code's own.
// Interleaving the two bytes yields the lanes in "lane order": of 64 dims, lo
// holds dims 16L + j and hi dims 16L + 8 + j (128-bit lane L, j < 8). A dot
// product with a query stored in the same order (fp8_lane_order) is the dot
// product in dim order: 3 instructions per 32 dims, where bf16 pages load
// them directly. Here: 64 codes x as bf16 lanes in lane order (lo, hi).
static inline void fp8_to_bf16(__m512i x, const Fp8Bf16Tables& tb, __m512i& lo, __m512i& hi) {
  __m512i h = _mm512_permutex2var_epi8(_mm512_load_si512(tb.hi), x, _mm512_load_si512(tb.hi + 64));
  const __m512i l = _mm512_permutex2var_epi8(_mm512_load_si512(tb.lo), x, _mm512_load_si512(tb.lo + 64));
  h = _mm512_ternarylogic_epi32(h, x, _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // h | (x & 0x80)
  lo = _mm512_unpacklo_epi8(l, h);
  hi = _mm512_unpackhi_epi8(l, h);
}

// The first min(n, 64) FP8 codes at p (zero beyond) as bf16 lanes in lane order.
template <typename T>
static inline void fp8_bf16_lanes(const T* p, int n, __m512i& lo, __m512i& hi) {
  fp8_to_bf16(_mm512_maskz_loadu_epi8(n >= 64 ? ~0ull : (1ull << n) - 1ull, p), bf16_tables(p), lo, hi);
}

// Position of dim d of a head in lane order (fp8_bf16_lanes), per 64 dims.
static inline int fp8_lane_order(int d) {
  const int g = d & ~63, j = d & 63;
  return g + ((j & 8) ? 32 : 0) + 8 * (j >> 4) + (j & 7);
}

// A multi-token tile in bf16: keys packed as bf16 pairs, kt[p][n] = key n's
// dims (2p, 2p + 1), so that one AVX-512 BF16 dot product takes two dims of
// 16 keys against a query row's pair broadcast: R x N logits at twice the
// dims per instruction of the fp32 product, with no conversion of the keys.
template <int NR>
static inline void packed_logits_bf16(Tile& t, int r0, int pairs) {  // t.p[r0 .. r0+NR) = q @ kt
  constexpr int NC = kBlockKeys / 16;
  const int stride = t.q_stride / 2;  // pairs per query row of q_bf16
  const uint32_t* kt = reinterpret_cast<const uint32_t*>(t.kt);  // [pairs, kBlockKeys]
  __m512 acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int p = 0; p < pairs; ++p) {
    __m512bh k[NC];
    for (int c = 0; c < NC; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kt + p * kBlockKeys + c * 16);
    for (int i = 0; i < NR; ++i) {
      uint32_t pair;
      memcpy(&pair, t.q_bf16 + 2 * ((r0 + i) * stride + p), sizeof pair);
      const __m512bh q = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < NC; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], q, k[c]);
    }
  }
  const __m512 scale = _mm512_set1_ps(t.post_scale);
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) _mm512_storeu_ps(&t.p[r0 + i][c * 16], _mm512_mul_ps(acc[i][c], scale));
}

template <typename T>
static void packed_block_bf16(Tile& t, const Block& b) {
  const int pairs = IsFp8<T>::value ? round_up(t.head_d, 64) / 2 : (t.head_d + 1) / 2;
  uint32_t* kt = reinterpret_cast<uint32_t*>(t.kt);
  for (int n = 0; n < kBlockKeys; ++n) {
    prefetch_ahead(t, n);
    const T* row = n < b.n ? static_cast<const T*>(b.row[n]) : nullptr;
    if constexpr (IsBf16<T>::value) {
      for (int p = 0; p < pairs; ++p) {
        uint32_t pair = 0;
        if (row) memcpy(&pair, row + 2 * p, 2 * p + 1 < t.head_d ? 4 : 2);  // an odd head's last dim pairs with 0
        kt[p * kBlockKeys + n] = pair;
      }
    } else {  // FP8: 64 dims at a time as bf16 lanes in lane order, like the queries (zero beyond the head)
      for (int d0 = 0; d0 < t.head_d; d0 += 64) {
        uint32_t lanes[32];
        __m512i lo = _mm512_setzero_si512(), hi = lo;
        if (row) fp8_bf16_lanes(row + d0, t.head_d - d0, lo, hi);
        _mm512_storeu_si512(lanes, lo);
        _mm512_storeu_si512(lanes + 16, hi);
        for (int p = 0; p < 32; ++p) kt[(d0 / 2 + p) * kBlockKeys + n] = lanes[p];
      }
    }
    if (!t.pairs) pack_values(t, row, n);  // pair products read the value rows in place
  }
  int r = 0;
  for (; r + 8 <= t.rows; r += 8) packed_logits_bf16<8>(t, r, pairs);
  for (; r + 4 <= t.rows; r += 4) packed_logits_bf16<4>(t, r, pairs);
  for (; r < t.rows; ++r) packed_logits_bf16<1>(t, r, pairs);
}

// A tile's values in bf16 (AVX-512 BF16): acc [R, Dv] += P [R, N] @ V [N, Dv],
// two keys per dot product. Rows n and n + 1 are interleaved into pairs of one dim
// (unpacklo / unpackhi of 16-bit elements) and each query row's probabilities for
// them are rounded to one bf16 pair, as FlashAttention rounds P for its value
// product; the sums stay fp32. The interleave leaves each 32 dims of an
// accumulator row in pair order: [dims 8L + j], then [dims 8L + 4 + j], for
// 128-bit lanes L and j < 4 (unpair_rows restores the order once per tile).
// FP8 values: rows n and n + 1 interleaved byte by byte into the order whose
// bf16 lanes (fp8_to_bf16) are the pairs above: byte 16L + 2i + s of chunk c is
// row s's dim 32c + 8L + i (bit 6 of an index picks the second row).
struct PairIndex {
  alignas(64) uint8_t idx[2][64];
};
constexpr PairIndex pair_index() {
  PairIndex t{};
  for (int c = 0; c < 2; ++c)
    for (int b = 0; b < 64; ++b)
      t.idx[c][b] = static_cast<uint8_t>(((b & 1) << 6) | (32 * c + 8 * (b / 16) + (b % 16) / 2));
  return t;
}
alignas(64) static constexpr PairIndex kPairIndex = pair_index();

// Chunk c < NC of 32 value dims from d of rows ra, rb (null: zero) as bf16 pairs (lo, hi).
template <typename T, int NC>
static inline void value_pairs(const void* ra, const void* rb, int d, __m512bh (&lo)[NC], __m512bh (&hi)[NC]) {
  const __m512i none = _mm512_setzero_si512();
  if constexpr (IsBf16<T>::value) {
    for (int c = 0; c < NC; ++c) {
      const __m512i x = ra ? _mm512_loadu_si512(static_cast<const Bf16*>(ra) + d + 32 * c) : none;
      const __m512i y = rb ? _mm512_loadu_si512(static_cast<const Bf16*>(rb) + d + 32 * c) : none;
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
  } else {  // FP8: both chunks from one 64-byte load of each row
    const __mmask64 mask = NC == 2 ? ~0ull : 0xffffffffull;
    const T* a = static_cast<const T*>(ra);
    const __m512i x = ra ? _mm512_maskz_loadu_epi8(mask, a + d) : none;
    const __m512i y = rb ? _mm512_maskz_loadu_epi8(mask, static_cast<const T*>(rb) + d) : none;
    for (int c = 0; c < NC; ++c) {
      __m512i l, h;
      fp8_to_bf16(_mm512_permutex2var_epi8(x, _mm512_load_si512(kPairIndex.idx[c]), y), bf16_tables(a), l, h);
      lo[c] = (__m512bh)l;
      hi[c] = (__m512bh)h;
    }
  }
}

template <typename T, int NR, int NC>  // NC chunks of 32 dims from d0
static inline void pv_pairs_chunks(Tile& t, const Block& b, int r0, int d0, const uint32_t (*pp)[kBlockKeys / 2]) {
  __m512 acc[NR][2 * NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < 2 * NC; ++c) acc[i][c] = _mm512_loadu_ps(t.acc + (r0 + i) * t.dvp + d0 + 16 * c);
  for (int n = 0; n < b.n; n += 2) {
    const void* ra = b.row[n];
    const void* rb = n + 1 < b.n ? b.row[n + 1] : nullptr;
    if (!ra && !rb) continue;  // a hidden row weighs 0 and is never read
    __m512bh lo[NC], hi[NC];
    value_pairs<T, NC>(ra, rb, t.head_d + d0, lo, hi);
    for (int i = 0; i < NR; ++i) {
      const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int>(pp[i][n / 2]));
      for (int c = 0; c < NC; ++c) {
        acc[i][2 * c] = _mm512_dpbf16_ps(acc[i][2 * c], p, lo[c]);
        acc[i][2 * c + 1] = _mm512_dpbf16_ps(acc[i][2 * c + 1], p, hi[c]);
      }
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < 2 * NC; ++c) _mm512_storeu_ps(t.acc + (r0 + i) * t.dvp + d0 + 16 * c, acc[i][c]);
}

template <typename T, int NR>
static inline void pv_pairs(Tile& t, const Block& b, int r0) {
  static_assert(kBlockKeys == 32, "one bf16 vector of probabilities per row");
  uint32_t pp[NR][kBlockKeys / 2];  // [row][key pair] bf16 probability pairs
  for (int i = 0; i < NR; ++i)
    _mm512_storeu_si512(pp[i], (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t.p[r0 + i] + 16),
                                                            _mm512_loadu_ps(t.p[r0 + i])));
  int d = 0;
  for (; d + 64 <= t.head_dv; d += 64) pv_pairs_chunks<T, NR, 2>(t, b, r0, d, pp);
  if (d < t.head_dv) pv_pairs_chunks<T, NR, 1>(t, b, r0, d, pp);
}

// The tile's accumulator rows from pair order back to dim order.
static void unpair_rows(Tile& t) {
  float tmp[32];
  for (int r = 0; r < t.rows; ++r)
    for (int d0 = 0; d0 < t.head_dv; d0 += 32) {
      float* acc = t.acc + r * t.dvp + d0;
      memcpy(tmp, acc, sizeof tmp);
      for (int l = 0; l < 4; ++l)
        for (int j = 0; j < 4; ++j) {
          acc[8 * l + j] = tmp[4 * l + j];
          acc[8 * l + 4 + j] = tmp[16 + 4 * l + j];
        }
    }
}

}  // namespace
}  // namespace chunked_kv_cpu
#endif
