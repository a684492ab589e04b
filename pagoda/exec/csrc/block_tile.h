// The bf16 micro-kernel over weights kept in a GGUF file's blocks (Q4_0, Q4_1, Q8_0) instead of
// bf16: for the few-row GEMMs of a decode step, which are bound by reading the weights (a bf16
// model loaded from such a file holds 2-3x the bytes the file does).
//
// Exact: each weight is widened in registers to the very bf16 value the loader makes of it
// (gguf-py's float32 d * q + m, rounded to nearest even; d * q is exact in float32 for these
// types, so one FMA gives the same float32), then summed with the same vdpbf16ps in the same order
// as tile<M> (bf16_tile.h) over the bf16 copy: the same bits (Q4_0: but the sign of a sum that is
// exactly zero, its zero weights being +0 here). exec/gguf_block_linears.py builds the layout, and
// task_widens_to checks that it widens to the loaded bf16 values before it is used.
//
// Layout of one task (64 output columns, as bf16_tile.h's) per k-block of 32: the columns' 64 scales
// and then 64 offsets as float16 (kHeader bytes), then per pair of k, per block of 16 columns, the
// values in the order [c0 k, c0 k+1, c1 k, ..., c15 k+1]: 4 bits, 16 bytes, column c's k + e in
// byte 2c + e (c < 8) low nibble or byte 2(c - 8) + e high nibble (unsigned: Q4_0's -8 is in its
// offset); 8 bits, 32 bytes in that order (signed). Value = scale * q + offset.
#pragma once

#include "bf16_tile.h"

namespace pagoda_bf16 {

constexpr int kBlockK = 32;                        // k per GGUF block
constexpr int64_t kHeader = 2 * kNB * kBlock * 2;  // a k-block's scales and offsets, float16
constexpr int64_t block_bytes(int bits) { return kHeader + (kBlockK / 2) * kNB * kBlock * bits / 4; }
// The bits a value of a layout with k-blocks of `bytes` bytes: 4 or 8, else 0 (no such layout).
constexpr int block_bits(int64_t bytes) { return bytes == block_bytes(4) ? 4 : bytes == block_bytes(8) ? 8 : 0; }

// Rows at most for which the GEMM takes the blocks (gemm_bf16.cpp), in at most two passes
// (tile_blocks_rows): more rows would widen every value once more per further pass, while the bf16
// copy's one read is shared by more rows (6 and 8 rows: 0.65x and 0.69x its time here).
constexpr int kBlockRowsMax = 8;

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// A k-block's scales and offsets for block j of a task's columns, in the lanes of widen_pair's two
// halves: [s0, s0, s1, s1, ..., s7, s7] and [s8, s8, ..., s15, s15].
struct PairScales {
  __m512 scale[2], offset[2];
};

inline PairScales block_scales(const uint8_t* blk, int j) {
  const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + j * 32)));
  const __m512 o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + kHeader / 2 + j * 32)));
  const __m512i lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi = _mm512_add_epi32(lo, _mm512_set1_epi32(8));
  return {{_mm512_permutexvar_ps(lo, s), _mm512_permutexvar_ps(hi, s)},
          {_mm512_permutexvar_ps(lo, o), _mm512_permutexvar_ps(hi, o)}};
}

// One pair of k of one block of 16 columns of a task, widened to bf16 in vdpbf16ps' order,
// [col0 k, col0 k+1, col1 k, ...]: the layout puts columns 0-7's values in the first half's lanes
// and 8-15's in the second's, so that vcvtne2ps2bf16 of the two halves is that order. q: the pair's
// values (k-block start + kHeader + p * pair bytes). (Turning a nibble into its float by a 16-entry
// vpermps table instead of a mask and a conversion measured the same.)
template <int Bits>
inline __m512bh widen_pair(const uint8_t* q, int j, const PairScales& s) {
  __m512 lo, hi;
  if constexpr (Bits == 4) {
    const __m512i both = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 16)));
    lo = _mm512_cvtepi32_ps(_mm512_and_si512(both, _mm512_set1_epi32(0x0F)));
    hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 4));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 32))));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + j * 32 + 16))));
  }
  lo = _mm512_fmadd_ps(lo, s.scale[0], s.offset[0]);
  hi = _mm512_fmadd_ps(hi, s.scale[1], s.offset[1]);
  return _mm512_cvtne2ps_pbh(hi, lo);
}
#endif

