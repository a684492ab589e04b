// Work items of unequal cost spread over the ATen threads by cost, not by count.
//
// at::parallel_for gives each thread the same number of items. A decode step's items are sequences
// whose contexts differ tenfold (32 to 640 tokens in the CPU-offline workload), so by count one
// thread can hold far more of the step's tokens than the other and the rest wait for it at the end
// of the layer. balanced_for cuts [0, n) into one contiguous range per thread of about equal summed
// cost instead. Which thread computes an item does not change the item's arithmetic.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pagoda_split {

// Calls fn(begin, end) on contiguous ranges covering [0, n), one range per thread, cut where the
// running sum of cost(i) crosses each thread's share of the total. cost(i) must be >= 0.
template <typename Cost, typename Fn>
void balanced_for(int64_t n, const Cost& cost, const Fn& fn) {
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), n);
  if (threads <= 1 || at::in_parallel_region()) {
    if (n > 0) fn(0, n);
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
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      if (bounds[t] < bounds[t + 1]) fn(bounds[t], bounds[t + 1]);
  });
}

// A decode work item's cost (paged_decode.cpp, decode_bf16.h: item idx is KV heads of sequence
// idx / items_per_seq): its context's tokens, plus its queries' loads and outputs' stores counted as
// a few tokens more.
inline int64_t decode_item_cost(const int64_t* lens, int64_t idx, int64_t items_per_seq) {
  return lens[idx / items_per_seq] + 16;
}

}  // namespace pagoda_split
