// The step plan of a uniform decode batch on CPU, in one call: what
// vllm_chunked_kv/ops/plans/decode_plan.py builds from some eighty small tensor
// ops (a few microseconds each), computed element by element. Same
// definitions (vllm_chunked_kv/core/grid.py), same shapes, same padding;
// tests/ops/test_decode_plan.py holds the two equal. Included by
// chunked_kv_cpu_ext.cpp.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace chunked_kv_plan {

struct Grid {  // the settings the plan reads (ChunkedKVConfig)
  int64_t chunk_size, hop, window, sink_tokens, spg;
};

static inline int64_t floor_div(int64_t a, int64_t b) {  // Python's //, b > 0
  const int64_t q = a / b;
  return q - ((a % b != 0) && (a < 0));
}

static inline int64_t first_group(const Grid& g, int64_t o) { return floor_div(o + g.chunk_size - 1, g.hop); }

static inline int64_t num_sealed(const Grid& g, int64_t t, int64_t o) {
  return std::max<int64_t>(floor_div(t - g.window - (o + g.chunk_size - 1), g.hop) + 1, 0);
}

static inline int64_t raw_from(const Grid& g, int64_t t, int64_t o) {
  const int64_t sealed = num_sealed(g, t, o);
  return o + sealed * g.hop + (sealed > 0 ? g.chunk_size - g.hop : 0);
}

