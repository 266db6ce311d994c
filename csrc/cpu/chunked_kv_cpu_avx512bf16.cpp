// The CPU kernels for AVX-512 with BF16 dot products and VBMI byte permutes (Zen 4, Sapphire Rapids
// and later): chosen at run time by chunked_kv_cpu_ext.cpp when the CPU has them.
#if defined(__x86_64__)  // other CPUs build the scalar kernels only
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vbmi,fma,f16c")
#define CHUNKED_KV_AVX512
#define CHUNKED_KV_AVX512_BF16
#include "chunked_kv_cpu_write.h"

CHUNKED_KV_TABLE(kAvx512Bf16Table, "avx512bf16")
#endif
