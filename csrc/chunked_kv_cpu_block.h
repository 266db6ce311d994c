// One tile's online softmax over blocks of key rows (CPU kernels; included
// by chunked_kv_cpu_attend.h inside one instruction set's translation unit).
//
// A tile is up to kMaxTileRows query rows (queries x the GQA group of one KV
// head) that read the same key rows. A block is up to kBlockKeys rows, each
// given by a pointer to its keys (its values follow at head_d), or null when
// no row of the tile sees it (it is then never read), and what each query
// adds to its logit: the row's bias if the query sees it, else -inf.
// Folding a block:
//
// 1. logits [R, N]: few rows (a decode's GQA group) take dot products
//    straight from the row, every query row from one load of each key
//    vector (bf16 pairs through AVX-512 BF16 dot products when queries and
//    keys are bf16); a multi-token tile first packs the block's keys
//    transposed (bf16 pairs for AVX-512 BF16 dot products when queries and
//    keys are bf16, else fp32) and runs a register-blocked R x N product;
// 2. the online softmax update per query row, vectorised (hidden logits weigh 0),
//    after the model's logit cap when it has one;
// 3. acc [R, Dv] += P [R, N] @ V [N, Dv], register-blocked, each value
//    vector loaded once per row group (packed in fp32 for multi-token tiles).
#pragma once

#include <type_traits>

#include "chunked_kv_cpu.h"
#include "chunked_kv_cpu_simd.h"

