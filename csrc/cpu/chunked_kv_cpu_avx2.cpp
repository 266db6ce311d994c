// The CPU kernels for AVX2 with FMA and F16C.
#if defined(__x86_64__)  // other CPUs build the scalar kernels only
#pragma GCC target("avx2,fma,f16c")
#define CHUNKED_KV_AVX2
#include "chunked_kv_cpu_write.h"

CHUNKED_KV_TABLE(kAvx2Table, "avx2")
#endif
