// The state of one tile of the CPU attention kernels (included by
// chunked_kv_cpu_block.h inside one instruction set's translation unit): the
// tile, the block of key rows it folds, and the helpers every fold uses.
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
  bool library;  // products through the library GEMM (chunked_kv_cpu_library.h)
  bool pairs;  // acc holds each 32 dims in bf16 pair order (pv_pairs; unpair_rows restores it)
  float post_scale;  // the softmax scale, applied to bf16 dot products (the fp32 queries carry it)
  float softcap;     // the model's logit cap (0: none), applied before the block's bias
  float* q;          // [rows, dp] queries times the scale, fp32, zero-padded
  uint16_t* q_bf16;  // [rows, q_stride] bf16 queries, unscaled (dot_bf16 only)
  int q_stride;      // round_up(head_d, 64)
  bool q_lanes;      // q_bf16 rows in FP8 lane order (fp8_lane_order), for FP8 keys read as bf16 lanes
  float* acc;        // [rows, dvp]
  float* kt;         // [dp, kBlockKeys] packed keys, transposed (bf16 pairs [dp / 2, kBlockKeys] if dot_bf16)
  float* vp;         // [kBlockKeys, dvp] packed values (bf16 [kBlockKeys, head_dv] for the library)
  uint16_t* p_bf16;  // [rows, kBlockKeys] probabilities in bf16 (library only)
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

template <typename T> struct IsBf16 { static constexpr bool value = false; };
template <> struct IsBf16<Bf16> { static constexpr bool value = true; };
// Storage types whose every value bf16 holds exactly: bf16, and the FP8 formats (their scales apply outside).
template <typename T> struct BfExact { static constexpr bool value = IsBf16<T>::value || IsFp8<T>::value; };

// Row n's values into the packed block, fp32, zero-padded (zero for a row no
// query sees: its weight is 0, and 0 x stale data could be NaN).
template <typename T>
static inline void pack_values(Tile& t, const T* row, int n) {
  float* vrow = t.vp + n * t.dvp;
  for (int d = 0; d < t.dvp; d += W)
    vstore(vrow + d, row && d < t.head_dv ? vload_upto(row + t.head_d + d, t.head_dv - d) : vzero());
}

}  // namespace
}  // namespace chunked_kv_cpu
