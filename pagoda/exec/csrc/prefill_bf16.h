// The bf16 operands of prefill attention (prefill_attention.cpp): the scores of a query block
// against a key block by vdpbf16ps (K packed as bf16 pairs of dimensions), and p.v by vdpbf16ps over
// V packed once a call in the bf16 micro-kernel's task layout, with the probabilities rounded to
// bf16; and the softmax correction of the output rows, which p.v applies as it adds.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "bf16_tile.h"

namespace pagoda_prefill {

constexpr int64_t BK = 64;  // keys per block

// O's rows times their softmax corrections (exp(old max - new max), 1 where the max held).
inline void correct(float* O, const float* corr, int64_t rows, int64_t D) {
  for (int64_t r = 0; r < rows; ++r)
    if (corr[r] != 1.f)
      for (int64_t d = 0; d < D; ++d) O[r * D + d] *= corr[r];
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
struct Bf16Scores {
  using Packed = uint16_t;  // a key block: [D/2][BK] pairs of d
  std::vector<const uint16_t*> rows_;  // the queries' rows, read where they are (unscaled)
  Bf16Scores(int64_t M, int64_t) : rows_(M) {}
  void load_q(int64_t r, const uint16_t* src, int64_t, float) { rows_[r] = src; }
  // kt[p][j] = key j's pair p (zero for j >= nk): 16 x 16 transposes of 32-bit pairs (D % 32 == 0).
  static void pack_k(const uint16_t* kp, int64_t ks, int64_t nk, int64_t D, uint16_t* dst) {
    uint32_t* kt = reinterpret_cast<uint32_t*>(dst);
    for (int64_t j0 = 0; j0 < BK; j0 += 16)
      for (int64_t p0 = 0; p0 < D / 2; p0 += 16) {
        __m512i r[16];
        for (int64_t i = 0; i < 16; ++i)
          r[i] = j0 + i < nk ? _mm512_loadu_si512(kp + (j0 + i) * ks + 2 * p0) : _mm512_setzero_si512();
        transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(kt + (p0 + i) * BK + j0, r[i]);
      }
  }
  // r[i][c] becomes r[c][i] (16 x 16 32-bit values): swaps of the off-diagonal d x d blocks, d = 8, 4, 2, 1.
  static void transpose16(__m512i* r) {
    for (int d = 8; d >= 1; d /= 2) {
      alignas(64) int32_t lo[16], hi[16];
      for (int c = 0; c < 16; ++c) {
        lo[c] = (c & d) ? 16 + c - d : c;  // row i keeps its columns without bit d, takes row i + d's
        hi[c] = (c & d) ? 16 + c : c + d;  // row i + d takes row i's columns with bit d, keeps its own
      }
      const __m512i vlo = _mm512_load_si512(lo), vhi = _mm512_load_si512(hi);
      for (int i = 0; i < 16; ++i) {
        if (i & d) continue;
        const __m512i a = r[i], b = r[i + d];
        r[i] = _mm512_permutex2var_epi32(a, vlo, b);
        r[i + d] = _mm512_permutex2var_epi32(a, vhi, b);
      }
    }
  }
  void scores(int64_t rows, int64_t, int64_t D, const uint16_t* kt, float* Sc) {
    static_assert(BK == pagoda_bf16::kNB * pagoda_bf16::kBlock, "a key block is one bf16 tile's columns");
    for (int64_t r = 0; r < rows;) {
      const int m = static_cast<int>(pagoda_bf16::pass_rows(rows - r));
      pagoda_bf16::tile_rows<false>(m, &rows_[r], kt, D, reinterpret_cast<float(*)[BK]>(Sc + r * BK));
      r += m;
    }
  }
  // The scale goes on the float32 sums (on q it would round for a head size that is not a power of
  // 4), in the pass that takes the row's max: s[0, n) *= scale, then their max with init, NaNs
  // skipped as max_f32 skips them (maxps(x, m) is x > m ? x : m). Scores past n are not read.
  static float scale_max(float* s, int64_t n, float scale, float init) {
    const __m512 vs = _mm512_set1_ps(scale);
    __m512 m = _mm512_set1_ps(init);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = pagoda_bf16::first_lanes(n - j);
      const __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, s + j), vs);
      _mm512_mask_storeu_ps(s + j, k, x);
      m = _mm512_mask_max_ps(m, k, x, m);
    }
    return _mm512_reduce_max_ps(m);
  }
};

