// FP8 pages in the CUDA kernels (vllm_chunked_kv/ops/fp8.py): the byte
// storage types E4m3 (float8_e4m3fn: largest 448, NaN 0x7f / 0xff, no
// infinity) and E5m2 (float8_e5m2: the top byte of an fp16, largest 57,344)
// and their conversions. Plain C++ of __host__ __device__ functions, which
// nvcc compiles for the device and g++ for the CPU emulation alike: one
// conversion, so the emulation stores the bytes a GPU stores (no hardware
// FP8 conversion, which only sm_89+ has). A byte reads as the value it
// encodes; its page's scale (k_scale for keys, v_scale for values) is the
// kernels' to apply.
//
// Reading goes through fp16 bits (exact): E5M2 is the top byte of an fp16;
// E4M3's exponent and mantissa moved into fp16's fields are 2^-8 of its value
// (a bias of 15 instead of 7), NaN where all seven are set. Storing rounds to
// nearest even and saturates at the format's largest finite value, as
// `fp8.quantise` does (a clamp, then torch's cast); NaN stays NaN (0x7f with
// its sign, a NaN in both formats).
#pragma once

#include <cuda_fp16.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

namespace chunked_kv {

struct E4m3 { uint8_t bits; };  // storage types of FP8 pages (and of their step rows: the stored bytes)
struct E5m2 { uint8_t bits; };

template <typename T> struct IsFp8 { static constexpr bool value = false; };
template <> struct IsFp8<E4m3> { static constexpr bool value = true; };
template <> struct IsFp8<E5m2> { static constexpr bool value = true; };

__host__ __device__ __forceinline__ uint32_t float_bits(float x) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(x);
#else
  uint32_t u;
  memcpy(&u, &x, sizeof(u));
  return u;
#endif
}

__host__ __device__ __forceinline__ float half_bits_to_float(uint16_t bits) {
  __half_raw raw;
  raw.x = bits;
  return __half2float(__half(raw));
}

__host__ __device__ __forceinline__ float e4m3_to_float(uint8_t b) {
  const uint16_t mag = b & 0x7f;
  const uint16_t half = mag == 0x7f ? 0x7e00 : static_cast<uint16_t>((mag << 7) | ((b & 0x80) << 8));
  return half_bits_to_float(half) * 256.f;
}

__host__ __device__ __forceinline__ float e5m2_to_float(uint8_t b) {
  return half_bits_to_float(static_cast<uint16_t>(b << 8));
}

// x in an FP8 format of kMan mantissa bits and exponent bias kBias, rounded to
// nearest even, saturated at `largest`.
template <int kMan, int kBias>
__host__ __device__ __forceinline__ uint8_t fp8_bits(float x, float largest) {
  uint32_t u = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7f);  // NaN
  const float a = fminf(fabsf(x), largest);
  constexpr float kMinNormal = 1.f / static_cast<float>(1 << (kBias - 1));  // 2^(1 - bias)
  constexpr float kPerSubnormal = static_cast<float>(1 << (kBias - 1 + kMan));  // subnormal codes per unit
  if (a < kMinNormal)  // subnormal or zero: multiples of kMinNormal / 2^kMan (exact scaling, then rint: to even)
    return static_cast<uint8_t>(sign | static_cast<uint8_t>(rintf(a * kPerSubnormal)));
  u = float_bits(a);
  constexpr int kShift = 23 - kMan;
  u += (1u << (kShift - 1)) - 1u + ((u >> kShift) & 1u);  // the mantissa rounded to kMan bits, to nearest even
  return static_cast<uint8_t>(sign | ((u >> kShift) - (static_cast<uint32_t>(127 - kBias) << kMan)));
}

__host__ __device__ __forceinline__ uint8_t float_to_e4m3(float x) { return fp8_bits<3, 7>(x, 448.f); }
__host__ __device__ __forceinline__ uint8_t float_to_e5m2(float x) { return fp8_bits<2, 15>(x, 57344.f); }

}  // namespace chunked_kv