// seq_lens [b]; block tables [b, W] / [b, Wr] (any integer dtype); origins
// [b, Hkv] int64 (each request's, shifted by `align`). raw_cols: columns of
// the raw part (forever_raw of the possible origins + raw_window);
// zero_width: the widest run of slots below a first group (over the
// possible origins). Returns, all int64: the chunk writes (heads,
// src_blocks, src_offsets, src_step, dst_blocks, dst_offsets, zero_heads,
// zero_blocks, zero_offsets), then the key set (query_positions [b, 1],
// raw_blocks, raw_offsets, raw_positions [b, raw_cols], num_raw [b],
// comp_blocks [b, W], num_slots [b]).
static std::vector<at::Tensor> decode_plan(const at::Tensor& seq_lens, const at::Tensor& block_table,
                                           int64_t per_block, const at::Tensor& raw_block_table,
                                           int64_t raw_block_size, const at::Tensor& origins, const Grid& g,
                                           int64_t raw_cols, int64_t zero_width) {
  const auto lens = seq_lens.to(at::kLong).contiguous();
  const auto bt = block_table.to(at::kLong).contiguous();
  const auto rbt = raw_block_table.to(at::kLong).contiguous();
  const auto org = origins.to(at::kLong).contiguous();
  const int64_t b = lens.numel(), width = bt.size(1), raw_width = rbt.size(1), hkv = org.size(1);
  TORCH_CHECK(org.size(0) == b && bt.size(0) >= b && rbt.size(0) >= b, "chunked_kv: decode plan shapes disagree");
  TORCH_CHECK(width > 0 && raw_width > 0, "chunked_kv: decode plan needs block tables");
  const int64_t m = b * hkv, cs = g.chunk_size, spg = g.spg, z0 = zero_width;
  const auto opt = at::TensorOptions().dtype(at::kLong);
  auto make = [&](std::initializer_list<int64_t> shape) { return at::empty(shape, opt); };
  at::Tensor heads = make({m}), src_blocks = make({m, cs}), src_offsets = make({m, cs}), src_step = make({m, cs}),
             dst_blocks = make({m, spg}), dst_offsets = make({m, spg}), zero_heads = make({m * z0}),
             zero_blocks = make({m * z0}), zero_offsets = make({m * z0}), positions = make({b, 1}),
             raw_blocks = make({b, raw_cols}), raw_offsets = make({b, raw_cols}), raw_positions = make({b, raw_cols}),
             num_raw = make({b}), num_slots = make({b});
  int64_t *p_heads = heads.data_ptr<int64_t>(), *p_src_blocks = src_blocks.data_ptr<int64_t>(), *p_src_offsets = src_offsets.data_ptr<int64_t>(), *p_src_step = src_step.data_ptr<int64_t>(), *p_dst_blocks = dst_blocks.data_ptr<int64_t>(), *p_dst_offsets = dst_offsets.data_ptr<int64_t>(), *p_zero_heads = zero_heads.data_ptr<int64_t>(), *p_zero_blocks = zero_blocks.data_ptr<int64_t>(), *p_zero_offsets = zero_offsets.data_ptr<int64_t>(), *p_positions = positions.data_ptr<int64_t>(), *p_raw_blocks = raw_blocks.data_ptr<int64_t>(), *p_raw_offsets = raw_offsets.data_ptr<int64_t>(), *p_raw_positions = raw_positions.data_ptr<int64_t>(), *p_num_raw = num_raw.data_ptr<int64_t>(), *p_num_slots = num_slots.data_ptr<int64_t>();
  const int64_t *len = lens.data_ptr<int64_t>(), *o_all = org.data_ptr<int64_t>();
  const int64_t *tab = bt.data_ptr<int64_t>(), *raw_tab = rbt.data_ptr<int64_t>();
  auto page = [&](int64_t r, int64_t slot) { return tab[r * width + std::min(slot / per_block, width - 1)]; };
  auto raw_page = [&](int64_t r, int64_t pos) {
    const int64_t col = pos / raw_block_size;
    TORCH_CHECK(col < raw_width, "chunked_kv: raw position beyond the raw block table");
    return raw_tab[r * raw_width + col];
  };
  for (int64_t r = 0; r < b; ++r) {
    const int64_t t = len[r] - 1, first = std::max<int64_t>(t, 0);  // -1: a padding request
    const int64_t* o = o_all + r * hkv;
    int64_t keep = g.sink_tokens, window_from = INT64_MAX, slots = 0;
    for (int64_t h = 0; h < hkv; ++h) {
      keep = std::max(keep, o[h]);
      window_from = std::min(window_from, raw_from(g, first, o[h]));
      const int64_t sealed = num_sealed(g, t, o[h]);
      slots = std::max(slots, sealed > 0 ? spg * (sealed + first_group(g, o[h])) : 0);
      // The chunk this token completes, if any (entries that complete none write to the null page).
      const int64_t e = r * hkv + h, rel = t - (o[h] + cs - 1);
      const bool done = rel >= 0 && rel % g.hop == 0;
      const int64_t k = done ? rel / g.hop : 0;
      p_heads[e] = h;
      for (int64_t c = 0; c < cs; ++c) {
        const int64_t pos = done ? o[h] + k * g.hop + c : 0;
        p_src_blocks[e * cs + c] = raw_page(r, pos);
        p_src_offsets[e * cs + c] = pos % raw_block_size;
        p_src_step[e * cs + c] = pos == t ? r : -1;
      }
      const int64_t group = k + first_group(g, o[h]);
      for (int64_t j = 0; j < spg; ++j) {
        const int64_t slot = group * spg + j;
        p_dst_blocks[e * spg + j] = done ? page(r, slot) : 0;
        p_dst_offsets[e * spg + j] = slot % per_block;
      }
      const int64_t unused = first_group(g, o[h]) * spg;  // slots below the first group: zeroed with chunk 0
      for (int64_t z = 0; z < z0; ++z) {
        const bool zero = done && k == 0 && z < unused;
        p_zero_heads[e * z0 + z] = h;
        p_zero_blocks[e * z0 + z] = zero ? page(r, z) : 0;
        p_zero_offsets[e * z0 + z] = z % per_block;
      }
    }
    // Stored raw rows: the kept leading rows, then the raw region before the token; padding after.
    const int64_t leading = std::min(first, keep), start = std::min(std::max(window_from, keep), first);
    const int64_t count = leading + (first - start);
    TORCH_CHECK(count <= raw_cols, "chunked_kv: ", count, " raw rows exceed the plan's ", raw_cols, " columns");
    for (int64_t i = 0; i < raw_cols; ++i) {
      const int64_t pos = i < count ? (i < leading ? i : start + i - leading) : 0;
      p_raw_blocks[r * raw_cols + i] = raw_page(r, pos);
      p_raw_offsets[r * raw_cols + i] = pos % raw_block_size;
      p_raw_positions[r * raw_cols + i] = pos;
    }
    p_num_raw[r] = count;
    p_num_slots[r] = slots;
    p_positions[r] = first;
  }
  return {heads, src_blocks, src_offsets, src_step, dst_blocks, dst_offsets, zero_heads, zero_blocks, zero_offsets,
          positions, raw_blocks, raw_offsets, raw_positions, num_raw, bt.size(0) == b ? bt : bt.slice(0, 0, b),
          num_slots};
}

}  // namespace chunked_kv_plan
