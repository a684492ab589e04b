// Causal prefill attention on the CPU, float32, for grouped-query heads: one chunk of n queries (the
// last n positions of a sequence of S tokens) against that sequence's S keys and values.
//
// torch's flash SDPA ran this at ~36-49 GFLOP/s for 272-token prompts on 2 AVX2 cores, against ~140
// for the model's GEMMs, so a mixed step spent ~14 % of its time here. This kernel is flash attention
// (a query block against key blocks, with a running max and sum) arranged so that nearly all of its
// work is two small GEMMs done by one register-tiled AVX2 micro-kernel:
// - a work item is one KV head and a block of BQ positions, and the G query heads that share that KV
//   head are stacked into one [G * BQ, D] block, so each K/V block read serves all of them;
// - each K block is packed transposed ([D, BK], zero-padded), so QK^T and PV are both A x B with B
//   row-major and 16 columns per register tile; K and V are packed once a call, before the work
//   items, which all read the same packed blocks;
// - key blocks wholly above the diagonal are skipped; the diagonal block is masked.
// bf16 inputs (with AVX512-BF16) take the bf16 micro-kernel of bf16_tile.h for both GEMMs: the
// scores' products are exact in float32; p.v takes the probabilities rounded to bf16 (as torch's
// flash attention and transformers' eager attention do for a bf16 model) against V packed in that
// kernel's task layout, at twice the rate of float32 FMAs. The running max, the sums and the
// output stay float32 until the one rounding of the output.
//
// inf and NaN go through as in exact arithmetic over each query's visible keys (built without
// -ffast-math; see vec_math.h): a NaN or +inf score makes its row NaN and a -inf score weighs 0, as
// in torch's softmax, and a key past a query's position contributes nothing to it, even a NaN or inf
// one (torch's SDPA lets such a value leak into every row: 0 * NaN).
#include <torch/extension.h>

#include <map>
#include <string>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <vector>

#include "bf16_tile.h"
#include "f32_tile.h"
#include "vec_math.h"

namespace {

using pagoda_f32::gemm;

constexpr int64_t BQ = 32;  // query positions per work item (times G query heads)
constexpr int64_t BK = 64;  // keys per block
constexpr int64_t kPackBytes = 16 << 20;  // the most a call's packed K and V take at once
// The running max before any key: the lowest float, not -inf, so that the first correction
// exp(kNoMax - m) is exp(0) = 1 when every score so far is -inf (-inf - -inf would be NaN) and 0 for
// any finite score m above it.
constexpr float kNoMax = std::numeric_limits<float>::lowest();

// The queries of one work item and one block of keys, packed for the scores' GEMM: float32 (q
// scaled, K transposed) for the float32 micro-kernel, or bf16 pairs (K as [D/2][64][2], the layout
// of bf16_tile.h) for vdpbf16ps, whose products of two bf16 values are exact in float32.
struct F32Scores {
  using Packed = float;  // a key block: [D][BK] floats
  std::vector<float> Qp;
  F32Scores(int64_t M, int64_t D) : Qp(M * D) {}
  void load_q(int64_t r, const float* src, int64_t D, float scale) {
    for (int64_t d = 0; d < D; ++d) Qp[r * D + d] = src[d] * scale;
  }
  static void pack_k(const float* kp, int64_t ks, int64_t nk, int64_t D, float* kt) {
    for (int64_t d = 0; d < D; ++d)
      for (int64_t j = 0; j < BK; ++j) kt[d * BK + j] = j < nk ? kp[j * ks + d] : 0.f;
  }
  void scores(int64_t rows, int64_t nkp, int64_t D, float, const float* kt, float* Sc) {
    gemm<false>(Qp.data(), D, kt, BK, rows, nkp, D, Sc, BK);
  }
};

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
  // The scale goes on the float32 sums (on q it would round for a head size that is not a power of 4).
  void scores(int64_t rows, int64_t nkp, int64_t D, float scale, const uint16_t* kt, float* Sc) {
    static_assert(BK == pagoda_bf16::kNB * pagoda_bf16::kBlock, "a key block is one bf16 tile's columns");
    for (int64_t r = 0; r < rows;) {
      const int m = static_cast<int>(pagoda_bf16::pass_rows(rows - r));
      pagoda_bf16::tile_rows<false>(m, &rows_[r], kt, D, reinterpret_cast<float(*)[BK]>(Sc + r * BK));
      r += m;
    }
    const __m512 vs = _mm512_set1_ps(scale);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < nkp; j += 16) _mm512_storeu_ps(Sc + r * BK + j, _mm512_mul_ps(_mm512_loadu_ps(Sc + r * BK + j), vs));
  }
};
#endif

