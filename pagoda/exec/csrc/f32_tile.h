// A float32 GEMM for the small blocks of prefill attention (csrc/prefill_attention.cpp): C (=, or
// += when ACC) A B with B's rows 16 floats a register tile, by AVX2 FMAs, or AVX-512 where the CPU
// has it (the same chain of FMAs over k for each of C's values, so the same bits either way).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace pagoda_f32 {

constexpr int MR = 6;  // micro-kernel rows; its columns are 16 (two ymm)

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

}  // namespace pagoda_f32
