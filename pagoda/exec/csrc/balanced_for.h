// Work items of unequal cost spread over the ATen threads by cost, not by count, with the last
// ones going to whichever thread is free.
//
// at::parallel_for gives each thread the same number of items. A decode step's items are sequences
// whose contexts differ tenfold (32 to 640 tokens in the CPU-offline workload), so by count one
// thread can hold far more of the step's tokens than the other and the rest wait for it at the end
// of the layer. balanced_for cuts [0, n) into one contiguous range per thread of about equal summed
// cost instead. Which thread computes an item does not change the item's arithmetic.
//
// Even ranges of equal cost do not end together: the cores of a shared machine run a few per cent
// apart, at random, and one thread waited at the end of ~4-14 % of the bf16 GEMM's time in the
// CPU-offline run (timestamps at each thread's end, 2026-12-06). So a thread runs its own range from
// the front, and once it is empty takes items from the back of the range with the most left
// (`Ranges`). A thread's next item is still its own next one unless taken, so what it asks for
// ahead of time (the next weights, the next sequence's first KV block) is what it runs next.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace pagoda_split {

// One contiguous range of items per thread; take(th) hands out thread th's front item, then, once its
// range is empty, the back item of the range with the most left, until none is left anywhere.
class Ranges {
 public:
  // Thread t owns [bounds[t], bounds[t + 1]); bounds.size() - 1 threads; items below 2^31.
  explicit Ranges(const std::vector<int64_t>& bounds)
      : threads_(static_cast<int64_t>(bounds.size()) - 1), slots_(new Slot[std::max<int64_t>(threads_, 1)]) {
    for (int64_t t = 0; t < threads_; ++t) slots_[t].range.store(pack(bounds[t], bounds[t + 1]), std::memory_order_relaxed);
  }
  // n items in equal ranges for `threads` threads.
  static Ranges even(int64_t n, int64_t threads) {
    std::vector<int64_t> bounds(threads + 1);
    for (int64_t t = 0; t <= threads; ++t) bounds[t] = n * t / threads;
    return Ranges(bounds);
  }

  // The next item for thread th, or -1 when every range is empty.
  int64_t take(int64_t th) {
    if (th < threads_) {
      const int64_t own = pop(slots_[th], true);
      if (own >= 0) return own;
    }
    for (;;) {
      int64_t victim = -1, most = 0;
      for (int64_t t = 0; t < threads_; ++t) {
        const uint64_t r = slots_[t].range.load(std::memory_order_relaxed);
        if (back(r) - front(r) > most) most = back(r) - front(r), victim = t;
      }
      if (victim < 0) return -1;
      const int64_t item = pop(slots_[victim], false);
      if (item >= 0) return item;
    }
  }
  // The item take(th) would give next from th's own range, or -1: a hint for asking ahead.
  int64_t peek(int64_t th) const {
    if (th >= threads_) return -1;
    const uint64_t r = slots_[th].range.load(std::memory_order_relaxed);
    return front(r) < back(r) ? front(r) : -1;
  }

 private:
  struct alignas(64) Slot {  // a cache line each, so that a thread's takes do not contend with another's
    std::atomic<uint64_t> range{0};
  };
  static uint64_t pack(int64_t f, int64_t b) { return static_cast<uint64_t>(f) << 32 | static_cast<uint64_t>(b); }
  static int64_t front(uint64_t r) { return static_cast<int64_t>(r >> 32); }
  static int64_t back(uint64_t r) { return static_cast<int64_t>(r & 0xFFFFFFFFu); }
  // Takes the front (own) or back item of s, or -1 when it is empty.
  static int64_t pop(Slot& s, bool from_front) {
    uint64_t r = s.range.load(std::memory_order_relaxed);
    while (front(r) < back(r)) {
      const uint64_t next = from_front ? pack(front(r) + 1, back(r)) : pack(front(r), back(r) - 1);
      if (s.range.compare_exchange_weak(r, next, std::memory_order_relaxed)) return from_front ? front(r) : back(r) - 1;
    }
    return -1;
  }
  int64_t threads_;
  std::unique_ptr<Slot[]> slots_;
};

// A thread's view of the Ranges: its items one at a time (take), and its next own one (peek).
struct Queue {
  Ranges& ranges;
  int64_t th;
  int64_t take() const { return ranges.take(th); }
  int64_t peek() const { return ranges.peek(th); }
};

// Calls fn(Queue) once on each thread; the queues hand out every item of [0, n) once, from ranges
// cut where the running sum of cost(i) crosses each thread's share of the total. cost(i) must be >= 0.
template <typename Cost, typename Fn>
void balanced_for(int64_t n, const Cost& cost, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    Ranges all({0, n});
    if (n > 0) fn(Queue{all, 0});
    return;
  }
  std::vector<int64_t> prefix(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + cost(i);
  std::vector<int64_t> bounds(threads + 1, n);
  bounds[0] = 0;
  for (int64_t t = 1; t < threads; ++t) {
    const int64_t share = prefix[n] * t / threads;
    // The cut nearest the share: after the first item whose running sum reaches it, or before it.
    int64_t cut = std::lower_bound(prefix.begin() + 1, prefix.end(), share) - prefix.begin();
    if (share - prefix[cut - 1] < prefix[cut] - share) --cut;
    bounds[t] = std::max(cut, bounds[t - 1]);
  }
  Ranges ranges(bounds);
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(Queue{ranges, t});
  });
}

// A decode work item's cost (paged_decode.cpp, decode_bf16.h: item idx is KV heads of sequence
// idx / items_per_seq): its context's tokens, plus its queries' loads and outputs' stores counted as
// a few tokens more.
inline int64_t decode_item_cost(const int64_t* lens, int64_t idx, int64_t items_per_seq) {
  return lens[idx / items_per_seq] + 16;
}

}  // namespace pagoda_split
