// Float math for Pagoda's CPU kernels that the compiler vectorises without -ffast-math.
//
// The kernels are built without -ffast-math: it lets the compiler assume that no value is inf or
// NaN (masked attention scores are -inf, and NaN checks must see NaN) and it vectorised std::exp as
// glibc's vector expf, after which SiLU gave NaN for gates below about -88.7 (where exp(-gate)
// overflows) and bf16 results a rounding step off torch's. Without it, GCC keeps IEEE semantics
// but will not vectorise a call to expf nor reorder a float sum, so:
// - exp_f32 is plain arithmetic and selects (no calls, no branches), which vectorises as it stands;
// - reductions keep kLanes independent partial sums, added up in a fixed order at the end: the loop
//   over the lanes vectorises without reassociation, and the result does not depend on the vector
//   width the compiler picked (AVX2 or AVX-512 round the same).
#pragma once

#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagoda {

constexpr int64_t kLanes = 16;

static inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) within 1 ulp of the exact value for every float x (checked exhaustively against a double
// exp; the nearest float for 99 % of them), by Cephes' expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r)
// by a degree-7 polynomial. IEEE at the edges: exp(-inf) = 0, exp(+inf) = +inf, overflow to +inf,
// underflow through the subnormals to 0, NaN in -> that NaN out.
static inline float exp_f32(float x) {
  // Clamped where exp is 0 or inf anyway; the comparisons are false for NaN, which becomes -104
  // here (no NaN reaches the integer part) and is returned as it came at the end.
  float xc = x > -104.f ? x : -104.f;
  xc = xc < 89.f ? xc : 89.f;
  // n = round(x / ln2) by the 1.5 * 2^23 trick: t's low mantissa bits hold n as an integer.
  constexpr float kRound = 12582912.f;
  const float t = xc * 1.44269504088896341f + kRound;
  const float n = t - kRound;
  uint32_t tb;
  std::memcpy(&tb, &t, 4);
  const int32_t k = static_cast<int32_t>(tb) - 0x4B400000;  // n, in [-150, 128]
  // r = x - n ln2, ln2 in two parts: n * 0.693359375 is exact (few bits in each factor).
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n as two normal powers of two, so that overflow and the subnormal range round once, in the
  // last product.
  const int32_t k1 = k >> 1, k2 = k - k1;
  const float y = p * bits_to_float(static_cast<uint32_t>(k1 + 127) << 23) * bits_to_float(static_cast<uint32_t>(k2 + 127) << 23);
  return x != x ? x : y;
}

// max over x[0, n) and init; NaNs are skipped (a NaN score makes its row NaN through exp, not
// through the max).
static inline float max_f32(const float* x, int64_t n, float init) {
  float lane[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lane[l] = init;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = x[i + l] > lane[l] ? x[i + l] : lane[l];
  for (; i < n; ++i) lane[0] = x[i] > lane[0] ? x[i] : lane[0];
#if defined(__AVX512F__)
  // The same tree in registers (GCC leaves the loops below scalar, through the stack):
  // maxps(a, b) is a > b ? a : b.
  return _mm512_reduce_max_ps(_mm512_loadu_ps(lane));
#else
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) lane[l] = lane[l + w] > lane[l] ? lane[l + w] : lane[l];
  return lane[0];
#endif
}

// Lane sums added up pairwise, in the same order whatever the vector width.
static inline float combine_lanes(float* lane) {
#if defined(__AVX512F__)
  // The same tree in registers: halves of 256, 128, 64 and 32 bits added (GCC's reduction).
  return _mm512_reduce_add_ps(_mm512_loadu_ps(lane));
#else
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
#endif
}

// Whether x[0, n) holds no inf or NaN: x * 0 is 0 for a finite x and NaN otherwise (IEEE; a
// -ffast-math build would fold it to 0).
static inline bool all_finite(const float* x, int64_t n) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] += x[i + l] * 0.f;
  float tail = 0.f;
  for (; i < n; ++i) tail += x[i] * 0.f;
  return combine_lanes(lane) + tail == 0.f;
}

// x[i] = exp(x[i] - m) for i < n; returns their sum.
static inline float exp_minus_max_(float* x, int64_t n, float m) {
  float lane[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) {
      x[i + l] = exp_f32(x[i + l] - m);
      lane[l] += x[i + l];
    }
  float tail = 0.f;
  for (; i < n; ++i) {
    x[i] = exp_f32(x[i] - m);
    tail += x[i];
  }
  return combine_lanes(lane) + tail;
}

}  // namespace pagoda
