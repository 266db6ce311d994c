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
//    straight from the row, every query row of a register block from one
//    load of each key vector (bf16 pairs through AVX-512 BF16 dot products
//    when queries are bf16 and keys bf16 or FP8), the lane sums of sixteen
//    keys taken together on AVX-512; a multi-token tile first packs the
//    block's keys transposed (bf16 pairs for AVX-512 BF16 dot products when
//    queries are bf16 and keys bf16 or FP8, else fp32) and runs a
//    register-blocked R x N product;
// 2. the online softmax update per query row, vectorised (hidden logits weigh 0),
//    after the model's logit cap when it has one;
// 3. acc [R, Dv] += P [R, N] @ V [N, Dv], register-blocked, each value
//    vector loaded once per row block: bf16 or FP8 values two keys per AVX-512 BF16
//    dot product (chunked_kv_cpu_bf16.h), others in fp32 (packed for
//    multi-token tiles).
//
// Multi-token tiles of bf16 queries over bf16 or FP8 pages may take both
// products through the library GEMM instead (chunked_kv_cpu_library.h); the
// softmax stays here.
//
// The tile and block types: chunked_kv_cpu_tile.h.
#pragma once

#include "chunked_kv_cpu_bf16.h"
#include "chunked_kv_cpu_library.h"
#include "chunked_kv_cpu_tile.h"

namespace chunked_kv_cpu {
namespace {

// --- 1. logits

// Query rows r0 .. r0+NR against one key, unreduced: out[i]'s lanes sum to row i's
// logit (before post_scale when Bf: bf16 pairs through AVX-512 BF16 dot products).
template <typename T, int NR, bool Bf>
static inline void key_partials(const Tile& t, int r0, const T* key, vf out[NR]) {
  vf acc[NR];  // in registers across the loop (out may live in memory)
  for (int i = 0; i < NR; ++i) acc[i] = vzero();
#if defined(CHUNKED_KV_AVX512_BF16)
  if constexpr (Bf && IsBf16<T>::value) {
    const int stride = t.q_stride;
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
  if constexpr (Bf && IsFp8<T>::value) {  // FP8 keys as bf16 lanes, against queries in the same order
    const uint16_t* q = t.q_bf16 + r0 * t.q_stride;
    for (int d = 0; d < t.head_d; d += 64) {
      __m512i lo, hi;
      fp8_bf16_lanes(key + d, t.head_d - d, lo, hi);
      for (int i = 0; i < NR; ++i) {
        const uint16_t* qi = q + i * t.q_stride + d;
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(qi), (__m512bh)lo);
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_loadu_si512(qi + 32), (__m512bh)hi);
      }
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

template <typename T>
static void block_logits(Tile& t, const Block& b) {
  if (t.library) return library_logits<T>(t, b);
  if (t.packed) {
#if defined(CHUNKED_KV_AVX512_BF16)
    if constexpr (BfExact<T>::value) {
      if (t.dot_bf16) return packed_block_bf16<T>(t, b);
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
  if (BfExact<T>::value && t.dot_bf16)  // bf16 keys, or FP8 keys read as bf16 lanes
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
  if (t.library) return library_values(t);
#if defined(CHUNKED_KV_AVX512_BF16)
  if constexpr (BfExact<T>::value) {  // bf16 or FP8 pages (attend_item's t.pairs)
    if (t.pairs)
      return row_blocks(t.rows, [&](auto nr, int r0) { pv_pairs<T, decltype(nr)::value>(t, b, r0); });
  }
#endif
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