// A call's values, packed once, and p.v: O[r] += sum_j P[r][j] V[j] over a key block's first `keys`
// keys. Float32 rows and FMAs here; Bf16Values below for vdpbf16ps.
struct F32Values {
  int64_t S, D, nkb;
  std::vector<float> rows_;  // [heads][S][D]
  F32Values(int64_t heads, int64_t S_, int64_t D_, int64_t nkb_) : S(S_), D(D_), nkb(nkb_), rows_(heads * S_ * D_) {}
  static int64_t bytes(int64_t S, int64_t D, int64_t) { return S * D * 4; }
  const float* block(int64_t h, int64_t kb) const { return &rows_[(h * S + kb * BK) * D]; }
  // Packs block kb of head h (nk rows of src, rows ks apart); whether all of them are finite.
  bool pack(int64_t h, int64_t kb, const float* src, int64_t ks, int64_t nk) {
    float* dst = &rows_[(h * S + kb * BK) * D];
    for (int64_t j = 0; j < nk; ++j) std::copy_n(src + j * ks, D, dst + j * D);
    return pagoda::all_finite(dst, nk * D);
  }
  bool finite(int64_t h, int64_t kb, int64_t j0, int64_t j1) const { return pagoda::all_finite(block(h, kb) + j0 * D, (j1 - j0) * D); }
  float value(int64_t h, int64_t kb, int64_t j, int64_t d) const { return block(h, kb)[j * D + d]; }
  // The keys the GEMM may take when keys [all_see, nk) hold a non-finite value some rows must not see.
  static int64_t gemm_keys(int64_t all_see) { return all_see; }
  struct Scratch {};
  void accumulate(int64_t h, int64_t kb, const float* P, int64_t rows, int64_t keys, float* O, Scratch&) const {
    gemm<true>(P, BK, block(h, kb), D, rows, D, keys, O, D);
  }
};

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16 values in the bf16 micro-kernel's task layout, a key block's D columns as tasks of 64
// ([BK/2][4][16][2], zero past the block's keys and past D), and p.v by vdpbf16ps with the
// probabilities rounded to bf16 (as torch's flash attention and transformers' eager attention round
// them for a bf16 model): twice the float32 FMAs' rate, the value rows half the bytes. The sums and
// the running max stay float32.
struct Bf16Values {
  static constexpr int64_t kCols = pagoda_bf16::kNB * pagoda_bf16::kBlock;
  int64_t D, nkb, tasks;
  std::vector<uint16_t> packed_;  // [heads][nkb][tasks][BK/2][64][2]
  Bf16Values(int64_t heads, int64_t, int64_t D_, int64_t nkb_)
      : D(D_), nkb(nkb_), tasks((D_ + kCols - 1) / kCols), packed_(heads * nkb_ * tasks * BK * kCols) {}
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
  struct Scratch {
    std::vector<uint16_t> pb;  // a row block's probabilities in bf16, [rows][BK]
    float c[pagoda_bf16::kMR][kCols];  // one pass's sums
  };
  void accumulate(int64_t h, int64_t kb, const float* P, int64_t rows, int64_t keys, float* O, Scratch& scratch) const {
    if (keys == 0) return;
    const int64_t k2 = (keys + 1) & ~int64_t{1};  // P is 0 past the block's keys, the values 0 past nk
    std::vector<uint16_t>& pb = scratch.pb;
    pb.resize(rows * BK);
    const auto lanes = [](int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << std::max<int64_t>(n, 0)) - 1); };
    // vcvtneps2bf16 rounds to nearest even as to_bf16 does, in one instruction (2-3 % of the kernel);
    // it differs only where no output can tell: a NaN probability (its row is NaN anyway) keeps its
    // payload, and one below float32's normal range (< 1.2e-38, far under the output's last bit)
    // becomes 0.
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < k2; j += 16) {
        const __m512 p = _mm512_maskz_loadu_ps(lanes(keys - j), P + r * BK + j);  // 0 past `keys`
        _mm256_mask_storeu_epi16(&pb[r * BK + j], lanes(k2 - j), (__m256i)_mm512_cvtneps_pbh(p));
      }
    auto* c = scratch.c;
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t cols = std::min(kCols, D - t * kCols);
      for (int64_t r = 0; r < rows;) {
        const int m = static_cast<int>(pagoda_bf16::pass_rows(rows - r));
        const uint16_t* a[pagoda_bf16::kMR];
        for (int i = 0; i < m; ++i) a[i] = &pb[(r + i) * BK];
        pagoda_bf16::tile_rows<false>(m, a, task(h, kb, t), k2, c);
        for (int i = 0; i < m; ++i) {
          float* o = O + (r + i) * D + t * kCols;
          for (int64_t d = 0; d < cols; ++d) o[d] += c[i][d];
        }
        r += m;
      }
    }
  }
};
#endif
// dst[d] = o[d] * inv, rounded to bf16 (to nearest even, as torch rounds) for a bf16 output.
inline void store_row(const float* o, float inv, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = o[d] * inv;
}
inline void store_row(const float* o, float inv, int64_t D, uint16_t* dst) {
  int64_t d = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  const __m512 vi = _mm512_set1_ps(inv);
  for (; d + 16 <= D; d += 16) pagoda_bf16::store16(dst + d, pagoda_bf16::to_bf16(_mm512_mul_ps(_mm512_loadu_ps(o + d), vi)));
#endif
  for (; d < D; ++d) {
    const c10::BFloat16 b(o[d] * inv);
    std::memcpy(dst + d, &b, sizeof(*dst));
  }
}

