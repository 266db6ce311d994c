// Chunked attention over the compressed layout on CPU (docs/design.md §3-4,
// §10): what ops/kernels/compressed.py `attend` computes, without its dense bias.
// Included by each instruction set's translation unit.
//
// Work items are (key-set row, query tile, KV head, split), spread over
// OpenMP threads. A tile holds up to tile_q queries of one request times the
// GQA group of one KV head; it folds, block by block (chunked_kv_cpu_block.h),
// the three parts of its key set:
//
// 1. the stored raw rows (sinks, rows before the grid origin, the raw region
//    before the step), read from the raw pages through (block, offset);
// 2. the step's own rows, only the two index ranges the tile can see (the
//    forever-raw prefix and the raw region from its first query on);
// 3. the request's compressed slots up to the last group sealed for the
//    tile's last query; a pooled row enters with logit bias log_weight.
//
// Visibility per (query, row) comes from positions and the settings alone,
// the rule step_plan.visibility_bias writes as a tensor. A long context is split
// into num_splits contiguous ranges of these parts, each writing a partial
// softmax (max, sum, weighted values) that merge_splits combines.
#pragma once

#include <stdlib.h>

#include "chunked_kv_cpu_block.h"

namespace chunked_kv_cpu {
namespace {

// How far ahead rows are asked for: while row i is folded, row i + kAheadRows
// is asked for (4 KB ahead at head 64 in bf16). A work item starts with a
// burst of that many rows, so a longer distance costs the short items of a
// batch at small contexts (measured: two blocks ahead made a 14-request step
// at 540 tokens 1.4x slower, and a 32k step no faster).
constexpr int64_t kAheadRows = kBlockKeys / 2;

struct Seal {  // grid.num_sealed / grid.raw_from for one query position
  int64_t sealed, raw_from;
};

static inline Seal seal(const AttendArgs& a, int64_t t, int64_t origin) {
  const int64_t slack = t - a.window - (origin + a.chunk_size - 1);
  const int64_t sealed = slack >= 0 ? slack / a.hop + 1 : 0;
  return {sealed, sealed > 0 ? origin + (sealed - 1) * a.hop + a.chunk_size : origin};
}

template <typename T>
static void store_row(void* out, int64_t offset, const float* acc, float inv, int n) {
  T* dst = static_cast<T*>(out) + offset;
  for (int d = 0; d < n; ++d) dst[d] = from_float<T>(acc[d] * inv);
}

static void store_out(DType dtype, void* out, int64_t offset, const float* acc, float inv, int n) {
  switch (dtype) {
    case DType::kBFloat16: return store_row<Bf16>(out, offset, acc, inv, n);
    case DType::kFloat16: return store_row<Half>(out, offset, acc, inv, n);
    default: return store_row<float>(out, offset, acc, inv, n);
  }
}

struct TileQueries {  // the queries of one tile
  int64_t count, t_lo;
  Seal s[kMaxTileRows];
  int64_t prefix_end, origin, first_group;
  int64_t lookback;  // the layer's own sliding window (0: none)
};

// Whether the query at t reads position j through a sliding window of `lookback` tokens (0: none).
static inline bool in_window(int64_t t, int64_t j, int64_t lookback) { return lookback == 0 || t - j < lookback; }

// Rows past the end of a short block are seen by no query.
static inline void hide_beyond(Block& b, int64_t queries) {
  for (int m = 0; m < queries; ++m)
    for (int n = b.n; n < kBlockKeys; ++n) b.add[m][n] = -INFINITY;
}

// Fold rows [lo, hi) of a part whose row i sits at position pos(i) and
// address row(i): raw rows, visible to the forever-raw prefix and the raw
// region, causally.
template <typename T, typename Pos, typename Row>
static void fold_raw(Tile& t, Block& b, const TileQueries& tq, int64_t lo, int64_t hi, Pos pos, Row row) {
  t.row_bytes = (t.head_d + t.head_dv) * static_cast<int>(sizeof(T));
  for (int64_t i = lo; i < min64(hi, lo + kAheadRows); ++i) prefetch_row(row(i), t.row_bytes);
  for (int64_t i0 = lo; i0 < hi; i0 += kBlockKeys) {
    b.n = static_cast<int>(min64(kBlockKeys, hi - i0));
    t.ahead_n = static_cast<int>(max64(0, min64(kBlockKeys, hi - i0 - kAheadRows)));
    for (int n = 0; n < t.ahead_n; ++n) t.ahead[n] = row(i0 + kAheadRows + n);
    for (int n = 0; n < b.n; ++n) {
      const int64_t j = pos(i0 + n);
      bool any = false;
      for (int m = 0; m < tq.count; ++m) {
        const bool v = (j < tq.prefix_end || j >= tq.s[m].raw_from) && j <= tq.t_lo + m &&
                       in_window(tq.t_lo + m, j, tq.lookback);
        b.add[m][n] = v ? 0.f : -INFINITY;
        any |= v;
      }
      b.row[n] = any ? static_cast<const void*>(row(i0 + n)) : nullptr;
    }
    hide_beyond(b, tq.count);
    fold_block<T>(t, b);
  }
}

// Fold compressed slots [lo, hi) of key-set row `row` on KV head `head`.
template <typename TC>
static void fold_slots(const AttendArgs& a, Tile& t, Block& b, const TileQueries& tq, int64_t row, int head,
                       int64_t lo, int64_t hi) {
  const int spg = a.slots_per_group;
  const TC* comp = static_cast<const TC*>(a.comp_cache);
  const int64_t per_page = a.comp_rows_per_page;  // 0: a page and a row per slot
  const int64_t* blocks = a.comp_blocks + row * (per_page ? a.max_slots / per_page : a.max_slots);
  const int64_t* offsets = per_page ? nullptr : a.comp_offsets + row * a.max_slots;
  const int shift = per_page && !(per_page & (per_page - 1)) ? __builtin_ctzll(per_page) : -1;  // no division
  const TC* head_rows = comp + head * a.stride_ch;
  const auto slot_row = [&](int64_t s) {
    if (!per_page) return head_rows + blocks[s] * a.stride_cb + offsets[s] * a.stride_cs;
    const int64_t page = shift >= 0 ? s >> shift : s / per_page;
    return head_rows + blocks[page] * a.stride_cb + (s - page * per_page) * a.stride_cs;
  };
  t.row_bytes = (a.head_d + a.head_dv) * static_cast<int>(sizeof(TC));
  for (int64_t s = lo; s < min64(hi, lo + kAheadRows); ++s) prefetch_row(slot_row(s), t.row_bytes);
  for (int64_t s0 = lo; s0 < hi; s0 += kBlockKeys) {
    b.n = static_cast<int>(min64(kBlockKeys, hi - s0));
    t.ahead_n = static_cast<int>(max64(0, min64(kBlockKeys, hi - s0 - kAheadRows)));
    for (int n = 0; n < t.ahead_n; ++n) t.ahead[n] = slot_row(s0 + kAheadRows + n);
    int kind = static_cast<int>(s0 % spg);  // slot s0 + n's kind and chunk, counted on (no division per slot)
    int64_t k = s0 / spg - tq.first_group;
    for (int n = 0; n < b.n; ++n) {
      const int64_t s = s0 + n;
      const int64_t first = tq.origin + k * a.hop;
      const bool exists = k >= 0 && (kind == kFirst ? first >= a.sink_tokens : first + a.chunk_size - 1 >= a.sink_tokens);
      const float bias = kind == kPooled ? a.log_weight : 0.f;
      const int64_t leaves = kind == kFirst ? first : first + a.chunk_size - 1;  // grid.slot_position
      bool any = false;
      for (int m = 0; m < tq.count; ++m) {
        const bool v = exists && s < spg * (tq.s[m].sealed + tq.first_group) && in_window(tq.t_lo + m, leaves, tq.lookback);
        b.add[m][n] = v ? bias : -INFINITY;
        any |= v;
      }
      b.row[n] = any ? slot_row(s) : nullptr;
      if (++kind == spg) {
        kind = 0;
        ++k;
      }
    }
    hide_beyond(b, tq.count);
    fold_block<TC>(t, b);
  }
}

static void load_queries(const AttendArgs& a, Tile& t, const int64_t* tokens, int head) {
  const int group = t.group, q_stride = t.q_stride;
  const float* query = static_cast<const float*>(a.query);  // fp32 on CPU
  for (int r = 0; r < t.rows; ++r) {
    const float* src = query + tokens[r / group] * a.stride_qt + (int64_t)(head * group + r % group) * a.stride_qh;
    for (int d = 0; d < t.dp; ++d) t.q[r * t.dp + d] = d < t.head_d ? src[d] * a.scale * a.key_scale : 0.f;
    if (t.dot_bf16) {
      uint16_t* qb = t.q_bf16 + r * q_stride;
      for (int d = 0; d < q_stride; ++d) qb[d] = 0;
#if defined(CHUNKED_KV_AVX512_BF16)
      if (t.q_lanes) {
        for (int d = 0; d < t.head_d; ++d) qb[fp8_lane_order(d)] = from_float<Bf16>(src[d]).bits;
      } else
#endif
        for (int d = 0; d < t.head_d; ++d) qb[d] = from_float<Bf16>(src[d]).bits;
    }
    t.m[r] = kNegBig;
    t.l[r] = 0.f;
    for (int d = 0; d < t.dvp; ++d) t.acc[r * t.dvp + d] = 0.f;
  }
}

constexpr int kPairTile = 1, kLibraryTile = 2;  // what attend_item reports

template <typename TC, typename TS>
// Returns kPairTile if the tile's values took bf16 pair products, kLibraryTile if its products went through the library.
static int attend_item(const AttendArgs& a, Tile& t, Block& b, int64_t row, int64_t tile, int head, int split) {
  const int group = a.num_heads / a.num_kv_heads;
  const int64_t q_row = row * a.num_q, first = tile * a.tile_q;
  const int64_t* tokens = a.query_index + q_row + first;
  TileQueries tq;
  tq.count = min64(a.num_q - first, a.tile_q);
  const int64_t p0 = a.query_positions[q_row];
  tq.t_lo = p0 + first;
  const int64_t t_hi = tq.t_lo + tq.count - 1;
  tq.origin = a.origins[row * a.num_kv_heads + head];  // the request's grid on this KV head
  tq.first_group = (tq.origin + a.chunk_size - 1) / a.hop;
  tq.prefix_end = max64(a.sink_tokens, tq.origin);
  tq.lookback = a.lookback;
  for (int m = 0; m < tq.count; ++m) tq.s[m] = seal(a, tq.t_lo + m, tq.origin);
  t.rows = static_cast<int>(tq.count) * group;
  t.packed = t.rows > kPackRows;
  // bf16 or FP8 pages with step rows of the same type (FP8: always), read as bf16
  constexpr bool bf16_exact = BfExact<TC>::value && std::is_same<TC, TS>::value;
#if defined(CHUNKED_KV_AVX512_BF16)
  t.dot_bf16 = a.query_is_bf16;
  t.pairs = t.dot_bf16 && bf16_exact && a.head_dv % 32 == 0;  // value pair products (bf16.h)
#else
  t.dot_bf16 = t.pairs = false;
#endif
  t.library = g_library != nullptr && t.packed && a.query_is_bf16 && bf16_exact;
  if (t.library) {
    t.dot_bf16 = true;  // the GEMM reads the bf16 queries
    t.pairs = false;
  }
#if defined(CHUNKED_KV_AVX512_BF16)
  t.q_lanes = t.dot_bf16 && !t.library && IsFp8<TC>::value;  // FP8 keys read as bf16 lanes (bf16.h)
#else
  t.q_lanes = false;
#endif
  load_queries(a, t, tokens, head);
  if (a.sinks && split == 0)  // a learned sink logit: in the denominator from the start, no value
    for (int r = 0; r < t.rows; ++r) {
      t.m[r] = a.sinks[head * group + r % group];
      t.l[r] = 1.f;
    }

  // The parts' index ranges, then this split's share of their concatenation.
  const int64_t num_raw = a.num_raw[row];
  const int64_t raw_lo = tq.s[0].raw_from, sealed_hi = seal(a, t_hi, tq.origin).sealed;
  const int64_t tail_hi = t_hi - p0 + 1, tail_lo = max64(raw_lo - p0, 0);
  const int64_t pre_hi = min64(max64(min64(tq.prefix_end, raw_lo) - p0, 0), tail_hi);
  const int64_t limit = min64(a.num_slots[row], a.slots_per_group * (sealed_hi + tq.first_group));
  // With a sliding window, slots start at the first chunk whose last token the first query still sees
  // (grid.first_lookback_slot): vLLM may have freed the pages below it.
  const int64_t behind = tq.t_lo - a.lookback - tq.origin - a.chunk_size + 1;
  const int64_t slot_lo = a.lookback ? a.slots_per_group * ((behind >= 0 ? behind / a.hop + 1 : 0) + tq.first_group) : 0;
  const int64_t lens[4] = {num_raw, pre_hi, max64(tail_hi - tail_lo, 0), max64(limit - slot_lo, 0)};
  const int64_t starts[4] = {0, 0, tail_lo, slot_lo};
  const int64_t total = lens[0] + lens[1] + lens[2] + lens[3];
  const int64_t lo = total * split / a.num_splits, hi = total * (split + 1) / a.num_splits;
  int64_t range[4][2], offset = 0;
  for (int p = 0; p < 4; ++p) {
    range[p][0] = starts[p] + max64(lo - offset, 0);
    range[p][1] = starts[p] + min64(hi - offset, lens[p]);
    offset += lens[p];
  }

  const TC* raw = static_cast<const TC*>(a.raw_cache);
  const int64_t* raw_pos = a.raw_positions + row * a.max_raw;
  const int64_t* raw_blk = a.raw_blocks + row * a.max_raw;
  const int64_t* raw_off = a.raw_offsets + row * a.max_raw;
  fold_raw<TC>(t, b, tq, range[0][0], range[0][1], [&](int64_t i) { return raw_pos[i]; },
               [&](int64_t i) { return raw + raw_blk[i] * a.stride_rb + head * a.stride_rh + raw_off[i] * a.stride_rs; });
  const TS* step = static_cast<const TS*>(a.step_rows);
  const int64_t* own = a.query_index + q_row;
  const auto own_pos = [&](int64_t i) { return p0 + i; };
  const auto own_row = [&](int64_t i) { return step + own[i] * a.stride_st + head * a.stride_sh; };
  fold_raw<TS>(t, b, tq, range[1][0], range[1][1], own_pos, own_row);
  fold_raw<TS>(t, b, tq, range[2][0], range[2][1], own_pos, own_row);
  fold_slots<TC>(a, t, b, tq, row, head, range[3][0], range[3][1]);
#if defined(CHUNKED_KV_AVX512_BF16)
  if (t.pairs) unpair_rows(t);
#endif

  for (int r = 0; r < t.rows; ++r) {
    const int64_t token = tokens[r / group], q_head = (int64_t)head * group + r % group;
    const float* acc = t.acc + r * t.dvp;  // sum of p * stored values: times value_scale (FP8 pages) is the output
    if (a.num_splits == 1) {
      store_out(a.out_dtype, a.out, token * a.stride_ot + q_head * a.stride_oh, acc,
                t.l[r] > 0 ? a.value_scale / t.l[r] : 0.f, t.head_dv);
      continue;
    }
    const int64_t flat = (split * a.num_tokens + token) * a.num_heads + q_head;
    for (int d = 0; d < t.head_dv; ++d) a.part_acc[flat * t.head_dv + d] = acc[d] * a.value_scale;
    a.part_ml[flat] = t.m[r];
    a.part_ml[(int64_t)a.num_splits * a.num_tokens * a.num_heads + flat] = t.l[r];
  }
  if (t.library) g_library->release(g_library->vnni);
  return (t.pairs ? kPairTile : 0) | (t.library ? kLibraryTile : 0);
}

struct TileBuffers {
  Tile* tile;
  Block* block;
  void* memory;
};

static TileBuffers make_buffers(const AttendArgs& a) {
  const int rows = kMaxTileRows, dp = round_up(a.head_d, W), dvp = round_up(a.head_dv, W);
  // Every part starts on a cache line: vector loads of a row then never straddle two.
  const size_t tile = round_up(sizeof(Tile), 64), block = round_up(sizeof(Block), 64);
  const size_t q = rows * dp, qb = rows * round_up(a.head_d, 64), acc = rows * dvp, kt = dp * kBlockKeys,
               vp = kBlockKeys * dvp;  // q, acc, kt and vp are multiples of 16 floats (64 bytes)
  const size_t pb = rows * kBlockKeys;  // bf16 probabilities (library)
  const size_t bytes = tile + block + 4 * (q + acc + kt + vp) + 2 * (qb + pb) + 256;
  char* mem = static_cast<char*>(aligned_alloc(64, round_up(static_cast<int>(bytes), 64)));
  memset(mem, 0, bytes);
  Tile* t = reinterpret_cast<Tile*>(mem);
  Block* b = reinterpret_cast<Block*>(mem + tile);
  float* f = reinterpret_cast<float*>(mem + tile + block);
  t->q = f;
  t->acc = t->q + q;
  t->kt = t->acc + acc;
  t->vp = t->kt + kt;
  t->q_bf16 = reinterpret_cast<uint16_t*>(t->vp + vp);
  t->p_bf16 = t->q_bf16 + qb;
  t->group = a.num_heads / a.num_kv_heads;
  t->head_d = a.head_d;
  t->head_dv = a.head_dv;
  t->dp = dp;
  t->dvp = dvp;
  t->q_stride = round_up(a.head_d, 64);
  t->post_scale = a.scale * a.key_scale;
  t->softcap = a.softcap;
  return {t, b, mem};
}

template <typename TC, typename TS>
static void attend_typed(const AttendArgs& a) {
  const int64_t tiles = (a.num_q + a.tile_q - 1) / a.tile_q;
  const int64_t items = a.num_rows * tiles * a.num_kv_heads * a.num_splits;
  int64_t pairs = 0, library = 0;
#pragma omp parallel num_threads(a.num_threads) reduction(+ : pairs, library)
  {
    TileBuffers buf = make_buffers(a);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int split = static_cast<int>(item % a.num_splits);
      const int64_t rest = item / a.num_splits;
      const int head = static_cast<int>(rest % a.num_kv_heads);
      const int64_t row_tile = rest / a.num_kv_heads;
      const int kind = attend_item<TC, TS>(a, *buf.tile, *buf.block, row_tile / tiles, row_tile % tiles, head, split);
      pairs += (kind & kPairTile) != 0;
      library += (kind & kLibraryTile) != 0;
    }
    free(buf.memory);
  }
  if (a.pair_tiles) *a.pair_tiles += pairs;
  g_library_tiles += library;
}

static void merge_splits_impl(const MergeArgs& a) {
  const int64_t rows = a.num_tokens * a.num_heads, plane = (int64_t)a.num_splits * rows;
#pragma omp parallel for num_threads(a.num_threads) schedule(static)
  for (int64_t i = 0; i < rows; ++i) {
    float top = kNegBig, total = 0.f;
    for (int s = 0; s < a.num_splits; ++s) top = a.part_ml[s * rows + i] > top ? a.part_ml[s * rows + i] : top;
    float merged[1024];  // head_dv <= 1024 (checked by the binding)
    for (int d = 0; d < a.head_dv; ++d) merged[d] = 0.f;
    for (int s = 0; s < a.num_splits; ++s) {
      const float w = expf(a.part_ml[s * rows + i] - top);
      total += w * a.part_ml[plane + s * rows + i];
      const float* acc = a.part_acc + (s * rows + i) * a.head_dv;
      for (int d = 0; d < a.head_dv; ++d) merged[d] += w * acc[d];
    }
    const int64_t token = i / a.num_heads, head = i % a.num_heads;
    store_out(a.out_dtype, a.out, token * a.stride_ot + head * a.stride_oh, merged, total > 0 ? 1.f / total : 0.f,
              a.head_dv);
  }
}

}  // namespace
}  // namespace chunked_kv_cpu
