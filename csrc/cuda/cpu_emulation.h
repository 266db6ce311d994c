// CPU emulation of the part of CUDA's execution model the chunked KV kernels
// use, so that their very source runs (slowly) on a machine without a GPU:
// compiled with a host compiler and CHUNKED_KV_CPU_EMULATION (this header
// included after the CUDA headers, whose names it would shadow), the kernels'
// blocks run one after another, each thread of a block a fiber (ucontext)
// that yields at __syncthreads. Only 1-D blocks, dynamic shared memory and
// __syncthreads are provided (no warp intrinsics, no atomics).
//
// It is strict where a GPU would be lenient or random: shared memory starts
// as all-ones bytes (NaN floats, -1 integers), the threads of a block run in
// a different pseudo-random order between every two barriers (a race within
// a phase shows up as a wrong result), a barrier that some threads of a block
// have exited before is an error, and so is an out-of-range shared-memory
// carve (chunked_kv_common.cuh). An error stops the launch; the launcher
// reports it through error_string().
#pragma once

#include <ucontext.h>
#include <vector_types.h>  // dim3, uint3 (host-usable CUDA header)

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

// vector_types.h brought in CUDA's host definitions of __global__,
// __device__, __host__ and __forceinline__; only this one is missing.
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

namespace chunked_kv {
namespace emu {

constexpr size_t kStackBytes = 256 * 1024;  // per emulated thread
constexpr int kMultiprocessors = 4;
constexpr int kMaxSharedBytes = 227 * 1024;  // an H100's opt-in limit per block

struct Fiber {
  ucontext_t context;
  std::vector<char> stack;
  bool done = false;
};

struct State {
  ucontext_t scheduler;
  std::vector<Fiber> fibers;
  const std::function<void()>* body = nullptr;
  int current = 0;
  uint3 block{0, 0, 0};
  dim3 grid, threads;
  std::vector<unsigned char> shared;
  std::string error;  // empty: no error in the current launch
  std::string last_error;
};

inline State& state() {
  static State s;
  return s;
}

inline uint3 thread_index() { return uint3{static_cast<unsigned>(state().current), 0u, 0u}; }
inline uint3 block_index() { return state().block; }
inline dim3 block_dim() { return state().threads; }
inline dim3 grid_dim() { return state().grid; }
inline unsigned char* shared_memory() { return state().shared.data(); }
inline size_t shared_bytes() { return state().shared.size(); }

// Give control back to the scheduler until every live thread of the block has arrived.
inline void sync_threads() {
  State& s = state();
  swapcontext(&s.fibers[s.current].context, &s.scheduler);
}

// Stop the launch with `message`: this thread never runs again.
inline void fail(const std::string& message) {
  State& s = state();
  if (s.error.empty()) s.error = message;
  for (;;) swapcontext(&s.fibers[s.current].context, &s.scheduler);
}

inline void fiber_entry() {
  State& s = state();
  (*s.body)();
  s.fibers[s.current].done = true;  // returns to uc_link, the scheduler
}

// Run one block: rounds of the live threads in a shuffled order, each round
// ending at a barrier all of them reached (or at their exit).
inline void run_block(std::mt19937& rng) {
  State& s = state();
  const int n = static_cast<int>(s.threads.x);
  for (Fiber& f : s.fibers) {
    f.done = false;
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack.data();
    f.context.uc_stack.ss_size = f.stack.size();
    f.context.uc_link = &s.scheduler;
    makecontext(&f.context, fiber_entry, 0);
  }
  std::vector<int> order(n);
  for (int i = 0; i < n; ++i) order[i] = i;
  for (;;) {
    std::shuffle(order.begin(), order.end(), rng);
    int waiting = 0, done = 0;
    for (int i : order) {
      if (s.fibers[i].done) { ++done; continue; }
      s.current = i;
      swapcontext(&s.scheduler, &s.fibers[i].context);
      if (!s.error.empty()) return;
      if (s.fibers[i].done) ++done; else ++waiting;
    }
    if (waiting == 0) return;
    if (done > 0) {
      s.error = "__syncthreads reached after " + std::to_string(done) + " thread(s) of the block exited";
      return;
    }
  }
}

// kernel<<<grid, threads, shared>>>: `body` calls the kernel.
inline bool launch(dim3 grid, dim3 threads, size_t shared, const std::function<void()>& body) {
  State& s = state();
  s.error.clear();
  if (threads.y != 1 || threads.z != 1 || threads.x == 0) {
    s.last_error = "the emulation runs 1-D blocks only";
    return false;
  }
  s.grid = grid;
  s.threads = threads;
  s.body = &body;
  s.fibers.resize(threads.x);
  for (Fiber& f : s.fibers) f.stack.resize(kStackBytes);
  std::mt19937 rng(12345);
  for (unsigned z = 0; z < grid.z && s.error.empty(); ++z)
    for (unsigned y = 0; y < grid.y && s.error.empty(); ++y)
      for (unsigned x = 0; x < grid.x && s.error.empty(); ++x) {
        s.block = uint3{x, y, z};
        s.shared.assign(shared, 0xFF);
        run_block(rng);
      }
  s.body = nullptr;
  if (!s.error.empty()) {
    s.last_error = "emulated block (" + std::to_string(s.block.x) + ", " + std::to_string(s.block.y) + ", " +
                   std::to_string(s.block.z) + "): " + s.error;
    return false;
  }
  return true;
}

}  // namespace emu
}  // namespace chunked_kv

// CUDA's integer min and max.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

#define threadIdx (::chunked_kv::emu::thread_index())
#define blockIdx (::chunked_kv::emu::block_index())
#define blockDim (::chunked_kv::emu::block_dim())
#define gridDim (::chunked_kv::emu::grid_dim())
#define __syncthreads() ::chunked_kv::emu::sync_threads()