namespace chunked_kv_cpu {
namespace {

constexpr float kNegBig = -1.0e30f;  // finite start of the running max
constexpr int kRowBlock = W >= 16 ? 4 : 2;  // query rows per register block
constexpr int kPackRows = 8;  // tiles with more query rows pack each block's rows in fp32

struct Tile {
  int rows, group;  // query rows; query row r is query r / group
  int head_d, head_dv, dp, dvp;  // head sizes, padded to whole vectors
  bool packed, dot_bf16;
  float post_scale;  // the softmax scale, applied to bf16 dot products (the fp32 queries carry it)
  float softcap;     // the model's logit cap (0: none), applied before the block's bias
  float* q;          // [rows, dp] queries times the scale, fp32, zero-padded
  uint16_t* q_bf16;  // [rows, round_up(head_d, 32)] bf16 queries, unscaled (dot_bf16 only)
  float* acc;        // [rows, dvp]
  float* kt;         // [dp, kBlockKeys] packed keys, transposed (bf16 pairs [dp / 2, kBlockKeys] if dot_bf16)
  float* vp;         // [kBlockKeys, dvp] packed values
  float m[kMaxTileRows], l[kMaxTileRows];
  float p[kMaxTileRows][kBlockKeys];  // logits, then probabilities
  const void* ahead[kBlockKeys];      // the next block's rows, fetched while this one is folded
  int ahead_n, row_bytes;
};

struct Block {
  int n;                                  // rows in the block
  const void* row[kBlockKeys];            // keys, values at + head_d; null: seen by none
  float add[kMaxTileRows][kBlockKeys];    // [query][row]: bias if seen, else -inf (also beyond n)
};

// Ask for a row's cache lines ahead of its use: a KV head's rows run 4 KB
// at most before the next page, which hardware prefetchers do not cross.
// Always inlined: GCC's pure-function analysis counts a prefetch as no side
// effect, so a call to an outlined helper holding only prefetches is deleted
// as dead code (GCC 12 -O3 did so for prefetch_ahead, leaving none in the
// fold loop).
#define CHUNKED_KV_PREFETCH_INLINE inline __attribute__((always_inline))
static CHUNKED_KV_PREFETCH_INLINE void prefetch_row(const void* row, int bytes) {
  const char* p = static_cast<const char*>(row);
  for (int off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 1);
}

// The next block's row n, asked for while row n of this block is folded
// (one row at a time: a burst of a whole block would overflow the misses
// a core can have in flight).
static CHUNKED_KV_PREFETCH_INLINE void prefetch_ahead(const Tile& t, int n) {
  if (n < t.ahead_n) prefetch_row(t.ahead[n], t.row_bytes);
}

// f(NR, r0) over the tile's query rows: blocks of kRowBlock rows, then the rest as one block.
template <typename F>
static inline void row_blocks(int rows, F&& f) {
  int r = 0;
  for (; r + kRowBlock <= rows; r += kRowBlock) f(std::integral_constant<int, kRowBlock>{}, r);
  switch (rows - r) {
    case 3:
      if constexpr (kRowBlock > 3) f(std::integral_constant<int, 3>{}, r);
      break;
    case 2:
      if constexpr (kRowBlock > 2) f(std::integral_constant<int, 2>{}, r);
      break;
    case 1: f(std::integral_constant<int, 1>{}, r); break;
  }
}

// --- 1. logits

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<Bf16> { static constexpr bool value = true; };

// Query rows r0 .. r0+NR against one key, unreduced: out[i]'s lanes sum to row i's
// logit (before post_scale when Bf: bf16 pairs through AVX-512 BF16 dot products).
template <typename T, int NR, bool Bf>
static inline void key_partials(const Tile& t, int r0, const T* key, vf out[NR]) {
  vf acc[NR];  // in registers across the loop (out may live in memory)
  for (int i = 0; i < NR; ++i) acc[i] = vzero();
#if defined(CHUNKED_KV_AVX512_BF16)
  if constexpr (Bf && IsBf16<T>::value) {
    const int stride = round_up(t.head_d, 32);
    const uint16_t* q = t.q_bf16 + r0 * stride;
    for (int d = 0; d < t.head_d; d += 32) {
      const int left = t.head_d - d;
      const __mmask32 mask = left >= 32 ? ~0u : (1u << left) - 1u;
      const __m512bh k = (__m512bh)_mm512_maskz_loadu_epi16(mask, key + d);
      for (int i = 0; i < NR; ++i)
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(q + i * stride + d), k);
    }
    for (int i = 0; i < NR; ++i) out[i] = acc[i];
    return;
  }
#endif
  const float* q = t.q + r0 * t.dp;
  for (int d = 0; d < t.head_d; d += W) {
    const vf k = vload_upto(key + d, t.head_d - d);
    for (int i = 0; i < NR; ++i) acc[i] = vfma(vload(q + i * t.dp + d), k, acc[i]);
  }
  for (int i = 0; i < NR; ++i) out[i] = acc[i];
}

#if defined(CHUNKED_KV_AVX512)
// Logits of rows r0 .. r0+NR straight from the key rows, sixteen keys at a
// time, their lane sums taken together (sum4, fold_lanes).
template <typename T, int NR, bool Bf>
static void direct_logits(Tile& t, const Block& b, int r0) {
  const vf scale = vset(Bf ? t.post_scale : 1.f);
  for (int n0 = 0; n0 < kBlockKeys; n0 += 16) {
    if (n0 >= b.n) {  // no rows: any finite logit does, the block's -inf hides it
      for (int i = 0; i < NR; ++i) vstore(&t.p[r0 + i][n0], vzero());
      continue;
    }
    vf half[2][NR];
#pragma GCC unroll 2
    for (int h = 0; h < 2; ++h) {
      vf quad[2][NR];
#pragma GCC unroll 2
      for (int q4 = 0; q4 < 2; ++q4) {
        vf v[4][NR];
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const int n = n0 + 8 * h + 4 * q4 + k;
          if (r0 == 0) prefetch_ahead(t, n);
          const void* row = n < b.n ? b.row[n] : nullptr;
          if (row) {
            key_partials<T, NR, Bf>(t, r0, static_cast<const T*>(row), v[k]);
          } else {
            for (int i = 0; i < NR; ++i) v[k][i] = vzero();
          }
        }
        for (int i = 0; i < NR; ++i) quad[q4][i] = sum4(v[0][i], v[1][i], v[2][i], v[3][i]);
      }
      for (int i = 0; i < NR; ++i) half[h][i] = fold_lanes(quad[0][i], quad[1][i]);
    }
    for (int i = 0; i < NR; ++i) vstore(&t.p[r0 + i][n0], vmul(fold_lanes(half[0][i], half[1][i]), scale));
  }
}
#else
// Logits of rows r0 .. r0+NR straight from the key rows, one key at a time.
template <typename T, int NR, bool Bf>
static void direct_logits(Tile& t, const Block& b, int r0) {
  for (int n = 0; n < kBlockKeys; ++n) {
    if (r0 == 0) prefetch_ahead(t, n);
    if (n >= b.n || !b.row[n]) continue;
    vf v[NR];
    key_partials<T, NR, Bf>(t, r0, static_cast<const T*>(b.row[n]), v);
    for (int i = 0; i < NR; ++i) t.p[r0 + i][n] = vsum(v[i]);
  }
}
#endif

