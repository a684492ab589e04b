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
//   row-major and 16 columns per register tile;
// - key blocks wholly above the diagonal are skipped; the diagonal block is masked.
//
// inf and NaN go through as in exact arithmetic over each query's visible keys (built without
// -ffast-math; see vec_math.h): a NaN or +inf score makes its row NaN and a -inf score weighs 0, as
// in torch's softmax, and a key past a query's position contributes nothing to it, even a NaN or inf
// one (torch's SDPA lets such a value leak into every row: 0 * NaN).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <omp.h>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t BQ = 32;  // query positions per work item (times G query heads)
constexpr int64_t BK = 64;  // keys per block
constexpr int MR = 6;       // micro-kernel rows; its columns are 16 (two ymm)
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

// C[M x N] (=, or +=) A[M x K] B[K x N], N a multiple of 16.
template <bool ACC>
void gemm(const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t N, int64_t K, float* C,
          int64_t ldc) {
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
}

}  // namespace

// q [n, Hq, D], k and v [S, Hkv, D] (any strides but a contiguous head_dim), n <= S; query i
// sits at position S - n + i and attends keys 0..S - n + i. Returns [n, Hq, D].
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32,
              "prefill_attention takes float32");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v must be [tokens, heads, head_dim]");
  const int64_t n = q.size(0), Hq = q.size(1), D = q.size(2), S = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D && Hkv > 0 && Hq % Hkv == 0 && n <= S,
              "k and v must be [S, Hkv, D] with S >= the query count and Hkv dividing Hq");
  TORCH_CHECK(D % 16 == 0, "head_dim must be a multiple of 16");
  for (const auto* t : {&q, &k, &v}) TORCH_CHECK(t->stride(2) == 1, "head_dim must be contiguous");
  const int64_t G = Hq / Hkv, ctx = S - n, M = G * BQ;
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0);
  const int64_t qhs = q.stride(1), khs = k.stride(1), vhs = v.stride(1);
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  auto out = torch::empty({n, Hq, D}, q.options());
  float* op = out.data_ptr<float>();
  const int64_t nqb = (n + BQ - 1) / BQ;
  const float fscale = static_cast<float>(scale);
  // Later query blocks see more keys: hand items out dynamically, the costliest first.
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<float> Qp(M * D), Kt(D * BK), Vp(BK * D), Sc(M * BK), O(M * D), mx(M), sum(M);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < nqb * Hkv; ++item) {
      const int64_t qb = nqb - 1 - item / Hkv, h = item % Hkv;
      const int64_t i0 = qb * BQ, nq = std::min(BQ, n - i0);
      // Rows g * nq + i of the stacked block: query head h * G + g at chunk position i0 + i.
      const int64_t rows = G * nq;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < nq; ++i) {
          const float* src = qp + (i0 + i) * qs + (h * G + g) * qhs;
          float* dst = &Qp[(g * nq + i) * D];
          for (int64_t d = 0; d < D; ++d) dst[d] = src[d] * fscale;
        }
      std::fill(O.begin(), O.begin() + rows * D, 0.f);
      std::fill(mx.begin(), mx.begin() + rows, kNoMax);
      std::fill(sum.begin(), sum.begin() + rows, 0.f);
      const int64_t kend = ctx + i0 + nq;  // keys this block's last query sees
      for (int64_t j0 = 0; j0 < kend; j0 += BK) {
        const int64_t nk = std::min(BK, kend - j0);
        const int64_t nkp = (nk + 15) / 16 * 16;  // columns padded to whole tiles
        for (int64_t d = 0; d < D; ++d) {
          float* kt = &Kt[d * BK];
          for (int64_t j = 0; j < nk; ++j) kt[j] = kp[(j0 + j) * ks + h * khs + d];
          for (int64_t j = nk; j < nkp; ++j) kt[j] = 0.f;
        }
        for (int64_t j = 0; j < nk; ++j) std::copy_n(vp + (j0 + j) * vs + h * vhs, D, &Vp[j * D]);
        gemm<false>(Qp.data(), D, Kt.data(), BK, rows, nkp, D, Sc.data(), BK);
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
        if (all_see == nk || pagoda::all_finite(&Vp[all_see * D], (nk - all_see) * D)) {
          gemm<true>(Sc.data(), BK, Vp.data(), D, rows, D, nk, O.data(), D);
        } else {
          gemm<true>(Sc.data(), BK, Vp.data(), D, rows, D, all_see, O.data(), D);
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
          float* dst = op + ((i0 + i) * Hq + h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = O[r * D + d] * inv;
        }
    }
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("prefill_attention", &prefill_attention); }