// bf16 values in the bf16 micro-kernel's task layout, a key block's D columns as tasks of 64
// ([BK/2][4][16][2], zero past the block's keys and past D), and p.v by vdpbf16ps with the
// probabilities rounded to bf16 (as torch's flash attention and transformers' eager attention round
// them for a bf16 model): twice the float32 FMAs' rate, the value rows half the bytes. The sums and
// the running max stay float32.
struct Bf16Values {
  static constexpr int64_t kCols = pagoda_bf16::kNB * pagoda_bf16::kBlock;
  int64_t D, nkb, tasks;
  std::unique_ptr<uint16_t[]> packed_;  // [heads][nkb][tasks][BK/2][64][2], not zeroed: pack writes all of a block
  Bf16Values(int64_t heads, int64_t, int64_t D_, int64_t nkb_)
      : D(D_), nkb(nkb_), tasks((D_ + kCols - 1) / kCols), packed_(new uint16_t[heads * nkb_ * tasks * BK * kCols]) {}
  static int64_t bytes(int64_t, int64_t D, int64_t nkb) { return nkb * ((D + kCols - 1) / kCols) * BK * kCols * 2; }
  uint16_t* task(int64_t h, int64_t kb, int64_t t) { return &packed_[((h * nkb + kb) * tasks + t) * BK * kCols]; }
  const uint16_t* task(int64_t h, int64_t kb, int64_t t) const { return &packed_[((h * nkb + kb) * tasks + t) * BK * kCols]; }
  static bool is_finite(uint16_t x) { return (x & 0x7F80) != 0x7F80; }
  bool pack(int64_t h, int64_t kb, const uint16_t* src, int64_t ks, int64_t nk) {
    bool finite = true;
    for (int64_t t = 0; t < tasks; ++t) {
      uint16_t* dst = task(h, kb, t);
      if ((t + 1) * kCols <= D) {
        finite = pack_pairs(src + t * kCols, ks, nk, dst) && finite;
        continue;
      }
      for (int64_t j = 0; j < BK; ++j)
        for (int64_t c = 0; c < kCols; ++c) {
          const int64_t d = t * kCols + c;
          const uint16_t x = j < nk && d < D ? src[j * ks + d] : 0;
          finite = finite && is_finite(x);
          dst[((j / 2) * kCols + c) * 2 + j % 2] = x;  // [j/2][block c/16][c%16][j%2]
        }
    }
    return finite;
  }
  // One task of 64 columns, all below D: rows 2i and 2i + 1 interleaved value by value (zero from
  // row nk on); whether every value is finite.
  static bool pack_pairs(const uint16_t* src, int64_t ks, int64_t nk, uint16_t* dst) {
    static_assert(kCols == 64, "a task is two 32-value vectors a row");
    alignas(64) int16_t lo[32], hi[32];  // columns 0-15 and 16-31 of a vector pair, each from row a then b
    for (int c = 0; c < 16; ++c) lo[2 * c] = c, lo[2 * c + 1] = 32 + c, hi[2 * c] = 16 + c, hi[2 * c + 1] = 48 + c;
    const __m512i vlo = _mm512_load_si512(lo), vhi = _mm512_load_si512(hi), exp = _mm512_set1_epi16(0x7F80);
    const auto row = [&](int64_t j, int half) {
      return j < nk ? _mm512_loadu_si512(src + j * ks + 32 * half) : _mm512_setzero_si512();
    };
    __mmask32 bad = 0;
    for (int64_t j = 0; j < BK; j += 2, dst += 2 * kCols) {
      for (int half = 0; half < 2; ++half) {
        const __m512i a = row(j, half), b = row(j + 1, half);
        bad |= _mm512_cmpeq_epi16_mask(_mm512_and_si512(a, exp), exp) | _mm512_cmpeq_epi16_mask(_mm512_and_si512(b, exp), exp);
        _mm512_storeu_si512(dst + 64 * half, _mm512_permutex2var_epi16(a, vlo, b));
        _mm512_storeu_si512(dst + 64 * half + 32, _mm512_permutex2var_epi16(a, vhi, b));
      }
    }
    return bad == 0;
  }
  float value(int64_t h, int64_t kb, int64_t j, int64_t d) const {
    return pagoda_bf16::to_float(task(h, kb, d / kCols)[((j / 2) * kCols + d % kCols) * 2 + j % 2]);
  }
  bool finite(int64_t h, int64_t kb, int64_t j0, int64_t j1) const {
    for (int64_t j = j0; j < j1; ++j)
      for (int64_t d = 0; d < D; ++d)
        if (!std::isfinite(value(h, kb, j, d))) return false;
    return true;
  }
  // A pair of keys goes into one vdpbf16ps: the pair that straddles all_see would let 0 * (a
  // non-finite value) in, so the GEMM stops at the pair boundary below it.
  static int64_t gemm_keys(int64_t all_see) { return all_see & ~int64_t{1}; }
  // o = o * corr + c over cols columns (a multiple of 16): two roundings (the product, then the sum),
  // as when O was corrected before its sums; the barrier keeps the compiler from contracting them
  // into one FMA.
  static void add_corrected(float* o, float corr, const float* c, int64_t cols) {
    const __m512 f = _mm512_set1_ps(corr);
    for (int64_t d = 0; d < cols; d += 16) {
      __m512 x = _mm512_mul_ps(_mm512_loadu_ps(o + d), f);
      asm("" : "+v"(x));
      _mm512_storeu_ps(o + d, _mm512_add_ps(x, _mm512_loadu_ps(c + d)));
    }
  }
  struct Scratch {
    std::vector<uint16_t> pb;  // a row block's probabilities in bf16, [rows][BK]
    float c[pagoda_bf16::kMR][kCols];  // one pass's sums
  };
  void accumulate(int64_t h, int64_t kb, const float* P, int64_t rows, int64_t keys, const float* corr, float* O,
                  Scratch& scratch) const {
    if (keys == 0) return correct(O, corr, rows, D);
    const int64_t k2 = (keys + 1) & ~int64_t{1};  // P is 0 past the block's keys, the values 0 past nk
    std::vector<uint16_t>& pb = scratch.pb;
    pb.resize(rows * BK);
    using pagoda_bf16::first_lanes;
    // vcvtneps2bf16 rounds to nearest even as to_bf16 does, in one instruction (2-3 % of the kernel);
    // it differs only where no output can tell: a NaN probability (its row is NaN anyway) keeps its
    // payload, and one below float32's normal range (< 1.2e-38, far under the output's last bit)
    // becomes 0.
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k2; j += 16) {
        const __m512 p = _mm512_maskz_loadu_ps(first_lanes(keys - j), P + r * BK + j);  // 0 past `keys`
        _mm256_mask_storeu_epi16(&pb[r * BK + j], first_lanes(k2 - j), (__m256i)_mm512_cvtneps_pbh(p));
      }
    auto* c = scratch.c;
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t cols = std::min(kCols, D - t * kCols);
      for (int64_t r = 0; r < rows;) {
        const int m = static_cast<int>(pagoda_bf16::pass_rows(rows - r));
        const uint16_t* a[pagoda_bf16::kMR];
        for (int i = 0; i < m; ++i) a[i] = &pb[(r + i) * BK];
        pagoda_bf16::tile_rows<false>(m, a, task(h, kb, t), k2, c);
        for (int i = 0; i < m; ++i) add_corrected(O + (r + i) * D + t * kCols, corr[r + i], c[i], cols);
        r += m;
      }
    }
  }
};
#endif

}  // namespace pagoda_prefill