template <int NR>
static inline void packed_logits(Tile& t, int r0) {  // t.p[r0 .. r0+NR) = q @ kt
  constexpr int NC = kBlockKeys / W;
  vf acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = vzero();
  for (int d = 0; d < t.head_d; ++d) {
    vf k[NC];
    for (int c = 0; c < NC; ++c) k[c] = vload(t.kt + d * kBlockKeys + c * W);
    for (int i = 0; i < NR; ++i) {
      const vf q = vset(t.q[(r0 + i) * t.dp + d]);
      for (int c = 0; c < NC; ++c) acc[i][c] = vfma(q, k[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) vstore(&t.p[r0 + i][c * W], acc[i][c]);
}

// Row n's values into the packed block, fp32, zero-padded (zero for a row no
// query sees: its weight is 0, and 0 x stale data could be NaN).
template <typename T>
static inline void pack_values(Tile& t, const T* row, int n) {
  float* vrow = t.vp + n * t.dvp;
  for (int d = 0; d < t.dvp; d += W)
    vstore(vrow + d, row && d < t.head_dv ? vload_upto(row + t.head_d + d, t.head_dv - d) : vzero());
}

#if defined(CHUNKED_KV_AVX512_BF16)
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

static void packed_block_bf16(Tile& t, const Block& b) {
  const int pairs = (t.head_d + 1) / 2;
  uint32_t* kt = reinterpret_cast<uint32_t*>(t.kt);
  for (int n = 0; n < kBlockKeys; ++n) {
    prefetch_ahead(t, n);
    const Bf16* row = n < b.n ? static_cast<const Bf16*>(b.row[n]) : nullptr;
    for (int p = 0; p < pairs; ++p) {
      uint32_t pair = 0;
      if (row) memcpy(&pair, row + 2 * p, 2 * p + 1 < t.head_d ? 4 : 2);  // an odd head's last dim pairs with 0
      kt[p * kBlockKeys + n] = pair;
    }
    pack_values(t, row, n);
  }
  int r = 0;
  for (; r + 8 <= t.rows; r += 8) packed_logits_bf16<8>(t, r, pairs);
  for (; r + 4 <= t.rows; r += 4) packed_logits_bf16<4>(t, r, pairs);
  for (; r < t.rows; ++r) packed_logits_bf16<1>(t, r, pairs);
}
#endif

template <typename T>
static void block_logits(Tile& t, const Block& b) {
  if (t.packed) {
#if defined(CHUNKED_KV_AVX512_BF16)
    if constexpr (IsBf16<T>::value) {
      if (t.dot_bf16) return packed_block_bf16(t, b);
    }
#endif
    for (int n = 0; n < kBlockKeys; ++n) {
      prefetch_ahead(t, n);
      const T* row = n < b.n ? static_cast<const T*>(b.row[n]) : nullptr;
      for (int d = 0; d < t.head_d; ++d) t.kt[d * kBlockKeys + n] = row ? to_float(row[d]) : 0.f;
      pack_values(t, row, n);
    }
    row_blocks(t.rows, [&](auto nr, int r0) { packed_logits<decltype(nr)::value>(t, r0); });
    return;
  }
#if defined(CHUNKED_KV_AVX512_BF16)
  if (IsBf16<T>::value && t.dot_bf16)
    return row_blocks(t.rows, [&](auto nr, int r0) { direct_logits<T, decltype(nr)::value, true>(t, b, r0); });
#endif
  row_blocks(t.rows, [&](auto nr, int r0) { direct_logits<T, decltype(nr)::value, false>(t, b, r0); });
}

// --- 2. online softmax

static void block_softmax(Tile& t, const Block& b) {
  const bool capped = t.softcap > 0;
  const vf cap = vset(t.softcap), inv_cap = vset(capped ? 1.f / t.softcap : 0.f);
  for (int r = 0; r < t.rows; ++r) {
    float* lg = t.p[r];
    const float* add = b.add[r / t.group];
    vf top = vset(-INFINITY);
    for (int n = 0; n < kBlockKeys; n += W) {
      vf x = vload(lg + n);
      if (capped) x = vmul(cap, vtanh(vmul(x, inv_cap)));
      x = vadd(x, vload(add + n));
      vstore(lg + n, x);
      top = vmax(top, x);
    }
    const float block_max = vhmax(top);
    if (block_max == -INFINITY) {  // nothing seen in this block
      for (int n = 0; n < kBlockKeys; ++n) lg[n] = 0.f;
      continue;
    }
    const float m_new = block_max > t.m[r] ? block_max : t.m[r];
    const float alpha = expf(t.m[r] - m_new);
    vf sum = vzero();
    for (int n = 0; n < kBlockKeys; n += W) {
      const vf e = vexp(vsub(vload(lg + n), vset(m_new)));
      vstore(lg + n, e);
      sum = vadd(sum, e);
    }
    t.l[r] = t.l[r] * alpha + vsum(sum);
    t.m[r] = m_new;
    if (alpha != 1.f) {
      float* acc = t.acc + r * t.dvp;
      for (int d = 0; d < t.dvp; d += W) vstore(acc + d, vmul(vload(acc + d), vset(alpha)));
    }
  }
}

// --- 3. values

template <typename T, int NR, int NC>
static inline void pv_block(Tile& t, const Block& b, int r0, int d0, const T* const* values, int stride) {
  vf acc[NR][NC];
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) acc[i][c] = vload(t.acc + (r0 + i) * t.dvp + d0 + c * W);
  for (int n = 0; n < b.n; ++n) {
    if (!values[n]) continue;
    const T* v = values[n] + d0;
    vf x[NC];
    for (int c = 0; c < NC; ++c) x[c] = vload_upto(v + c * W, stride - d0 - c * W);
    for (int i = 0; i < NR; ++i) {
      const vf p = vset(t.p[r0 + i][n]);
      for (int c = 0; c < NC; ++c) acc[i][c] = vfma(p, x[c], acc[i][c]);
    }
  }
  for (int i = 0; i < NR; ++i)
    for (int c = 0; c < NC; ++c) vstore(t.acc + (r0 + i) * t.dvp + d0 + c * W, acc[i][c]);
}

template <typename T, int NR>
static inline void pv_rows(Tile& t, const Block& b, int r0, const T* const* values, int stride) {
  int d = 0;
  for (; d + 4 * W <= t.dvp; d += 4 * W) pv_block<T, NR, 4>(t, b, r0, d, values, stride);
  for (; d < t.dvp; d += W) pv_block<T, NR, 1>(t, b, r0, d, values, stride);
}

template <typename T>
static void block_values(Tile& t, const Block& b) {
  const void* ptrs[kBlockKeys];
  int stride = t.head_dv;  // readable elements of each value row
  if (t.packed) {
    for (int n = 0; n < b.n; ++n) ptrs[n] = b.row[n] ? t.vp + n * t.dvp : nullptr;
    stride = t.dvp;
  } else {
    for (int n = 0; n < b.n; ++n) ptrs[n] = b.row[n] ? static_cast<const T*>(b.row[n]) + t.head_d : nullptr;
  }
  auto run = [&](auto tag) {
    using V = decltype(tag);
    const V* const* values = reinterpret_cast<const V* const*>(ptrs);
    row_blocks(t.rows, [&](auto nr, int r0) { pv_rows<V, decltype(nr)::value>(t, b, r0, values, stride); });
  };
  if (t.packed) run(float{});
  else run(T{});
}

template <typename T>
static void fold_block(Tile& t, const Block& b) {
  if (b.n == 0) return;
  block_logits<T>(t, b);
  block_softmax(t, b);
  block_values<T>(t, b);
}

}  // namespace
}  // namespace chunked_kv_cpu
