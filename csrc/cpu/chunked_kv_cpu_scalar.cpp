// The CPU kernels without vector extensions (the compiler's baseline): any x86-64 or other CPU.
#include "chunked_kv_cpu_write.h"

CHUNKED_KV_TABLE(kScalarTable, "scalar")
