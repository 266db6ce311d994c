// Vector helpers of the CPU kernels for one instruction set, chosen by the
// including translation unit (chunked_kv_cpu_<isa>.cpp) through
// CHUNKED_KV_AVX512 / CHUNKED_KV_AVX2 (neither: scalar). Everything is
// internal (static): each instruction set's copy stays in its own object.
//
// `vf` holds W fp32 lanes. Loads convert from the storage types (fp32, bf16,
// fp16, and the FP8 pages' bytes: E4M3, E5M2) to fp32; the `_n` loads read
// the first n < W elements, zero-filling the rest, and never touch memory
// beyond them. An FP8 byte loads as the value it encodes (its page's scale
// is applied by the kernels, vllm_chunked_kv/ops/fp8.py).
#pragma once

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(CHUNKED_KV_AVX512) || defined(CHUNKED_KV_AVX2)
#include <immintrin.h>
#endif

namespace chunked_kv_cpu {
namespace {

struct Bf16 { uint16_t bits; };  // storage types of the caches, step rows and out
struct Half { uint16_t bits; };
struct E4m3 { uint8_t bits; };   // FP8 pages: float8_e4m3fn (largest 448, NaN 0x7f / 0xff, no infinity)
struct E5m2 { uint8_t bits; };   // FP8 pages: float8_e5m2 (the top byte of an fp16)

// E4M3 as fp16 bits, 2^-8 times its value: exponent and mantissa moved into
// fp16's fields (a bias of 15 instead of 7), NaN where all seven are set.
static inline uint16_t e4m3_half_bits(uint8_t b) {
  if ((b & 0x7f) == 0x7f) return 0x7e00;
  return static_cast<uint16_t>(((b & 0x7f) << 7) | ((b & 0x80) << 8));
}

static inline float to_float(float x) { return x; }
static inline float to_float(Bf16 x) {
  const uint32_t u = static_cast<uint32_t>(x.bits) << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}
static inline float to_float(Half x) {
  _Float16 h;
  memcpy(&h, &x.bits, 2);
  return static_cast<float>(h);
}

static inline float to_float(E4m3 x) { return to_float(Half{e4m3_half_bits(x.bits)}) * 256.f; }
static inline float to_float(E5m2 x) { return to_float(Half{static_cast<uint16_t>(x.bits << 8)}); }

// x in an FP8 format of `man` mantissa bits and exponent bias `bias`, rounded
// to nearest even, saturated at `largest` (NaN stays NaN: 0x7f with its
// sign, a NaN in both formats).
static inline uint8_t fp8_bits(float x, int man, int bias, float largest) {
  uint32_t u;
  memcpy(&u, &x, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);
  float a = fabsf(x);
  a = a < largest ? a : largest;
  const float min_normal = ldexpf(1.f, 1 - bias);
  if (a < min_normal)  // subnormal (or zero): multiples of min_normal / 2^man, rounded to nearest even
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(ldexpf(a, bias - 1 + man))));
  memcpy(&u, &a, 4);
  const int shift = 23 - man;
  u += (1u << (shift - 1)) - 1u + ((u >> shift) & 1u);  // round the mantissa to `man` bits, to nearest even
  u >>= shift;
  return static_cast<uint8_t>(sign | (u - (static_cast<uint32_t>(127 - bias) << man)));
}