// Whether one task's blocks q widen to its bf16 weights w, packed [K/2][4][16][2] (bf16_tile.h's
// layout, which is the order widen_pair gives), value for value: +0 and -0 alike (Q4_0's zero is
// +0 here and carries d's sign in gguf-py; a sum differs by it only in the sign of an exact zero).
template <int Bits>
bool task_widens_to(const uint8_t* q, const uint16_t* w, int64_t k) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  constexpr int64_t kPair = kNB * kBlock * Bits / 4;
  const __m512i magnitude = _mm512_set1_epi16(0x7FFF);
  for (int64_t b = 0; b < k / kBlockK; ++b) {
    const uint8_t* blk = q + b * block_bytes(Bits);
    for (int j = 0; j < kNB; ++j) {
      const PairScales scales = block_scales(blk, j);
      for (int p = 0; p < kBlockK / 2; ++p) {
        const __m512i got = (__m512i)widen_pair<Bits>(blk + kHeader + p * kPair, j, scales);
        const __m512i want = _mm512_loadu_si512(w + ((b * kBlockK / 2 + p) * kNB + j) * 2 * kBlock);
        const __mmask32 differ = _mm512_cmpneq_epi16_mask(got, want);
        const __mmask32 zeros = _mm512_testn_epi16_mask(_mm512_or_si512(got, want), magnitude);
        if (differ & ~zeros) return false;
      }
    }
  }
  return true;
#else
  (void)q, (void)w, (void)k;
  return false;
#endif
}

// c[m][col] = sum_k a[m][k] * w(k, col) over one task's blocks w (k a multiple of 32), for its
// blocks of 16 columns [j0, j0 + NB) (all four, or one half: tile_blocks_rows). Stream: prefetch
// the values into L2 (read once), else into every level (a first half, whose second half reads the
// same lines again). Into L2, not non-temporal: on a 2-core Xeon with AMX, SmolLM2's 30 layers of
// Q4_1 blocks for one row took 6.9 against 11.4 ms (L1's few miss buffers held too few lines in
// flight; docs/perf-notes.md, 2026-12-07); the bf16 GEMM on Zen 4 measured T1 at least as fast.
template <int M, int Bits, int NB = kNB, bool Stream = true>
void tile_blocks(const uint16_t* const* a, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock], int j0 = 0) {
  constexpr int64_t kPair = kNB * kBlock * Bits / 4;  // bytes of values per pair of k
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < k / kBlockK; ++b) {
    const uint8_t* blk = w + b * block_bytes(Bits);
    PairScales scales[NB];
    for (int j = 0; j < NB; ++j) scales[j] = block_scales(blk, j0 + j);
    const uint8_t* q = blk + kHeader;
    for (int p = 0; p < kBlockK / 2; ++p, q += kPair) {
      for (int64_t line = 0; line < kPair; line += 64) {
        const char* soon = reinterpret_cast<const char*>(q) + kPrefetch + line;
        if constexpr (Stream) _mm_prefetch(soon, _MM_HINT_T1);
        else _mm_prefetch(soon, _MM_HINT_T0);
      }
      __m512bh xv[M];
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, a[m] + b * kBlockK + 2 * p, sizeof(pair));
        xv[m] = (__m512bh)_mm512_set1_epi32(pair);
      }
      for (int j = 0; j < NB; ++j) {
        const __m512bh wv = widen_pair<Bits>(q, j0 + j, scales[j]);
        for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv[m], wv);
      }
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c[m] + (j0 + j) * kBlock, acc[m][j]);
#else
  (void)a, (void)w, (void)k, (void)c, (void)j0, (void)kPair;
  TORCH_CHECK(false, "tile_blocks: built without AVX512-BF16");
#endif
}

// Up to 4 rows in one pass over the task; 5-8 in one pass over each half of its columns (the
// accumulators of all four blocks would not fit in registers), the second half's values then
// read from cache. Each value is widened once either way.
template <int M, int Bits>
void tile_blocks_halves(const uint16_t* const* a, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  tile_blocks<M, Bits, 2, false>(a, w, k, c, 0);
  tile_blocks<M, Bits, 2, true>(a, w, k, c, 2);
}

template <int Bits>
void tile_blocks_rows(int rows, const uint16_t* const* a, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  switch (rows) {
    case 1: tile_blocks<1, Bits>(a, w, k, c); break;
    case 2: tile_blocks<2, Bits>(a, w, k, c); break;
    case 3: tile_blocks<3, Bits>(a, w, k, c); break;
    case 4: tile_blocks<4, Bits>(a, w, k, c); break;
    case 5: tile_blocks_halves<5, Bits>(a, w, k, c); break;
    case 6: tile_blocks_halves<6, Bits>(a, w, k, c); break;
    case 7: tile_blocks_halves<7, Bits>(a, w, k, c); break;
    default: tile_blocks_halves<8, Bits>(a, w, k, c); break;
  }
}

}  // namespace pagoda_bf16
