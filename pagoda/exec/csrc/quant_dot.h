// Integer dot products for quant_matmul.cpp's few-rows path (decode), computed the way ggml computes
// its CPU dot products: each activation row is rounded once per call to int8 in blocks of 32 (a float
// scale per block and the block's sum), and each 32-weight block's dot product with it is taken in
// integers, one 256-bit vector per block: AVX512-VNNI `vpdpbusd` where the CPU has it (with AVX512VL),
// else AVX2's `vpmaddubsw` + `vpmaddwd` (`vpsignb` makes the signed weights' products unsigned-times-
// signed). Types: Q8_0, Q4_0, Q4_1 and int8 rows (I8); the others keep the float path.
//
// Precision. A block of x with largest magnitude a is held as d * q, d = a / 127, q = round(x / d) in
// [-127, 127], so each element moves by at most d / 2 = a / 254. The integer products and sums are
// exact, and Q4_1's min term uses d * sum(q), so the result is dequant(W) . x^ (x^ the rounded x)
// up to float32 rounding of the per-block scales and sums; against the float path
// |y_int - y_float| <= sum over blocks b of (a_b / 254) * sum_{i in b} |w_i|, plus float32 rounding.
// That is not within float32 rounding of the dequantized reference: on Gaussian activations the
// difference is about 0.5 % of |y| (rms), and SmolLM2's perplexity moves by +0.4 % (docs/perf-notes.md).
// A block holding inf or NaN gets d = NaN, so its row's outputs are NaN (the float path gives inf or
// NaN there).
#pragma once

#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "quant_blocks.h"

namespace {

#define TARGET_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma,f16c")))

inline bool has_int_dot(int t) { return t == Q8_0 || t == Q4_0 || t == Q4_1 || t == I8; }

// Activation rows [M, K] rounded to int8 in blocks of 32.
struct ActInt8 {
  int64_t K = 0, nb = 0;     // row length, blocks per row
  std::vector<int8_t> q;     // [M, K]
  std::vector<uint8_t> u;    // q + 128, for vpdpbusd's unsigned operand
  std::vector<float> d;      // [M, nb]: x ~ d * q
  std::vector<float> s;      // [nb, 8]: d * sum(q) of each row (0 past M): Q4_1's min term, one vector a block
};

#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

// Both integer paths have AVX2, so the rounding of x is AVX2 code, the same on both.
TARGET_AVX2 inline void quantize_activations(const float* x, int64_t M, int64_t K, ActInt8& a) {
  a.K = K;
  a.nb = K / 32;
  a.q.resize(M * K);
  a.u.resize(M * K);
  a.d.resize(M * a.nb);
  a.s.assign(a.nb * 8, 0.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  const __m256 lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleave
  for (int64_t r = 0; r < M * a.nb; r++) {
    const float* v = x + r * 32;
    __m256 xs[4], amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
      xs[i] = _mm256_loadu_ps(v + 8 * i);
      const __m256 mag = _mm256_andnot_ps(sign, xs[i]);
      amax = _mm256_max_ps(amax, mag);
      bad = _mm256_or_ps(bad, _mm256_cmp_ps(mag, inf, _CMP_NLT_UQ));  // inf or NaN
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const bool finite = _mm256_movemask_ps(bad) == 0;
    const float d = finite ? _mm_cvtss_f32(m4) / 127.0f : NAN;
    __m256i packed = _mm256_setzero_si256();
    int sum = 0;
    if (finite && d != 0.0f) {
      const __m256 id = _mm256_set1_ps(1.0f / d);
      __m256i q[4];
      for (int i = 0; i < 4; i++) {
        // Round half to even (as numpy's rint in the tests' model of this arithmetic).
        const __m256 t = _mm256_round_ps(_mm256_mul_ps(xs[i], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        q[i] = _mm256_cvtps_epi32(_mm256_min_ps(hi, _mm256_max_ps(lo, t)));
      }
      const __m256i s4 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(s4), _mm256_extracti128_si256(s4, 1));
      s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0x4E));
      s2 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1));
      sum = _mm_cvtsi128_si32(s2);
      const __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      packed = _mm256_permutevar8x32_epi32(p, order);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&a.q[r * 32]), packed);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(&a.u[r * 32]),
                        _mm256_xor_si256(packed, _mm256_set1_epi8(static_cast<char>(0x80))));
    a.d[r] = d;
    a.s[(r % a.nb) * 8 + r / a.nb] = d * static_cast<float>(sum);
  }
}

// ---- AVX512-VNNI (256-bit) ------------------------------------------------------------------------