// The kernel over inputs of type T (float, or bf16 bits) with the scores of Scores and the values of Values.
template <typename T, typename Scores, typename Values>
void run(const T* qp, const T* kp, const T* vp, T* op, int64_t n, int64_t Hq, int64_t D, int64_t S, int64_t Hkv,
         int64_t qs, int64_t ks, int64_t vs, int64_t qhs, int64_t khs, int64_t vhs, float fscale) {
  using Packed = typename Scores::Packed;
  const int64_t G = Hq / Hkv, ctx = S - n, M = G * BQ;
  const int64_t nqb = (n + BQ - 1) / BQ, nkb = (S + BK - 1) / BK;
  // Every KV head's keys and values are packed once for all the query blocks that read them (each
  // block packing its own copy cost as much as its GEMMs): K blocks in Scores' layout, V in Values',
  // and whether each V block is all finite. Heads go in groups whose packed copies take at most
  // kPackBytes (one group for a small model's prompt; a long context takes a head at a time).
  const int64_t head_bytes = nkb * D * BK * static_cast<int64_t>(sizeof(Packed)) + Values::bytes(S, D, nkb);
  const int64_t hg = std::clamp<int64_t>(kPackBytes / head_bytes, 1, Hkv);
  std::vector<Packed> Kp(hg * nkb * D * BK);
  Values values(hg, S, D, nkb);
  std::vector<char> v_finite(hg * nkb);
  for (int64_t h0 = 0; h0 < Hkv; h0 += hg) {
    const int64_t nh = std::min(hg, Hkv - h0);
    const auto k_block = [&](int64_t h, int64_t kb) { return &Kp[((h - h0) * nkb + kb) * D * BK]; };
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp for schedule(static)
      for (int64_t item = 0; item < nh * nkb; ++item) {
        const int64_t h = h0 + item / nkb, j0 = (item % nkb) * BK, nk = std::min(BK, S - j0);
        Scores::pack_k(kp + j0 * ks + h * khs, ks, nk, D, k_block(h, j0 / BK));
        v_finite[item] = values.pack(h - h0, j0 / BK, vp + j0 * vs + h * vhs, vs, nk);
      }
      Scores qk(M, D);
      typename Values::Scratch scratch;
      std::vector<float> Sc(M * BK), O(M * D), mx(M), sum(M), mnew(M), corr(M);
      // Later query blocks see more keys: hand items out dynamically, the costliest first.
#pragma omp for schedule(dynamic, 1)
      for (int64_t item = 0; item < nqb * nh; ++item) {
        const int64_t qb = nqb - 1 - item / nh, h = h0 + item % nh;
        const int64_t i0 = qb * BQ, nq = std::min(BQ, n - i0);
        // Rows g * nq + i of the stacked block: query head h * G + g at chunk position i0 + i.
        const int64_t rows = G * nq;
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < nq; ++i) qk.load_q(g * nq + i, qp + (i0 + i) * qs + (h * G + g) * qhs, D, fscale);
        std::fill(O.begin(), O.begin() + rows * D, 0.f);
        std::fill(mx.begin(), mx.begin() + rows, kNoMax);
        std::fill(sum.begin(), sum.begin() + rows, 0.f);
        const int64_t kend = ctx + i0 + nq;  // keys this block's last query sees
        for (int64_t j0 = 0; j0 < kend; j0 += BK) {
          const int64_t nk = std::min(BK, kend - j0);
          const int64_t nkp = (nk + 15) / 16 * 16;  // columns padded to whole tiles
          const int64_t hl = h - h0, kb = j0 / BK;
          qk.scores(rows, nkp, D, fscale, k_block(h, j0 / BK), Sc.data());
          // Keys [0, all_see) are visible to every row; row r also sees [all_see, visible(r)).
          const auto visible = [&](int64_t r) { return std::clamp<int64_t>(ctx + i0 + r % nq + 1 - j0, 0, nk); };
          const int64_t all_see = visible(0);
          // The rows' new maxima first, then their corrections in one loop that vectorises: one
          // exp_f32 a row, each a chain of dependent scalar steps, cost 2-6 % of the kernel.
          for (int64_t r = 0; r < rows; ++r) mnew[r] = pagoda::max_f32(&Sc[r * BK], visible(r), mx[r]);
          for (int64_t r = 0; r < rows; ++r) corr[r] = pagoda::exp_f32(mx[r] - mnew[r]);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t vis = visible(r);
            float* s = &Sc[r * BK];
            const float m = mnew[r], correction = corr[r];
            const float add = pagoda::exp_minus_max_(s, vis, m);
            for (int64_t j = vis; j < nk; ++j) s[j] = 0.f;  // masked: weight 0
            sum[r] = sum[r] * correction + add;
            mx[r] = m;
            if (correction != 1.f) {
              float* o = &O[r * D];
              for (int64_t d = 0; d < D; ++d) o[d] *= correction;
            }
          }
          // A masked key's weight is 0, but through the GEMM 0 * (an inf or NaN value) would still be
          // NaN: when some row does not see every key of the block and such a value is there, the GEMM
          // takes the keys all rows see and each row adds its own triangle.
          if (all_see == nk || v_finite[hl * nkb + kb] || values.finite(hl, kb, all_see, nk)) {
            values.accumulate(hl, kb, Sc.data(), rows, nk, O.data(), scratch);
          } else {
            const int64_t from = Values::gemm_keys(all_see);
            values.accumulate(hl, kb, Sc.data(), rows, from, O.data(), scratch);
            for (int64_t r = 0; r < rows; ++r) {
              const float* s = &Sc[r * BK];
              float* o = &O[r * D];
              for (int64_t j = from, vis = visible(r); j < vis; ++j) {
                const float p = std::is_same_v<T, float> ? s[j] : pagoda_bf16::round_bf16(s[j]);
                for (int64_t d = 0; d < D; ++d) o[d] += p * values.value(hl, kb, j, d);
              }
            }
          }
        }
        for (int64_t g = 0; g < G; ++g)
          for (int64_t i = 0; i < nq; ++i) {
            const int64_t r = g * nq + i;
            const float inv = 1.f / sum[r];
            store_row(&O[r * D], inv, D, op + ((i0 + i) * Hq + h * G + g) * D);
          }
      }
    }
  }
}

}  // namespace

