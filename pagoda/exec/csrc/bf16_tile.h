// The bf16 micro-kernel shared by the grouped MoE experts (moe_experts.cpp) and the dense bf16 GEMM
// (gemm_bf16.cpp): M activation rows against one task's 64 output columns of weights packed as
// [K/2][4][16][2] bf16 (`pack_tasks` in exec/cpu_linear.py; the MoE experts in two halves of two
// blocks, tile_rows_halves), one vdpbf16ps per 16 columns and pair of k, accumulated in float32.
// Also what the GEMMs over this task layout share (gemm_bf16.cpp, gemm_int8.cpp): the plan of
// tasks, the row store, the per-column arguments. Header-only: each extension compiles it for its
// own CPU flags.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "block_prefetch.h"

namespace pagoda_bf16 {

using bf16 = c10::BFloat16;
constexpr int kBlock = 16;  // output columns per packed block
constexpr int kNB = 4;      // blocks per task: 2 gate + 2 up, or 4 down
constexpr int kMR = 6;      // activation rows per micro-kernel pass (6 x 4 accumulators)
// How far ahead of a task's weight stream to prefetch, in bytes: 1 KiB left one core at ~60 % of
// its read rate; 2-8 KiB measured alike on two cores. The weights are read once a step, so they are
// prefetched non-temporal (prefetchnta): 8-14 % faster than into all cache levels at 32 rows, and
// they do not push the KV cache and activations out of L2 and L3.
constexpr int kPrefetch = 4096;

// Whether this build has the AVX512-BF16 kernels (else the scalar fallbacks, which callers avoid).
inline bool built_with_avx512_bf16() {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  return true;
#else
  return false;
#endif
}

inline float to_float(uint16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

inline float round_bf16(float v) { return static_cast<float>(bf16(v)); }

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// 16 floats to bf16 bits as c10::BFloat16 rounds them (to nearest even, NaN to 0x7FC0).
inline __m256i to_bf16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 from_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// The first n of 16 lanes: none for n <= 0, all for n >= 16 (a row's tail in masked loads and stores).
inline __mmask16 first_lanes(int64_t n) { return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1); }

inline __m512 round16(__m512 v) { return from_bf16(to_bf16(v)); }

inline __m256i load16(const uint16_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline void store16(uint16_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
#endif

// Another task's weights to ask for into L2 while a pass works from L2 (a multi-pass task's later
// passes), one line an iteration of k. The first pass of that task then reads from L2 instead of
// waiting on memory.
using Ahead = pagoda_prefetch::Lines;

// c[m][j * 16 + i] = sum_k a[m][k] * w[k / 2][j][i][k % 2]: M rows against one task's weights, kNB
// blocks of 16 columns interleaved per pair of k, so that the task streams one contiguous range.
// Stream: prefetch the weights non-temporal (read once); else into every level, for a task whose
// later passes read them again (many rows).
// NB < kNB: w is one part of a task packed as [K/2][NB][16][2], its sums go to c's blocks
// [j0, j0 + NB) (tile_rows_halves). ahead: another task's weights to ask for meanwhile (Ahead).
template <int M, bool Stream = true, int NB = kNB>
void tile(const uint16_t* const* a, const uint16_t* w, int64_t k, float (*c)[kNB * kBlock], int j0 = 0,
          Ahead* ahead = nullptr) {
  constexpr int kStep = NB * kBlock * 2;  // elements per pair of k
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  __m512 acc[M][NB];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  Ahead next = ahead != nullptr ? *ahead : Ahead{};  // a local, so that its two pointers stay in registers
  for (int64_t p = 0; p < pairs; ++p) {
    const uint16_t* src = w + p * kStep;
    next.step();
    __m512bh wv[NB];
    for (int j = 0; j < NB; ++j) {
      const char* soon = reinterpret_cast<const char*>(src + j * 2 * kBlock) + kPrefetch;
      if constexpr (Stream) _mm_prefetch(soon, _MM_HINT_NTA);
      else _mm_prefetch(soon, _MM_HINT_T0);
      wv[j] = (__m512bh)_mm512_loadu_si512(src + j * 2 * kBlock);
    }
    for (int m = 0; m < M; ++m) {
      int32_t pair;
      std::memcpy(&pair, a[m] + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xv, wv[j]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < NB; ++j) _mm512_storeu_ps(c[m] + (j0 + j) * kBlock, acc[m][j]);
  if (ahead != nullptr) *ahead = next;
#else
  for (int m = 0; m < M; ++m)
    for (int j = j0; j < j0 + NB; ++j)
      for (int i = 0; i < kBlock; ++i) {
        float s = 0.f;
        for (int64_t q = 0; q < k; ++q)
          s += to_float(a[m][q]) * to_float(w[(q / 2) * kStep + ((j - j0) * kBlock + i) * 2 + q % 2]);
        c[m][j * kBlock + i] = s;
      }
#endif
}

// Rows for the next pass over `left` rows, `most` rows a pass (tile_rows' kMR, tile_rows_halves'
// kMRHalves): passes as even as that allows (8 rows: 4 + 4, not 6 + 2), since a pass of one or two
// rows has too few accumulators to keep the dot-product units busy.
inline int64_t pass_rows(int64_t left, int64_t most = kMR) {
  const int64_t passes = (left + most - 1) / most;
  return (left + passes - 1) / passes;
}

template <bool Stream = true>
void tile_rows(int rows, const uint16_t* const* a, const uint16_t* w, int64_t k, float (*c)[kNB * kBlock],
               Ahead* ahead = nullptr) {
  switch (rows) {
    case 1: tile<1, Stream>(a, w, k, c, 0, ahead); break;
    case 2: tile<2, Stream>(a, w, k, c, 0, ahead); break;
    case 3: tile<3, Stream>(a, w, k, c, 0, ahead); break;
    case 4: tile<4, Stream>(a, w, k, c, 0, ahead); break;
    case 5: tile<5, Stream>(a, w, k, c, 0, ahead); break;
    default: tile<6, Stream>(a, w, k, c, 0, ahead); break;
  }
}

// Rows per pass of tile_rows_halves at most: 12 rows x 2 blocks, 24 accumulators.
constexpr int kMRHalves = 12;

// Up to kMRHalves rows against one task packed in halves, [2][K/2][2][16][2] (blocks 0-1, then
// 2-3; `pack_halves` in exec/cpu_grouped_moe.py): one pass over each half. Where tile_rows takes
// 7-12 rows in two passes over the whole task, the first bound by reading the weights from memory
// and the second by arithmetic, one after the other, here the weights stream once while the
// arithmetic of all the rows goes on. Each sum adds in the same order either way.
template <bool Stream = true>
void tile_rows_halves(int rows, const uint16_t* const* a, const uint16_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  for (int half = 0; half < 2; ++half) {
    const uint16_t* part = w + half * k * 2 * kBlock;
    const int j0 = 2 * half;
    switch (rows) {
      case 1: tile<1, Stream, 2>(a, part, k, c, j0); break;
      case 2: tile<2, Stream, 2>(a, part, k, c, j0); break;
      case 3: tile<3, Stream, 2>(a, part, k, c, j0); break;
      case 4: tile<4, Stream, 2>(a, part, k, c, j0); break;
      case 5: tile<5, Stream, 2>(a, part, k, c, j0); break;
      case 6: tile<6, Stream, 2>(a, part, k, c, j0); break;
      case 7: tile<7, Stream, 2>(a, part, k, c, j0); break;
      case 8: tile<8, Stream, 2>(a, part, k, c, j0); break;
      case 9: tile<9, Stream, 2>(a, part, k, c, j0); break;
      case 10: tile<10, Stream, 2>(a, part, k, c, j0); break;
      case 11: tile<11, Stream, 2>(a, part, k, c, j0); break;
      default: tile<12, Stream, 2>(a, part, k, c, j0); break;
    }
  }
}

// Rows per GEMM task at most (gemm_bf16.cpp, gemm_int8.cpp): 32 passes over L2-resident weights (96
// measured alike).
constexpr int64_t kChunkRows = 192;

// A GEMM's tasks: (64 output columns, a chunk of rows) each.
struct Plan {
  int64_t chunk;   // rows per task
  int64_t chunks;  // row chunks
  int64_t tasks;
};

// Enough tasks for the threads (4 per thread where the rows allow), chunks a multiple of a pass of
// `pass` rows (the micro-kernel's). A count of tasks the threads do not divide leaves all but one
// idle through the last round (SmolLM2's 9 and 15 column blocks at 64 rows: a tenth and a
// fifteenth of the GEMM), so they are split once more until the count divides, while a chunk keeps
// two passes (fewer rows are bound by reading the weights, which a split reads twice).
inline Plan plan(int64_t m, int64_t blocks, int threads, int64_t pass = kMR) {
  const int64_t passes = (m + pass - 1) / pass;
  auto with = [&](int64_t want) {
    int64_t chunk = (m + want - 1) / want;
    chunk = std::min(kChunkRows, (chunk + pass - 1) / pass * pass);
    const int64_t chunks = (m + chunk - 1) / chunk;
    return Plan{chunk, chunks, chunks * blocks};
  };
  Plan p = with(std::max<int64_t>(1, std::min<int64_t>((4 * threads + blocks - 1) / blocks, passes)));
  while (p.tasks % threads != 0 && p.tasks < 32 * threads) {
    const Plan finer = with(p.chunks + 1);
    if (finer.chunk < 2 * pass || finer.chunks == p.chunks) break;
    p = finer;
  }
  return p;
}

// A GEMM's per-column values (scale, bias) as n float32s, empty when not given; `who` and `what`
// name the kernel and the argument in the error.
inline std::vector<float> column_floats(const std::optional<at::Tensor>& t, int64_t n, const char* who,
                                        const char* what) {
  if (!t.has_value()) return {};
  TORCH_CHECK(t->dim() == 1 && t->size(0) >= n, who, ": ", what, " has fewer than n values");
  const at::Tensor f = t->to(at::kFloat).contiguous();
  return std::vector<float>(f.data_ptr<float>(), f.data_ptr<float>() + n);
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// bf16(silu(gate) * up) for 16 lanes: gate as bf16 bits widened to 32, up as floats of bf16 values;
// `table`: pagoda::silu_bf16_table() (pagoda/csrc/silu_bf16.h).
inline __m256i silu_mul16(__m512i gate, __m512 up, const float* table) {
  return to_bf16(_mm512_mul_ps(_mm512_i32gather_ps(gate, table, 4), up));
}
#endif

// silu(gate) * up for `cols` columns of one row's sums (gate[j], up[j]), each sum first rounded to
// bf16 as store_row rounds it: the epilogue of the gate_up GEMMs (gemm_bf16.cpp: a gate/up task's
// halves, c and c + 32, or the GGUF blocks' gate and up tasks) and of the grouped MoE kernel
// (moe_experts.cpp).
inline void store_silu_row(const float* gate, const float* up, int64_t cols, const float* table, uint16_t* dst) {
  int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (; j < cols; j += kBlock) {
    const __mmask16 mask = first_lanes(cols - j);
    const __m512i g = _mm512_cvtepu16_epi32(to_bf16(_mm512_maskz_loadu_ps(mask, gate + j)));
    _mm256_mask_storeu_epi16(dst + j, mask, silu_mul16(g, round16(_mm512_maskz_loadu_ps(mask, up + j)), table));
  }
#endif
  for (; j < cols; ++j) dst[j] = bf16(table[bf16(gate[j]).x] * round_bf16(up[j])).x;
}

// One row's sums of a task to bf16: times scale, plus bias (either may be null), `cols` of them.
inline void store_row(const float* c, int64_t cols, const float* scale, const float* bias, uint16_t* dst) {
  int64_t j = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (; j < cols; j += kBlock) {
    const __mmask16 mask = first_lanes(cols - j);
    __m512 v = _mm512_loadu_ps(c + j);
    if (scale != nullptr) v = _mm512_mul_ps(v, _mm512_maskz_loadu_ps(mask, scale + j));
    if (bias != nullptr) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, bias + j));
    _mm256_mask_storeu_epi16(dst + j, mask, to_bf16(v));
  }
#endif
  for (; j < cols; ++j) {
    float v = c[j];
    if (scale != nullptr) v *= scale[j];
    if (bias != nullptr) v += bias[j];
    dst[j] = bf16(v).x;
  }
}

}  // namespace pagoda_bf16