TARGET_VNNI inline float f16_vnni(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

// A Q4 block's 16 bytes of nibbles as 32 bytes in x's order: low nibbles (weights 0-15), then high.
TARGET_VNNI inline __m256i nibbles_vnni(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

TARGET_VNNI inline float hsum_vnni(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight block b (at blk) into the rows' accumulators.
template <int T, int MM>
TARGET_VNNI __attribute__((always_inline)) inline void block_vnni(const uint8_t* blk, const ActInt8& a, int64_t b,
    __m256 (&acc)[MM], __m256& macc) {
  const int64_t K = a.K, nb = a.nb;
  const __m256i zero = _mm256_setzero_si256(), c128 = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256 dw = _mm256_set1_ps(T == I8 ? 1.0f : f16_vnni(blk));
  if constexpr (T == Q4_1) {
    macc = _mm256_fmadd_ps(_mm256_set1_ps(f16_vnni(blk + 2)), _mm256_loadu_ps(&a.s[b * 8]), macc);
    const __m256i wv = nibbles_vnni(blk + 4);
    for (int m = 0; m < MM; m++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[m * K + b * 32]));
      const __m256i v = _mm256_dpbusd_epi32(zero, wv, xv);
      const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d[m * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, acc[m]);
    }
  } else {
    __m256i wv;
    if constexpr (T == Q4_0)
      wv = _mm256_sub_epi8(nibbles_vnni(blk + 2), _mm256_set1_epi8(8));
    else
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (T == Q8_0 ? 2 : 0)));
    const __m256i start = _mm256_sub_epi32(zero, _mm256_dpbusd_epi32(zero, c128, wv));
    for (int m = 0; m < MM; m++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.u[m * K + b * 32]));
      const __m256i v = _mm256_dpbusd_epi32(start, xv, wv);
      const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d[m * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, acc[m]);
    }
  }
}

// out[m * ldo + n] = dequant(w[n]) . x^[m] (times scale[n]) for rows n in [n0, n1). Signed weights
// (Q8_0, Q4_0 - 8, I8) go as vpdpbusd's signed operand against u = q + 128, the accumulator starting
// at -128 * (the lanes' weight sums) so that the lanes end at exactly sum(q * w); Q4_1's nibbles are
// unsigned and go against q directly.
template <int T, int MM>
TARGET_VNNI void int_rows_vnni(const uint8_t* w, int64_t row_bytes, const ActInt8& a, int64_t n0, int64_t n1,
                               float* out, int64_t ldo, const float* scale) {
  constexpr int kBytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : 32;
  // Independent accumulators over alternate blocks: with one, a row waits on each FMA's latency.
  constexpr int kChains = MM == 1 ? 4 : MM == 2 ? 2 : 1;
  const int64_t nb = a.nb;
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc[kChains][MM], macc[kChains];  // macc lane m: row m's min term (Q4_1)
    for (int c = 0; c < kChains; c++) {
      macc[c] = _mm256_setzero_ps();
      for (int m = 0; m < MM; m++) acc[c][m] = _mm256_setzero_ps();
    }
    const uint8_t* blk = w + n * row_bytes;
    int64_t b = 0;
    for (; b + kChains <= nb; b += kChains, blk += kChains * kBytes)
      for (int c = 0; c < kChains; c++) block_vnni<T, MM>(blk + c * kBytes, a, b + c, acc[c], macc[c]);
    for (; b < nb; b++, blk += kBytes) block_vnni<T, MM>(blk, a, b, acc[0], macc[0]);
    for (int c = 1; c < kChains; c++) {
      macc[0] = _mm256_add_ps(macc[0], macc[c]);
      for (int m = 0; m < MM; m++) acc[0][m] = _mm256_add_ps(acc[0][m], acc[c][m]);
    }
    alignas(32) float mins[8];
    _mm256_store_ps(mins, macc[0]);
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = (hsum_vnni(acc[0][m]) + mins[m]) * s;
  }
}

// ---- AVX2 ----------------------------------------------------------------------------------------

TARGET_AVX2 inline float f16_avx2(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _cvtsh_ss(h);
}

TARGET_AVX2 inline __m256i nibbles_avx2(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(0x0F));
}

TARGET_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// One weight block b (at blk) into the rows' accumulators.
template <int T, int MM>
TARGET_AVX2 __attribute__((always_inline)) inline void block_avx2(const uint8_t* blk, const ActInt8& a, int64_t b,
    __m256 (&acc)[MM], __m256& macc) {
  const int64_t K = a.K, nb = a.nb;
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 dw = _mm256_set1_ps(T == I8 ? 1.0f : f16_avx2(blk));
  if constexpr (T == Q4_1) {
    macc = _mm256_fmadd_ps(_mm256_set1_ps(f16_avx2(blk + 2)), _mm256_loadu_ps(&a.s[b * 8]), macc);
    const __m256i wv = nibbles_avx2(blk + 4);
    for (int m = 0; m < MM; m++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[m * K + b * 32]));
      const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(wv, xv), ones);
      const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d[m * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, acc[m]);
    }
  } else {
    __m256i wv;
    if constexpr (T == Q4_0)
      wv = _mm256_sub_epi8(nibbles_avx2(blk + 2), _mm256_set1_epi8(8));
    else
      wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + (T == Q8_0 ? 2 : 0)));
    const __m256i aw = _mm256_sign_epi8(wv, wv);  // |w|; -128 stays 0x80, which is 128 unsigned
    for (int m = 0; m < MM; m++) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.q[m * K + b * 32]));
      const __m256i v = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones);
      const __m256 sc = _mm256_mul_ps(dw, _mm256_broadcast_ss(&a.d[m * nb + b]));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), sc, acc[m]);
    }
  }
}