// q [n, Hq, D], k and v [S, Hkv, D] (any strides but a contiguous head_dim), n <= S, all float32 or
// all bf16; query i sits at position S - n + i and attends keys 0..S - n + i. Returns [n, Hq, D] in
// the inputs' dtype. bf16 takes vdpbf16ps for the scores where the CPU has AVX512-BF16 and D % 32
// == 0, and is widened to float32 (the output rounded once) elsewhere.
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat32 || dtype == torch::kBFloat16) && k.scalar_type() == dtype &&
                  v.scalar_type() == dtype,
              "prefill_attention takes float32 or bfloat16, the same for q, k and v");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && Hkv > 0 && Hq % Hkv == 0 && n <= S,
              "k and v must be [S, Hkv, D] with S >= the query count and Hkv dividing Hq");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  for (const auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "head_dim must be contiguous");
  const float fscale = static_cast<float>(scale);
  if (dtype == torch::kBFloat16) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    if (D % 32 == 0) {
      auto out = torch::empty({n, Hq, D}, q.options());
      const auto bits = [](const torch::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr()); };
      run<uint16_t, Bf16Scores, Bf16Values>(bits(q), bits(k), bits(v), reinterpret_cast<uint16_t*>(out.data_ptr()), n, Hq, D, S,
                                Hkv, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
                                fscale);
      return out;
    }
#endif
    return prefill_attention(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), scale)
        .to(torch::kBFloat16);
  }
  auto out = torch::empty({n, Hq, D}, q.options());
  run<float, F32Scores, F32Values>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), n, Hq,
                        D, S, Hkv, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
                        fscale);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention);
  // For the fused CPU step (exec/csrc/fused_decode.cpp), which calls it from C++ for a lone prompt's step.
  m.def("_addresses", [] {
    return std::map<std::string, int64_t>{{"prefill_attention", reinterpret_cast<int64_t>(&prefill_attention)}};
  });
}
