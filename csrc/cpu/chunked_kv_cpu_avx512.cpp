// The CPU kernels for AVX-512 (F, BW, VL, DQ) without BF16 dot products.
#if defined(__x86_64__)  // other CPUs build the scalar kernels only
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
#define CHUNKED_KV_AVX512
#include "chunked_kv_cpu_write.h"

CHUNKED_KV_TABLE(kAvx512Table, "avx512")
#endif
