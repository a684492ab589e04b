// Asking for the data of the next piece of work a few cache lines at a time, spread over the steps
// of the current one: the next KV cache block in the decode kernels, the next column block of
// weights in the bf16 GEMM.
//
// KV cache blocks lie anywhere in the pool, so the hardware prefetcher, which follows addresses,
// cannot find the next block, and a kernel that waits on each block in turn reads at a fraction of
// the memory's rate (64 sequences of a few hundred tokens: ~10 GB/s against ~26 GB/s for a plain
// gather of the same blocks). Asking for a whole block at once does not help: it fills the core's
// miss queue and stalls the arithmetic behind it. So the next block's cache lines are asked for a
// few at a time, spread over the calls of step() that the work on the current block makes.
//
// Two shapes: `Ahead`, rows at a stride spread evenly over a number of steps (the KV blocks);
// `Lines`, one contiguous range one line a step (the GEMM's next weights, which must not push the
// current pass's out of L1). Both ask for L2 (prefetcht1), not L1: on Zen 4, KV blocks asked for
// into L1 made a decode step of 64 sequences over blocks in random order 1.26x as slow (30.8 against
// 24.5 ms a 30-layer step; 22.9 against 21.7 with runs of 5 consecutive blocks, the same with all
// consecutive; benchmarks/bench_decode_attention.py's shapes, 2026-12-06). `Lines` is two
// pointers because it runs in the GEMM micro-kernel's innermost loop, where `Ahead`'s bookkeeping
// measured 5 % slower at 64 rows.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagoda_prefetch {

class Ahead {
 public:
  // `rows` rows of `row_bytes` bytes, `stride` bytes apart from `first`, spread over `steps` calls.
  void start(const void* first, int64_t rows, int64_t row_bytes, int64_t stride, int64_t steps) {
    p_ = static_cast<const char*>(first);
    per_row_ = (row_bytes + 63) / 64;
    stride_ = stride;
    left_ = rows * per_row_;
    per_step_ = (left_ + std::max<int64_t>(steps, 1) - 1) / std::max<int64_t>(steps, 1);
    row_ = col_ = 0;
  }
  void none() { left_ = 0; }
  void step() {
    for (int64_t k = std::min(per_step_, left_); k > 0; --k, --left_) {
      __builtin_prefetch(p_ + row_ * stride_ + col_ * 64, 0, 2);
      if (++col_ == per_row_) col_ = 0, ++row_;
    }
  }

 private:
  const char* p_ = nullptr;
  int64_t left_ = 0, per_row_ = 0, stride_ = 0, row_ = 0, col_ = 0, per_step_ = 0;
};

struct Lines {
  const char* next = nullptr;
  const char* end = nullptr;
  void start(const void* first, int64_t bytes) {
    next = static_cast<const char*>(first);
    end = next + bytes;
  }
  void step() {
    if (next < end) {
      __builtin_prefetch(next, 0, 2);
      next += 64;
    }
  }
};

}  // namespace pagoda_prefetch
