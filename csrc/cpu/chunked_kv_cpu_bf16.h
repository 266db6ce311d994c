// The AVX-512 BF16 products of the CPU attention kernels (included by
// chunked_kv_cpu_block.h; empty unless the translation unit defines
// CHUNKED_KV_AVX512_BF16): bf16 queries, keys, values and probabilities
// multiplied in pairs by one instruction, the sums kept in fp32.
#pragma once

#include "chunked_kv_cpu_tile.h"

#if defined(CHUNKED_KV_AVX512_BF16)
namespace chunked_kv_cpu {
namespace {

// 32 FP8 bytes (the first under `mask`, the rest 0) as bf16 lanes, exactly: exponent and
// mantissa moved into bf16's fields with the exponent rebiased (E4M3 by 120, E5M2 by 112),
// subnormals (m * 2^-9, m * 2^-16) from a table, NaN (and E5M2's infinities) kept as such.
alignas(64) static const uint16_t kE4m3Subnormals[32] = {0, 0x3B00, 0x3B80, 0x3BC0, 0x3C00, 0x3C20, 0x3C40, 0x3C60};
alignas(64) static const uint16_t kE5m2Subnormals[32] = {0, 0x3780, 0x3800, 0x3840};

template <int Man, int Rebias, int SpecialFrom>  // mantissa bits; exponent rebias; first all-ones-exponent code
static inline __m512i fp8_bf16_lanes(const void* p, __mmask32 mask, const uint16_t* subnormals) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(mask, p));
  const __m512i mag = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
  __m512i h = _mm512_add_epi16(_mm512_slli_epi16(mag, 7 - Man), _mm512_set1_epi16(Rebias << 7));
  h = _mm512_mask_permutexvar_epi16(h, _mm512_cmplt_epu16_mask(mag, _mm512_set1_epi16(1 << Man)), mag,
                                    _mm512_load_si512(subnormals));
  const __m512i special = _mm512_or_si512(  // infinity, or NaN with the code's mantissa
      _mm512_set1_epi16(0x7f80), _mm512_slli_epi16(_mm512_and_si512(mag, _mm512_set1_epi16((1 << Man) - 1)), 7 - Man));
  h = _mm512_mask_mov_epi16(h, _mm512_cmpge_epu16_mask(mag, _mm512_set1_epi16(SpecialFrom)), special);
  return _mm512_or_si512(h, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}
static inline __m512i bf16_lanes(const E4m3* p, __mmask32 mask) {
  return fp8_bf16_lanes<3, 120, 0x7f>(p, mask, kE4m3Subnormals);
}
static inline __m512i bf16_lanes(const E5m2* p, __mmask32 mask) {
  return fp8_bf16_lanes<2, 112, 0x7c>(p, mask, kE5m2Subnormals);
}

// A multi-token tile in bf16: keys packed as bf16 pairs, kt[p][n] = key n's
// dims (2p, 2p + 1), so that one AVX-512 BF16 dot product takes two dims of
// 16 keys against a query row's pair broadcast: R x N logits at twice the
// dims per instruction of the fp32 product, with no conversion of the keys.
template <int NR>
static inline void packed_logits_bf16(Tile& t, int r0, int pairs) {  // t.p[r0 .. r0+NR) = q @ kt
  constexpr int NC = kBlockKeys / 16;
  const int stride = round_up(t.head_d, 32) / 2;  // pairs per query row of q_bf16
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
  const int pairs = (t.head_d + 1) / 2;
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
    } else {  // FP8: 32 dims at a time as bf16 lanes (zero beyond the head: an odd head's last dim pairs with 0)
      for (int d0 = 0; d0 < t.head_d; d0 += 32) {
        const int left = t.head_d - d0;
        uint32_t lanes[16];
        _mm512_storeu_si512(lanes, row ? bf16_lanes(row + d0, left >= 32 ? ~0u : (1u << left) - 1u)
                                       : _mm512_setzero_si512());
        for (int p = 0; p < 16 && 2 * p < left; ++p) kt[(d0 / 2 + p) * kBlockKeys + n] = lanes[p];
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
template <int NR, int NC>  // NC chunks of 32 dims from d0
static inline void pv_pairs_chunks(Tile& t, const Block& b, int r0, int d0, const uint32_t (*pp)[kBlockKeys / 2]) {
  __m512 acc[NR][2 * NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < 2 * NC; ++c) acc[i][c] = _mm512_loadu_ps(t.acc + (r0 + i) * t.dvp + d0 + 16 * c);
  const __m512i none = _mm512_setzero_si512();
  for (int n = 0; n < b.n; n += 2) {
    const void* ra = b.row[n];
    const void* rb = n + 1 < b.n ? b.row[n + 1] : nullptr;
    if (!ra && !rb) continue;  // a hidden row weighs 0 and is never read
    __m512bh lo[NC], hi[NC];
    for (int c = 0; c < NC; ++c) {
      const int d = t.head_d + d0 + 32 * c;
      const __m512i x = ra ? _mm512_loadu_si512(static_cast<const Bf16*>(ra) + d) : none;
      const __m512i y = rb ? _mm512_loadu_si512(static_cast<const Bf16*>(rb) + d) : none;
      lo[c] = (__m512bh)_mm512_unpacklo_epi16(x, y);
      hi[c] = (__m512bh)_mm512_unpackhi_epi16(x, y);
    }
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

template <int NR>
static inline void pv_pairs(Tile& t, const Block& b, int r0) {
  static_assert(kBlockKeys == 32, "one bf16 vector of probabilities per row");
  uint32_t pp[NR][kBlockKeys / 2];  // [row][key pair] bf16 probability pairs
  for (int i = 0; i < NR; ++i)
    _mm512_storeu_si512(pp[i], (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(t.p[r0 + i] + 16),
                                                            _mm512_loadu_ps(t.p[r0 + i])));
  int d = 0;
  for (; d + 64 <= t.head_dv; d += 64) pv_pairs_chunks<NR, 2>(t, b, r0, d, pp);
  if (d < t.head_dv) pv_pairs_chunks<NR, 1>(t, b, r0, d, pp);
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
