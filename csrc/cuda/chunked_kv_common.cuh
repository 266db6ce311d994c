// What the chunked KV kernels share: storage types (the FP8 pages' from
// chunked_kv_fp8.cuh), the visibility rule of docs/design.md §3 and §10,
// shared-memory carving and the launch macro (a real launch, or the CPU
// emulation of cpu_emulation.h).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#include "chunked_kv.h"
#include "chunked_kv_fp8.cuh"

#ifdef CHUNKED_KV_CPU_EMULATION
#include "cpu_emulation.h"
#endif

namespace chunked_kv {

constexpr float kNegBig = -1.0e30f;  // finite start of a running max: exp(-inf - kNegBig) == 0
constexpr size_t kDefaultSharedBytes = 48 * 1024;  // above this a kernel must opt in

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(E4m3 x) { return e4m3_to_float(x.bits); }
__device__ __forceinline__ float to_float(E5m2 x) { return e5m2_to_float(x.bits); }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ E4m3 from_float<E4m3>(float x) { return E4m3{float_to_e4m3(x)}; }
template <> __device__ __forceinline__ E5m2 from_float<E5m2>(float x) { return E5m2{float_to_e5m2(x)}; }

// x rounded to the storage type T, as fp32.
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_float(from_float<T>(x)); }

// 1 / x for x >= 1 (a softmax sum), within 2 ulp, without the subroutine
// call (and register spills) of an IEEE division.
__device__ __forceinline__ float reciprocal(float x) {
#ifdef CHUNKED_KV_CPU_EMULATION
  return 1.f / x;
#else
  return __fdividef(1.f, x);
#endif
}

// Positions and slot indices are 32-bit in the kernels (64-bit division is a
// subroutine call on the GPU); memory offsets are 64-bit.

// The seal rule on a grid starting at `origin`, for a query at `t`: the
// number of sealed chunks and the first position of the raw region after them.
struct Seal {
  int sealed, raw_from;
};

__device__ __forceinline__ Seal seal(int t, int window, int origin, int chunk_size, int hop) {
  const int slack = t - window - (origin + chunk_size - 1);
  const int sealed = slack >= 0 ? slack / hop + 1 : 0;
  return {sealed, sealed > 0 ? origin + (sealed - 1) * hop + chunk_size : origin};
}

// Slot s of a request: its slot group (a chunk's group) and its SlotKind,
// with 1 or kBoundarySlots slots per group (divisions by constants: no
// runtime integer division).
__device__ __forceinline__ int slot_group(int s, int slots_per_group) {
  return slots_per_group == kBoundarySlots ? s / kBoundarySlots : s;
}
__device__ __forceinline__ int slot_kind(int s, int slots_per_group) { return slots_per_group == kBoundarySlots ? s % kBoundarySlots : kPooled; }

// Whether compressed slot `s` holds a row at all (whatever the query): its
// chunk exists on this head's grid, a pooled row's chunk does not lie wholly
// in the sinks, and a kept first token is not a sink
// (a sink is attended once, as a raw row).
__device__ __forceinline__ bool slot_exists(int s, int origin, int first_group, int sink_tokens, int chunk_size,
                                            int hop, int slots_per_group) {
  const int kind = slot_kind(s, slots_per_group);
  const int k = slot_group(s, slots_per_group) - first_group;
  const int first = origin + k * hop;
  const int last = first + chunk_size - 1;
  if (k < 0) return false;
  return kind == kFirst ? first >= sink_tokens : last >= sink_tokens;
}

__host__ __device__ __forceinline__ size_t align16(size_t bytes) { return (bytes + 15) & ~static_cast<size_t>(15); }

// Carves consecutive 16-byte aligned arrays out of dynamic shared memory.
struct SharedCarver {
  unsigned char* cursor;
  size_t used = 0;

  template <typename T>
  __device__ T* take(int64_t count) {
    T* p = reinterpret_cast<T*>(cursor + used);
    used += align16(sizeof(T) * static_cast<size_t>(count));
#ifdef CHUNKED_KV_CPU_EMULATION
    if (used > emu::shared_bytes()) emu::fail("shared memory carved beyond the launch's dynamic size");
#endif
    return p;
  }
};

__device__ __forceinline__ unsigned char* dynamic_shared() {
#ifdef CHUNKED_KV_CPU_EMULATION
  return emu::shared_memory();
#else
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  return shared_bytes;
#endif
}

// Launch `kernel` (a pointer to a __global__ function taking one struct).
template <typename Kernel, typename Args>
cudaError_t launch(Kernel kernel, dim3 grid, size_t shared, cudaStream_t stream, const Args& args) {
#ifdef CHUNKED_KV_CPU_EMULATION
  (void)stream;
  return emu::launch(grid, dim3(kThreads), shared, [&] { kernel(args); }) ? cudaSuccess : cudaErrorLaunchFailure;
#else
  if (shared > kDefaultSharedBytes) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(shared));
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, shared, stream>>>(args);
  return cudaGetLastError();
#endif
}

}  // namespace chunked_kv
