// Torch binding of the CPU kernels (chunked_kv_cpu.h): checks the tensors,
// fills the argument structs (common/chunked_kv_args.h, through the helpers
// the CUDA binding shares, common/chunked_kv_binding.h) and runs the kernels
// of the widest instruction set this CPU has (or the one `set_isa` names),
// with as many OpenMP threads as torch uses. Built on demand by
// vllm_chunked_kv/ops/kernels/cpu_ext.py, which turns a step's `StepPlan`
// into these calls.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstring>
#include <string>
#include <vector>

#include "../common/chunked_kv_binding.h"
#include "chunked_kv_cpu.h"
#include "chunked_kv_cpu_plan.h"

namespace chunked_kv_cpu {
const LibraryGemm* g_library = nullptr;
std::atomic<int64_t> g_library_tiles{0};
}  // namespace chunked_kv_cpu

namespace {

using at::Tensor;
using chunked_kv_cpu::DType;
using chunked_kv_cpu::KernelTable;

std::atomic<int64_t> g_write_calls{0}, g_attend_calls{0}, g_plan_calls{0}, g_pair_tiles{0};

// The instruction sets this CPU can run, widest first.
std::vector<const KernelTable*> supported_tables() {
  std::vector<const KernelTable*> tables;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  if (avx512 && __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vbmi")) tables.push_back(&chunked_kv_cpu::kAvx512Bf16Table);
  if (avx512) tables.push_back(&chunked_kv_cpu::kAvx512Table);
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    tables.push_back(&chunked_kv_cpu::kAvx2Table);
#endif
  tables.push_back(&chunked_kv_cpu::kScalarTable);
  return tables;
}

const KernelTable* g_table = nullptr;  // the kernels in use (null: the widest, chosen on first use)

const KernelTable& table() {
  if (g_table == nullptr) g_table = supported_tables().front();
  return *g_table;
}

// Run the kernels of instruction set `isa` from now on (an error if this CPU lacks it).
void set_isa(const std::string& isa) {
  for (const KernelTable* t : supported_tables()) {
    if (isa == t->isa) {
      g_table = t;
      return;
    }
  }
  TORCH_CHECK(false, "chunked_kv: instruction set ", isa, " is not supported by this CPU");
}

// The device check of the shared helpers.
void on_cpu(const Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cpu(), "chunked_kv: ", name, " must be a CPU tensor");
}

void check_rows(const Tensor& t, const char* name, int64_t dim) {
  chunked_kv_binding::check_rows(on_cpu, t, name, dim);
}

const int64_t* index(const Tensor& t, const char* name, int64_t rows, int64_t cols = -1) {
  return chunked_kv_binding::index(on_cpu, t, name, rows, cols);
}

// The step rows must be in the cache dtype or fp32 (the wrapper converts others); on FP8 pages, their stored bytes.
void check_step_dtype(DType step, DType cache) {
  const bool fp8 = cache == DType::kFloat8E4m3 || cache == DType::kFloat8E5m2;
  TORCH_CHECK(step == cache || (step == DType::kFloat32 && !fp8),
              fp8 ? "chunked_kv: on FP8 pages step_rows must be the step's stored bytes (uint8)"
                  : "chunked_kv: step_rows must be fp32 or the cache dtype");
}

// Zero the slots below a head's first group (`ChunkWrites.zero_*`); entries
// on the null page (a decode plan's placeholders) are skipped.
void zero_slots(Tensor& comp_cache, const Tensor& heads, const Tensor& blocks, const Tensor& offsets) {
  const int64_t z = heads.numel();
  if (!z) return;
  const int64_t* head = index(heads, "zero_heads", z);
  const int64_t* block = index(blocks, "zero_blocks", z);
  const int64_t* offset = index(offsets, "zero_offsets", z);
  const int64_t es = comp_cache.element_size(), row_bytes = comp_cache.size(3) * es;
  char* comp = static_cast<char*>(comp_cache.data_ptr());
  for (int64_t i = 0; i < z; ++i) {
    if (block[i] == 0) continue;  // vLLM's null page: nothing to zero
    TORCH_CHECK(block[i] > 0 && block[i] < comp_cache.size(0) && head[i] >= 0 && head[i] < comp_cache.size(1) &&
                    offset[i] >= 0 && offset[i] < comp_cache.size(2),
                "chunked_kv: zero slot out of range");
    std::memset(comp + (block[i] * comp_cache.stride(0) + head[i] * comp_cache.stride(1) +
                        offset[i] * comp_cache.stride(2)) * es, 0, row_bytes);
  }
}

void write_chunks(Tensor comp_cache, const Tensor& raw_cache, const Tensor& step_rows, const Tensor& gains,
                  const Tensor& heads, const Tensor& src_blocks, const Tensor& src_offsets, const Tensor& src_step,
                  const Tensor& dst_blocks, const Tensor& dst_offsets, const Tensor& zero_heads,
                  const Tensor& zero_blocks, const Tensor& zero_offsets, int64_t head_d, int64_t pool_lo,
                  int64_t pool_hi, bool key_norm, const std::string& fp8, double k_scale, double v_scale) {
  chunked_kv_cpu::WriteArgs a = chunked_kv_binding::write_args(
      on_cpu, comp_cache, raw_cache, step_rows, gains, heads, src_blocks, src_offsets, src_step, dst_blocks,
      dst_offsets, head_d, pool_lo, pool_hi, key_norm, {fp8, k_scale, v_scale});
  TORCH_CHECK(a.chunk_size <= chunked_kv_cpu::kMaxChunk, "chunked_kv: chunk_size above ", chunked_kv_cpu::kMaxChunk);
  check_step_dtype(a.step_dtype, a.cache_dtype);
  zero_slots(comp_cache, zero_heads, zero_blocks, zero_offsets);
  a.num_threads = at::get_num_threads();
  ++g_write_calls;
  if (a.num_chunks) table().write_chunks(a);
}

void attend(const Tensor& query, bool query_is_bf16, const Tensor& step_rows, const Tensor& comp_cache,
            const Tensor& raw_cache, Tensor out, Tensor part_acc, Tensor part_ml, const Tensor& query_index,
            const Tensor& query_positions, const Tensor& raw_blocks, const Tensor& raw_offsets,
            const Tensor& raw_positions, const Tensor& num_raw, const Tensor& comp_blocks, const Tensor& comp_offsets,
            const Tensor& num_slots, int64_t comp_rows_per_page, const Tensor& origins, double scale,
            double log_weight, int64_t window, int64_t sink_tokens, int64_t chunk_size, int64_t hop,
            int64_t slots_per_group, int64_t tile_q, int64_t num_splits, double softcap, const Tensor& sinks,
            int64_t lookback, const std::string& fp8, double k_scale, double v_scale) {
  chunked_kv_cpu::AttendArgs a = chunked_kv_binding::attend_args(
      on_cpu, query, step_rows, comp_cache, raw_cache, out, part_acc, part_ml, query_index, query_positions,
      raw_blocks, raw_offsets, raw_positions, num_raw, comp_blocks, comp_offsets, num_slots, comp_rows_per_page,
      origins, scale, log_weight, window, sink_tokens, chunk_size, hop, slots_per_group, tile_q, num_splits, softcap,
      sinks, lookback, {fp8, k_scale, v_scale});
  TORCH_CHECK(a.query_dtype == DType::kFloat32, "chunked_kv: query must be fp32 (the wrapper converts it)");
  check_step_dtype(a.step_dtype, a.cache_dtype);
  const int group = a.num_heads / a.num_kv_heads;
  TORCH_CHECK(a.tile_q * group <= chunked_kv_cpu::kMaxTileRows, "chunked_kv: a tile of ", a.tile_q, " queries x ",
              group, " heads exceeds ", chunked_kv_cpu::kMaxTileRows, " rows");
  TORCH_CHECK(a.head_dv <= 1024, "chunked_kv: value head size must be in [1, 1024]");
  a.query_is_bf16 = query_is_bf16;
  a.num_threads = at::get_num_threads();
  int64_t pair_tiles = 0;
  a.pair_tiles = &pair_tiles;
  ++g_attend_calls;
  if (a.num_rows && a.num_q) table().attend(a);
  g_pair_tiles += pair_tiles;
}

// Store the step rows of `tokens` [w] at their raw slots (`slots` [n], vLLM's
// slot mapping: page * rows_per_page + row; -1, a padding token, goes to the
// null page 0, which no plan reads): what shared.write_raw does, in one call.
void write_raw(Tensor raw_cache, const Tensor& step_rows, const Tensor& slots, const Tensor& tokens) {
  check_rows(raw_cache, "raw_cache", 4);
  check_rows(step_rows, "step_rows", 3);
  TORCH_CHECK(step_rows.scalar_type() == raw_cache.scalar_type(), "chunked_kv: step_rows must be in the cache dtype");
  TORCH_CHECK(step_rows.size(1) == raw_cache.size(1) && step_rows.size(2) == raw_cache.size(3),
              "chunked_kv: step_rows ", step_rows.sizes(), " do not match the raw cache ", raw_cache.sizes());
  const int64_t w = tokens.size(0), n = step_rows.size(0), per_page = raw_cache.size(2);
  const int64_t* tok = index(tokens, "tokens", w);
  const int64_t* slot = index(slots, "slots", slots.size(0));
  const int64_t es = raw_cache.element_size(), heads = raw_cache.size(1), row_bytes = raw_cache.size(3) * es;
  char* raw = static_cast<char*>(raw_cache.data_ptr());
  const char* step = static_cast<const char*>(step_rows.data_ptr());
  for (int64_t i = 0; i < w; ++i) {
    const int64_t t = tok[i];
    TORCH_CHECK(t >= 0 && t < n && t < slots.size(0), "chunked_kv: token ", t, " out of range");
    const int64_t at = slot[t] >= 0 ? slot[t] : 0;  // padding: the null page
    char* dst = raw + ((at / per_page) * raw_cache.stride(0) + (at % per_page) * raw_cache.stride(2)) * es;
    const char* src = step + t * step_rows.stride(0) * es;
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(dst + h * raw_cache.stride(1) * es, src + h * step_rows.stride(1) * es, row_bytes);
  }
}

void merge_splits(const Tensor& part_acc, const Tensor& part_ml, Tensor out) {
  chunked_kv_cpu::MergeArgs a = chunked_kv_binding::merge_args(on_cpu, part_acc, part_ml, out);
  TORCH_CHECK(a.head_dv <= 1024, "chunked_kv: value head size must be in [1, 1024]");
  a.num_threads = at::get_num_threads();
  table().merge_splits(a);
}

std::vector<Tensor> decode_plan(const Tensor& seq_lens, const Tensor& block_table, int64_t per_block,
                                const Tensor& raw_block_table, int64_t raw_block_size, const Tensor& origins,
                                int64_t chunk_size, int64_t hop, int64_t window, int64_t sink_tokens,
                                int64_t slots_per_group, int64_t raw_cols, int64_t zero_width) {
  TORCH_CHECK(seq_lens.is_cpu() && block_table.is_cpu() && raw_block_table.is_cpu() && origins.is_cpu(),
              "chunked_kv: the CPU decode plan takes CPU tensors");
  TORCH_CHECK(origins.dim() == 2 && hop > 0 && per_block > 0 && raw_block_size > 0, "chunked_kv: bad plan arguments");
  ++g_plan_calls;
  return chunked_kv_plan::decode_plan(seq_lens, block_table, per_block, raw_block_table, raw_block_size, origins,
                                      {chunk_size, hop, window, sink_tokens, slots_per_group}, raw_cols, zero_width);
}

// The library GEMM of chunked_kv_cpu.h: oneDNN's batch-reduce GEMM through ATen.
void library_bf16(int64_t m, int64_t n, int64_t k, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
                  const uint16_t* a, const uint16_t* b, float* c, bool vnni) {
  at::native::cpublas::brgemm(m, n, k, lda, ldb, ldc, add_c, reinterpret_cast<const at::BFloat16*>(a),
                              reinterpret_cast<const at::BFloat16*>(b), c, vnni);
}

void library_release(bool vnni) { at::native::cpublas::brgemm_release(vnni); }

chunked_kv_cpu::LibraryGemm g_library_gemm{library_bf16, library_release, false};
std::string g_gemm_mode = "auto";

// Whether this CPU has the matrix units the library packs for (AMX: VNNI-packed bf16 tiles).
bool matrix_units() { return at::native::cpublas::could_pack(at::kBFloat16); }

// Which path multi-token bf16 tiles take: "library" (oneDNN's batch-reduce
// GEMM), "tiles" (the hand-written register tiles) or "auto" (the library
// where the CPU has matrix units, else the tiles).
void set_gemm(const std::string& mode) {
  TORCH_CHECK(mode == "auto" || mode == "library" || mode == "tiles", "chunked_kv: gemm mode must be auto, library "
              "or tiles, not ", mode);
  g_gemm_mode = mode;
  const bool library = mode == "library" || (mode == "auto" && matrix_units());
  g_library_gemm.vnni = matrix_units();
  chunked_kv_cpu::g_library = library ? &g_library_gemm : nullptr;
}

std::string gemm_path() {
  if (chunked_kv_cpu::g_library == nullptr) return std::string("register tiles (") + table().isa + ")";
  return matrix_units() ? "oneDNN brgemm on the matrix units (AMX)" : "oneDNN brgemm (no matrix units)";
}

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const KernelTable* t : supported_tables()) names.emplace_back(t->isa);
  return names;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("write_raw", &write_raw, "Store the step rows of some tokens at their raw slots");
  m.def("write_chunks", &write_chunks,
        "Pool the chunks a step completes into their compressed slots (fp8: the FP8 format of uint8 pages, or '')");
  m.def("attend", &attend, "Chunked attention of one key set's queries (fp8: the FP8 format of uint8 pages, or '')");
  m.def("decode_plan", &decode_plan, "The index plan of a uniform decode batch (ops/plans/decode_plan.py)");
  m.def("plan_calls", [] { return g_plan_calls.load(); }, "decode_plan calls so far");
  m.def("pair_value_tiles", [] { return g_pair_tiles.load(); },
        "attention tiles so far whose values took bf16 pair products (AVX-512 BF16)");
  m.def("merge_splits", &merge_splits, "Merge split partial softmaxes into out");
  m.def("set_gemm", &set_gemm, "Products of multi-token bf16 tiles: auto, library (oneDNN brgemm) or tiles");
  m.def("gemm_mode", [] { return g_gemm_mode; }, "The mode set_gemm was given");
  m.def("gemm_path", &gemm_path, "The path multi-token bf16 tiles take");
  m.def("matrix_units", &matrix_units, "Whether oneDNN packs bf16 for matrix units (AMX) on this CPU");
  m.def("library_tiles", [] { return chunked_kv_cpu::g_library_tiles.load(); },
        "attention tiles so far whose products went through the library GEMM");
  m.def("isa", [] { return std::string(table().isa); }, "The instruction set whose kernels run");
  m.def("set_isa", &set_isa, "Run the kernels of this instruction set (one of supported_isas())");
  m.def("supported_isas", &supported_isas, "Instruction sets this CPU can run, widest first");
  m.def("calls", [] { return std::make_pair(g_write_calls.load(), g_attend_calls.load()); },
        "(write_chunks, attend) calls so far");
  m.attr("MAX_TILE_ROWS") = chunked_kv_cpu::kMaxTileRows;
  m.attr("MAX_CHUNK") = chunked_kv_cpu::kMaxChunk;
}
