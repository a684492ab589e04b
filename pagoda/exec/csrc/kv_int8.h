// The int8 KV cache's row format (kv_cache_dtype=int8), its write and its read.
//
// A cache is [num_blocks, Hkv, block_size, W] int8 per layer and K or V: for each block and KV head,
// block_size rows (one per token) of head_dim int8 values, then one fp16 scale per group of 32 values
// (value = q * scale), W = head_dim + 2 * groups bytes. For head_dim 64 that is 68 bytes where a
// 16-bit cache holds 128.
//
// Why per token and per 32 values: a scale shared by a block's tokens is set by its largest token (the
// first tokens' K are often much larger than the rest), and one shared by a head's 64 values by its
// outlier channels; either flipped SmolLM2's greedy tokens far from near-ties, groups of 32 per token
// did not (tests/model/test_smollm2_reference.py). Each row is quantized on its own, so a block's
// bytes never depend on how its tokens were split into calls.
//
// A group's scale is rounded to fp16 first and the values quantized with the stored scale, so the
// write and the read agree exactly. A non-finite group stores a NaN scale: it reads as NaN, as a NaN
// K or V row makes attention's output NaN over a float cache.
#pragma once

#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace pagoda_kv8 {

constexpr int64_t GROUP = 32;

inline int64_t groups(int64_t head_dim) { return (head_dim + GROUP - 1) / GROUP; }

// Bytes of one token's row of one KV head.
inline int64_t row_bytes(int64_t head_dim) { return head_dim + 2 * groups(head_dim); }

inline float get_scale(const int8_t* row, int64_t D, int64_t g) {
  c10::Half h;
  std::memcpy(&h, row + D + 2 * g, 2);
  return static_cast<float>(h);
}

inline int8_t round_q(float x) {
  const float r = std::nearbyint(x);  // round half to even, the default rounding mode
  return static_cast<int8_t>(r > 127.f ? 127.f : (r < -127.f ? -127.f : r));
}

// Quantize x (D values) into one row.
template <typename S>
inline void put_row(int8_t* row, int64_t D, const S* x) {
  for (int64_t g0 = 0, g = 0; g0 < D; g0 += GROUP, ++g) {
    const int64_t g1 = std::min(D, g0 + GROUP);
    float amax = 0.f;
    bool finite = true;
    for (int64_t d = g0; d < g1; ++d) {
      const float v = static_cast<float>(x[d]);
      finite = finite && std::isfinite(v);
      amax = std::fmax(amax, std::fabs(v));
    }
    const c10::Half h(finite ? amax / 127.f : std::nanf(""));
    std::memcpy(row + D + 2 * g, &h, 2);
    const float s = static_cast<float>(h);
    const float inv = finite && s > 0.f ? 1.f / s : 0.f;
    for (int64_t d = g0; d < g1; ++d) row[d] = round_q(static_cast<float>(x[d]) * inv);
  }
}

// dst[0, D) = the row's values.
inline void dequantize_row(const int8_t* row, int64_t D, float* dst) {
  for (int64_t g0 = 0, g = 0; g0 < D; g0 += GROUP, ++g) {
    const int64_t g1 = std::min(D, g0 + GROUP);
    const float scale = get_scale(row, D, g);
    int64_t i = g0;
#if defined(__AVX2__)
    const __m256 s = _mm256_set1_ps(scale);
    for (; i + 8 <= g1; i += 8) {
      const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
      _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s));
    }
#endif
    for (; i < g1; ++i) dst[i] = static_cast<float>(row[i]) * scale;
  }
}

}  // namespace pagoda_kv8
