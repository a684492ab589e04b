// Prefetching the next KV cache block while the decode kernels work on the current one.
//
// Cache blocks lie anywhere in the pool, so the hardware prefetcher, which follows addresses, cannot
// find the next block, and a kernel that waits on each block in turn reads at a fraction of the
// memory's rate (64 sequences of a few hundred tokens: ~10 GB/s against ~26 GB/s for a plain gather
// of the same blocks). Asking for a whole block at once does not help: it fills the core's miss
// queue and stalls the arithmetic behind it. So the next block's cache lines are asked for a few at
// a time, spread over the calls of step() that the work on the current block makes.
#pragma once

#include <algorithm>
#include <cstdint>

namespace pagoda_kv {

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
      __builtin_prefetch(p_ + row_ * stride_ + col_ * 64, 0, 3);
      if (++col_ == per_row_) col_ = 0, ++row_;
    }
  }

 private:
  const char* p_ = nullptr;
  int64_t left_ = 0, per_row_ = 0, stride_ = 0, row_ = 0, col_ = 0, per_step_ = 0;
};

}  // namespace pagoda_kv