// As int_rows_vnni. vpmaddubsw multiplies unsigned by signed bytes into saturating int16 pairs: Q4_1's
// nibbles (0-15) are the unsigned side as they are; signed weights go as |w| against x with w's sign
// (|pair| <= 2 * 128 * 127 < 2^15, so nothing saturates).
template <int T, int MM>
TARGET_AVX2 void int_rows_avx2(const uint8_t* w, int64_t row_bytes, const ActInt8& a, int64_t n0, int64_t n1,
                               float* out, int64_t ldo, const float* scale) {
  constexpr int kBytes = T == Q8_0 ? 34 : T == Q4_0 ? 18 : T == Q4_1 ? 20 : 32;
  // Independent accumulators over alternate blocks: with one, a row waits on each FMA's latency.
  constexpr int kChains = MM == 1 ? 4 : MM == 2 ? 2 : 1;
  const int64_t nb = a.nb;
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc[kChains][MM], macc[kChains];  // macc lane m: row m's min term (Q4_1)
    for (int c = 0; c < kChains; c++) {
      macc[c] = _mm256_setzero_ps();
      for (int m = 0; m < MM; m++) acc[c][m] = _mm256_setzero_ps();
    }
    const uint8_t* blk = w + n * row_bytes;
    int64_t b = 0;
    for (; b + kChains <= nb; b += kChains, blk += kChains * kBytes)
      for (int c = 0; c < kChains; c++) block_avx2<T, MM>(blk + c * kBytes, a, b + c, acc[c], macc[c]);
    for (; b < nb; b++, blk += kBytes) block_avx2<T, MM>(blk, a, b, acc[0], macc[0]);
    for (int c = 1; c < kChains; c++) {
      macc[0] = _mm256_add_ps(macc[0], macc[c]);
      for (int m = 0; m < MM; m++) acc[0][m] = _mm256_add_ps(acc[0][m], acc[c][m]);
    }
    alignas(32) float mins[8];
    _mm256_store_ps(mins, macc[0]);
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = (hsum_avx2(acc[0][m]) + mins[m]) * s;
  }
}

// ---- dispatch over type and row count ------------------------------------------------------------

template <int T, int MM>
void int_rows_for(bool vnni, const uint8_t* w, int64_t row_bytes, const ActInt8& a, int64_t n0, int64_t n1,
                  float* out, int64_t ldo, const float* scale) {
  if (vnni)
    int_rows_vnni<T, MM>(w, row_bytes, a, n0, n1, out, ldo, scale);
  else
    int_rows_avx2<T, MM>(w, row_bytes, a, n0, n1, out, ldo, scale);
}

template <int T>
void int_rows_type(bool vnni, int64_t M, const uint8_t* w, int64_t row_bytes, const ActInt8& a, int64_t n0,
                   int64_t n1, float* out, int64_t ldo, const float* scale) {
  switch (M) {
    case 1: return int_rows_for<T, 1>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 2: return int_rows_for<T, 2>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 3: return int_rows_for<T, 3>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 4: return int_rows_for<T, 4>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 5: return int_rows_for<T, 5>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 6: return int_rows_for<T, 6>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 7: return int_rows_for<T, 7>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
    case 8: return int_rows_for<T, 8>(vnni, w, row_bytes, a, n0, n1, out, ldo, scale);
  }
  TORCH_CHECK(false, "quant_matmul: at most 8 rows per fused call");
}

// Rows [n0, n1) of w against the quantized activations `a` (M rows), for a type with has_int_dot.
inline void int_rows_any(bool vnni, int t, int64_t M, const uint8_t* w, int64_t row_bytes, const ActInt8& a,
                         int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  switch (t) {
    case Q8_0: return int_rows_type<Q8_0>(vnni, M, w, row_bytes, a, n0, n1, out, ldo, scale);
    case Q4_0: return int_rows_type<Q4_0>(vnni, M, w, row_bytes, a, n0, n1, out, ldo, scale);
    case Q4_1: return int_rows_type<Q4_1>(vnni, M, w, row_bytes, a, n0, n1, out, ldo, scale);
    case I8: return int_rows_type<I8>(vnni, M, w, row_bytes, a, n0, n1, out, ldo, scale);
  }
  TORCH_CHECK(false, "quant_matmul: no integer dot product for type id ", t);
}

}  // namespace