template <typename T> static inline T from_float(float x);
template <> inline float from_float<float>(float x) { return x; }
template <> inline Bf16 from_float<Bf16>(float x) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return Bf16{static_cast<uint16_t>((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return Bf16{static_cast<uint16_t>(u >> 16)};
}
template <> inline Half from_float<Half>(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  Half out;
  memcpy(&out.bits, &h, 2);
  return out;
}

template <> inline E4m3 from_float<E4m3>(float x) { return E4m3{fp8_bits(x, 3, 7, 448.f)}; }
template <> inline E5m2 from_float<E5m2>(float x) { return E5m2{fp8_bits(x, 2, 15, 57344.f)}; }

template <typename T> struct IsFp8 { static constexpr bool value = false; };
template <> struct IsFp8<E4m3> { static constexpr bool value = true; };
template <> struct IsFp8<E5m2> { static constexpr bool value = true; };

// Every FP8 value is a bf16: each magnitude code's bf16 bits (E4M3 rebiased by
// 120, E5M2 by 112, subnormals normalised, NaN and E5M2's infinities kept),
// split into a high and a low byte, 128 entries each (the AVX-512 BF16
// kernels look up 64 codes at once, chunked_kv_cpu_bf16.h).
constexpr uint16_t fp8_bf16_bits(int code, int man, int bias) {  // code < 128: sign clear
  const int e = code >> man, m = code & ((1 << man) - 1);
  if (man == 3 && code == 0x7f) return 0x7fc0;             // E4M3: NaN (no infinity)
  if (man == 2 && e == 31) return m ? 0x7fc0 : 0x7f80;     // E5M2: NaN, infinity
  if (e == 0) {
    if (m == 0) return 0;
    int top = man - 1;  // leading bit of the subnormal's mantissa
    while (!(m >> top)) --top;
    return static_cast<uint16_t>(((128 - bias - man + top) << 7) | ((m - (1 << top)) << (7 - top)));
  }
  return static_cast<uint16_t>(((e - bias + 127) << 7) | (m << (7 - man)));
}
struct Fp8Bf16Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
};
constexpr Fp8Bf16Tables fp8_bf16_tables(int man, int bias) {
  Fp8Bf16Tables t{};
  for (int c = 0; c < 128; ++c) {
    t.hi[c] = static_cast<uint8_t>(fp8_bf16_bits(c, man, bias) >> 8);
    t.lo[c] = static_cast<uint8_t>(fp8_bf16_bits(c, man, bias) & 0xff);
  }
  return t;
}
alignas(64) static constexpr Fp8Bf16Tables kE4m3Bf16 = fp8_bf16_tables(3, 7);
alignas(64) static constexpr Fp8Bf16Tables kE5m2Bf16 = fp8_bf16_tables(2, 15);
static inline const Fp8Bf16Tables& bf16_tables(const E4m3*) { return kE4m3Bf16; }
static inline const Fp8Bf16Tables& bf16_tables(const E5m2*) { return kE5m2Bf16; }

// One FP8 code as bf16 bits, from the tables.
template <typename T>
static inline uint16_t fp8_as_bf16(T x) {
  const Fp8Bf16Tables& tb = bf16_tables(&x);
  const int c = x.bits & 0x7f;
  return static_cast<uint16_t>((tb.hi[c] << 8) | tb.lo[c] | ((x.bits & 0x80) << 8));
}

// x rounded to the storage type T and back (what storing it in T keeps).
template <typename T> static inline float round_to(float x) { return to_float(from_float<T>(x)); }

#if defined(CHUNKED_KV_AVX512)
constexpr int W = 16;
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vset(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
static inline float vhmax(vf a) { return _mm512_reduce_max_ps(a); }
static inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
static inline __mmask16 first_n(int n) { return static_cast<__mmask16>((1u << n) - 1u); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vf vload_n(const float* p, int n) { return _mm512_maskz_loadu_ps(first_n(n), p); }
static inline vf bf16_lanes(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
static inline vf vload(const Bf16* p) { return bf16_lanes(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline vf vload_n(const Bf16* p, int n) { return bf16_lanes(_mm256_maskz_loadu_epi16(first_n(n), p)); }
static inline vf vload(const Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
static inline vf vload_n(const Half* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(first_n(n), p)); }
// 16 FP8 bytes widened to 16-bit lanes, as fp16 bits (E4M3: 2^-8 of the value, NaN kept), then fp32.
static inline vf e4m3_lanes(__m128i b) {
  const __m256i x = _mm256_cvtepu8_epi16(b);
  const __m256i mag = _mm256_and_si256(x, _mm256_set1_epi16(0x7f));
  __m256i h = _mm256_or_si256(_mm256_slli_epi16(mag, 7), _mm256_slli_epi16(_mm256_and_si256(x, _mm256_set1_epi16(0x80)), 8));
  h = _mm256_mask_mov_epi16(h, _mm256_cmpeq_epi16_mask(mag, _mm256_set1_epi16(0x7f)), _mm256_set1_epi16(0x7e00));
  return _mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f));
}
static inline vf e5m2_lanes(__m128i b) { return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 8)); }
static inline vf vload(const E4m3* p) { return e4m3_lanes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline vf vload_n(const E4m3* p, int n) { return e4m3_lanes(_mm_maskz_loadu_epi8(first_n(n), p)); }
static inline vf vload(const E5m2* p) { return e5m2_lanes(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
static inline vf vload_n(const E5m2* p, int n) { return e5m2_lanes(_mm_maskz_loadu_epi8(first_n(n), p)); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
// y * 2^n for integral n, and 0 where x < lo.
static inline vf vscale_live(vf y, vf n, vf x, float lo) {
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, vset(lo), _CMP_GE_OQ), _mm512_scalef_ps(y, n));
}

// Lane sums of sixteen vectors as one vector, by a transpose-and-add tree (45
// instructions where sixteen separate reductions take about 130):
//   sum4(a, b, c, d): each 128-bit lane L holds [a, b, c, d] summed over lane L;
//   fold_lanes(x, y): 128-bit lanes [x0 + x1, x2 + x3, y0 + y1, y2 + y3].
// sum16 of v[0..15] holds the sum of v[n]'s lanes at element n.
static inline vf sum4(vf a, vf b, vf c, vf d) {
  const vf ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));  // [a02 b02 a13 b13] per lane
  const vf cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  return _mm512_add_ps(_mm512_shuffle_ps(ab, cd, 0x44), _mm512_shuffle_ps(ab, cd, 0xEE));
}
static inline vf fold_lanes(vf x, vf y) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}
#elif defined(CHUNKED_KV_AVX2)
constexpr int W = 8;
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vset(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline float vsum(vf a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline float vhmax(vf a) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline void vstore(float* p, vf a) { _mm256_storeu_ps(p, a); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vf vload(const Bf16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
static inline vf vload(const Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
// 8 FP8 bytes, as in the AVX-512 loads.
static inline vf vload(const E4m3* p) {
  const __m128i x = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(x, _mm_set1_epi16(0x7f));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7), _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8));
  const __m128i nan = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7f));
  return _mm256_mul_ps(_mm256_cvtph_ps(_mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan)), _mm256_set1_ps(256.f));
}
static inline vf vload(const E5m2* p) {
  return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 8));
}
template <typename T>
static inline vf vload_n(const T* p, int n) {  // through a zeroed copy: no 16-bit masked loads in AVX2
  T tmp[W];
  memset(tmp, 0, sizeof(tmp));
  memcpy(tmp, p, sizeof(T) * n);
  return vload(tmp);
}
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
static inline vf vscale_live(vf y, vf n, vf x, float lo) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_cmp_ps(x, vset(lo), _CMP_GE_OQ), vmul(y, _mm256_castsi256_ps(e)));
}
#else
constexpr int W = 1;
typedef float vf;
static inline vf vzero() { return 0.f; }
static inline vf vset(float x) { return x; }
static inline vf vfma(vf a, vf b, vf c) { return a * b + c; }
static inline vf vmul(vf a, vf b) { return a * b; }
static inline vf vsub(vf a, vf b) { return a - b; }
static inline vf vadd(vf a, vf b) { return a + b; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
static inline vf vdiv(vf a, vf b) { return a / b; }
static inline float vsum(vf a) { return a; }
static inline float vhmax(vf a) { return a; }
static inline void vstore(float* p, vf a) { *p = a; }
template <typename T> static inline vf vload(const T* p) { return to_float(*p); }
template <typename T> static inline vf vload_n(const T* p, int) { return to_float(*p); }
static inline vf vexp(vf x) { return x < -87.33654f ? 0.f : expf(x); }
#endif

#if defined(CHUNKED_KV_AVX512) || defined(CHUNKED_KV_AVX2)
// e^x (Cephes' polynomial, ~1 ulp); 0 below -87.3, so e^-inf = 0.
static inline vf vexp(vf x) {
  constexpr float lo = -87.33654f;
  const vf c = vmin(vmax(x, vset(lo)), vset(88.37626f));
  const vf n = vround(vmul(c, vset(1.44269504f)));
  vf r = vfma(n, vset(-0.693359375f), c);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf y = vset(1.9875691500e-4f);
  y = vfma(y, r, vset(1.3981999507e-3f));
  y = vfma(y, r, vset(8.3334519073e-3f));
  y = vfma(y, r, vset(4.1665795894e-2f));
  y = vfma(y, r, vset(1.6666665459e-1f));
  y = vfma(y, r, vset(5.0000001201e-1f));
  y = vfma(y, vmul(r, r), vadd(r, vset(1.f)));
  return vscale_live(y, n, x, lo);
}
#endif

// tanh(x) = 1 - 2 / (e^2x + 1), exactly -1 and 1 at the ends (e^2x is 0 or
// huge there); absolute error about 1e-7 near 0.
static inline vf vtanh(vf x) { return vsub(vset(1.f), vdiv(vset(2.f), vadd(vexp(vadd(x, x)), vset(1.f)))); }

// The first `n` elements at p, as fp32 (a full vector when n >= W).
template <typename T>
static inline vf vload_upto(const T* p, int n) { return n >= W ? vload(p) : vload_n(p, n); }

static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

}  // namespace
}  // namespace chunked_kv_cpu
