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
#include "vec_math.h"

namespace {

constexpr int64_t BQ = 32;  // query positions per work item (times G query heads)
constexpr int64_t BK = 64;  // keys per block
constexpr int MR = 6;       // micro-kernel rows; its columns are 16 (two ymm)
constexpr int64_t kPackBytes = 16 << 20;  // the most a call's packed K and V take at once
// The running max before any key: the lowest float, not -inf, so that the first correction
// exp(kNoMax - m) is exp(0) = 1 when every score so far is -inf (-inf - -inf would be NaN) and 0 for
// any finite score m above it.
constexpr float kNoMax = std::numeric_limits<float>::lowest();

// C[R x 16] (=, or += when ACC) A[R x K] B[K x 16]; A rows lda apart, B rows ldb apart, C rows ldc apart.
template <int R, bool ACC>
inline void tile(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
  __m256 c0[R], c1[R];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    c0[r] = ACC ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
    c1[r] = ACC ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb), b1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      c0[r] = _mm256_fmadd_ps(a, b0, c0[r]);
      c1[r] = _mm256_fmadd_ps(a, b1, c1[r]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(C + r * ldc, c0[r]);
    _mm256_storeu_ps(C + r * ldc + 8, c1[r]);
  }
}

#if defined(__AVX512F__)
// tile's AVX-512 form: C[R x 16 NV] (=, or +=) A[R x K] B[K x 16 NV]. Each of C's values is the
// same chain of FMAs over k as in tile, so the two give the same bits.
template <int R, int NV, bool ACC>
inline void tile512(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t K, float* C, int64_t ldc) {
  __m512 c[R][NV];
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = ACC ? _mm512_loadu_ps(C + r * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 b[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) b[v] = _mm512_loadu_ps(B + k * ldb + 16 * v);
#pragma GCC unroll 6
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(A[r * lda + k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = _mm512_fmadd_ps(a, b[v], c[r][v]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + r * ldc + 16 * v, c[r][v]);
}

template <int NV, bool ACC>
inline void rows512(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t K, float* C,
                    int64_t ldc) {
  int64_t i = 0;
  for (; i + 6 <= M; i += 6) tile512<6, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc);
  switch (M - i) {
    case 5: tile512<5, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc); break;
    case 4: tile512<4, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc); break;
    case 3: tile512<3, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc); break;
    case 2: tile512<2, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc); break;
    case 1: tile512<1, NV, ACC>(A + i * lda, lda, B, ldb, K, C + i * ldc, ldc); break;
    default: break;
  }
}
#endif

// C[M x N] (=, or +=) A[M x K] B[K x N], N a multiple of 16.
template <bool ACC>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K, float* C,
          int64_t ldc) {
#if defined(__AVX512F__)
  int64_t j = 0;
  for (; j + 64 <= N; j += 64) rows512<4, ACC>(A, lda, B + j, ldb, M, K, C + j, ldc);
  for (; j + 32 <= N; j += 32) rows512<2, ACC>(A, lda, B + j, ldb, M, K, C + j, ldc);
  for (; j < N; j += 16) rows512<1, ACC>(A, lda, B + j, ldb, M, K, C + j, ldc);
#else
  for (int64_t j = 0; j < N; j += 16) {
    int64_t i = 0;
    for (; i + MR <= M; i += MR) tile<MR, ACC>(A + i * lda, lda, B + j, ldb, K, C + i * ldc + j, ldc);
    const float *a = A + i * lda, *b = B + j;
    float* c = C + i * ldc + j;
    switch (M - i) {
      case 5: tile<5, ACC>(a, lda, b, ldb, K, c, ldc); break;
      case 4: tile<4, ACC>(a, lda, b, ldb, K, c, ldc); break;
      case 3: tile<3, ACC>(a, lda, b, ldb, K, c, ldc); break;
      case 2: tile<2, ACC>(a, lda, b, ldb, K, c, ldc); break;
      case 1: tile<1, ACC>(a, lda, b, ldb, K, c, ldc); break;
      default: break;
    }
  }
#endif
}

}  // namespace

