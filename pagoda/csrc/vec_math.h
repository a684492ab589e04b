// Float math for Pagoda's CPU kernels that the compiler vectorises without -ffast-math.
//
// The kernels are built without -ffast-math: it lets the compiler assume that no value is inf or
// NaN (masked attention scores are -inf, and NaN checks must see NaN) and swaps std::exp for glibc's
// vector expf (up to 4 ulp, and NaN for inputs past -88 there). Without it, GCC keeps IEEE semantics
// but will not vectorise a call to expf nor reorder a float sum, so:
// - exp_f32 is plain arithmetic and selects (no calls, no branches), which vectorises as it stands;
// - reductions keep kLanes independent partial sums, added up in a fixed order at the end: the loop
//   over the lanes vectorises without reassociation, and the result does not depend on the vector
//   width the compiler picked (AVX2 or AVX-512 round the same).
#pragma once

#include <cstdint>
#include <cstring>

namespace pagoda {

constexpr int64_t kLanes = 16;

static inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp(x) within 2 ulp (Cephes expf: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial),
// IEEE at the edges: exp(-inf) = 0, exp(+inf) = +inf, overflow to +inf, underflow through the
// subnormals to 0, NaN in -> that NaN out.
static inline float exp_f32(float x) {
  float xc = x != x ? 0.f : x;  // keep NaN out of the integer conversion; it is returned below
  xc = xc < -104.f ? -104.f : (xc > 89.f ? 89.f : xc);  // exp is 0 / inf from there on
  const float n = __builtin_rintf(xc * 1.44269504088896341f);
  // r = x - n ln2, ln2 in two parts: n * 0.693359375 is exact (few bits in each factor).
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  // 2^n as two normal powers of two (n is in [-150, 128]), so that overflow and the subnormal range
  // round once, in the last product.
  const int32_t k = static_cast<int32_t>(n), k1 = k / 2, k2 = k - k1;
  const float y = p * bits_to_float(static_cast<uint32_t>(k1 + 127) << 23) * bits_to_float(static_cast<uint32_t>(k2 + 127) << 23);
  return x != x ? x : y;
}

// max over x[0, n); NaNs are skipped (a NaN score makes its row NaN through exp, not through the max).
static inline float max_f32(const float* x, int64_t n, float init) {
  float lane[kLanes];
  for (int64_t l = 0; l < kLanes; ++l) lane[l] = init;
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t l = 0; l < kLanes; ++l) lane[l] = x[i + l] > lane[l] ? x[i + l] : lane[l];
  float m = init;
  for (int64_t l = 0; l < kLanes; ++l) m = lane[l] > m ? lane[l] : m;
  for (; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// Lane sums added up pairwise, in the same order whatever the vector width.
static inline float combine_lanes(float* lane) {
  for (int64_t w = kLanes / 2; w > 0; w /= 2)
    for (int64_t l = 0; l < w; ++l) lane[l] += lane[l + w];
  return lane[0];
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