namespace {

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
  static void pack_k(const uint16_t* kp, int64_t ks, int64_t nk, int64_t D, uint16_t* dst) {
    uint32_t* kt = reinterpret_cast<uint32_t*>(dst);
    for (int64_t j = 0; j < BK; ++j) {
      if (j < nk) {
        const uint32_t* src = reinterpret_cast<const uint32_t*>(kp + j * ks);
        for (int64_t p = 0; p < D / 2; ++p) kt[p * BK + j] = src[p];
      } else {
        for (int64_t p = 0; p < D / 2; ++p) kt[p * BK + j] = 0;
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

inline void load_v(const float* src, int64_t D, float* dst) { std::copy_n(src, D, dst); }
inline void load_v(const uint16_t* src, int64_t D, float* dst) {
  for (int64_t d = 0; d < D; ++d) dst[d] = pagoda_bf16::to_float(src[d]);
}
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

// The kernel over inputs of type T (float, or bf16 bits) with the scores of Scores.
template <typename T, typename Scores>
void run(const T* qp, const T* kp, const T* vp, T* op, int64_t n, int64_t Hq, int64_t D, int64_t S, int64_t Hkv,
         int64_t qs, int64_t ks, int64_t vs, int64_t qhs, int64_t khs, int64_t vhs, float fscale) {
  using Packed = typename Scores::Packed;
  const int64_t G = Hq / Hkv, ctx = S - n, M = G * BQ;
  const int64_t nqb = (n + BQ - 1) / BQ, nkb = (S + BK - 1) / BK;
  // Every KV head's keys and values are packed once for all the query blocks that read them (each
  // block packing its own copy cost as much as its GEMMs): K blocks in Scores' layout, V widened to
  // float32 rows, and whether each V block is all finite. Heads go in groups whose packed copies
  // take at most kPackBytes (one group for a small model's prompt; a long context takes a head at a time).
  const int64_t head_bytes = nkb * D * BK * static_cast<int64_t>(sizeof(Packed)) + S * D * 4;
  const int64_t hg = std::clamp<int64_t>(kPackBytes / head_bytes, 1, Hkv);
  std::vector<Packed> Kp(hg * nkb * D * BK);
  std::vector<float> Vf(hg * S * D);
  std::vector<char> v_finite(hg * nkb);
  for (int64_t h0 = 0; h0 < Hkv; h0 += hg) {
    const int64_t nh = std::min(hg, Hkv - h0);
    const auto k_block = [&](int64_t h, int64_t kb) { return &Kp[((h - h0) * nkb + kb) * D * BK]; };
    const auto v_row = [&](int64_t h, int64_t j) { return &Vf[((h - h0) * S + j) * D]; };
#pragma omp parallel num_threads(at::get_num_threads())
    {
#pragma omp for schedule(static)
      for (int64_t item = 0; item < nh * nkb; ++item) {
        const int64_t h = h0 + item / nkb, j0 = (item % nkb) * BK, nk = std::min(BK, S - j0);
        Scores::pack_k(kp + j0 * ks + h * khs, ks, nk, D, k_block(h, j0 / BK));
        for (int64_t j = 0; j < nk; ++j) load_v(vp + (j0 + j) * vs + h * vhs, D, v_row(h, j0 + j));
        v_finite[item] = pagoda::all_finite(v_row(h, j0), nk * D);
      }
      Scores qk(M, D);
      std::vector<float> Sc(M * BK), O(M * D), mx(M), sum(M);
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
          const float* Vp = v_row(h, j0);
          qk.scores(rows, nkp, D, fscale, k_block(h, j0 / BK), Sc.data());
          // Keys [0, all_see) are visible to every row; row r also sees [all_see, visible(r)).
          const auto visible = [&](int64_t r) { return std::clamp<int64_t>(ctx + i0 + r % nq + 1 - j0, 0, nk); };
          const int64_t all_see = visible(0);
          for (int64_t r = 0; r < rows; ++r) {
            const int64_t vis = visible(r);
            float* s = &Sc[r * BK];
            const float m = pagoda::max_f32(s, vis, mx[r]);
            const float correction = pagoda::exp_f32(mx[r] - m);
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
          if (all_see == nk || v_finite[(h - h0) * nkb + j0 / BK] || pagoda::all_finite(&Vp[all_see * D], (nk - all_see) * D)) {
            gemm<true>(Sc.data(), BK, Vp, D, rows, D, nk, O.data(), D);
          } else {
            gemm<true>(Sc.data(), BK, Vp, D, rows, D, all_see, O.data(), D);
            for (int64_t r = 0; r < rows; ++r) {
              const float* s = &Sc[r * BK];
              float* o = &O[r * D];
              for (int64_t j = all_see, vis = visible(r); j < vis; ++j) {
                const float p = s[j];
                const float* vj = &Vp[j * D];
                for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
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
      run<uint16_t, Bf16Scores>(bits(q), bits(k), bits(v), reinterpret_cast<uint16_t*>(out.data_ptr()), n, Hq, D, S,
                                Hkv, q.stride(0), k.stride(0), v.stride(0), q.stride(1), k.stride(1), v.stride(1),
                                fscale);
      return out;
    }
#endif
    return prefill_attention(q.to(torch::kFloat32), k.to(torch::kFloat32), v.to(torch::kFloat32), scale)
        .to(torch::kBFloat16);
  }
  auto out = torch::empty({n, Hq, D}, q.options());
  run<float, F32Scores>(q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(), n, Hq,
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
