// Decode attention of one work item for a bf16 model over a bf16 cache, on AVX512-BF16: q.k by
// vdpbf16ps straight from the cache rows (32 products a instruction, exact, summed in float32) and
// p.v by float32 FMAs over rows widened in registers, with no copy of a block into a buffer.
//
// Why it is its own kernel: the general one (paged_decode.cpp) widens every row to float32 through
// memory and sums 8 lanes at a time. Here the arithmetic of 64 sequences of a few hundred tokens
// takes ~0.3 ms a layer with the cache warm, against ~0.6 there; with the next block's rows asked
// for while one is worked on (block_prefetch.h), a cold layer takes ~0.6 ms, what a plain gather of
// the same blocks takes (1.5 ms before both changes).
//
// Rounding: every product of two bf16 values is exact in float32, so q.k differs from the general
// kernel's only in the order of its float32 additions (and in the scale, applied to the sum here,
// to q there: the same for a power-of-two scale). Softmax and p.v are the general kernel's: float32
// probabilities, float32 sums in token order, one rounding to bf16 at the end.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "balanced_for.h"
#include "bf16_tile.h"
#include "block_prefetch.h"
#include "vec_math.h"

namespace pagoda_decode16 {

constexpr int64_t kMaxHeadDim = 512;
alignas(64) inline const uint16_t kZeroRow[kMaxHeadDim] = {};  // stands in for the tokens past a group's end

// Whether this kernel takes a head size: whole vdpbf16ps steps (32 values), at most kMaxHeadDim.
inline bool takes(int64_t D) { return D % 32 == 0 && D <= kMaxHeadDim; }

// The 16 sums of a[0..16), one per lane, in the order lane l = sum of a[(l % 4) * 4 + l / 4]: a tree
// of 128-bit and 32-bit shuffles (45 instructions against 16 separate reductions' ~130).
static inline __m512 sum16(const __m512* a) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x44), _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0x88), _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    d[i] = _mm512_add_ps(_mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0x44), _mm512_shuffle_ps(c[2 * i], c[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], 0x88), _mm512_shuffle_ps(d[0], d[1], 0xDD));
}

// Which of a group's 16 tokens accumulator i holds, so that sum16 puts token l in lane l.
constexpr int64_t token_of(int64_t i) { return (i % 4) * 4 + i / 4; }

// The 16 dot products of q (D values) with 16 rows, `stride` apart from row0, token t in lane t. A
// running pointer walks the rows, so their addresses take no registers of their own (16 row pointers
// spilled, and q with them, when each row had one).
static inline __m512 dots16(const uint16_t* q, const uint16_t* row0, int64_t stride, int64_t D) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
    const uint16_t* r = row0 + d;
#pragma GCC unroll 16
    for (int t = 0; t < 16; ++t, r += stride)
      acc[token_of(t)] = _mm512_dpbf16_ps(acc[token_of(t)], qv, (__m512bh)_mm512_loadu_si512(r));
  }
  return sum16(acc);
}

// The same for rows given one by one (rows[i]: token token_of(i)'s row, or kZeroRow past the end).
// Kept apart from dots16: one loop over both forms (a row function) spilled again (0.49 against
// 0.40 ms a warm layer).
static inline __m512 dots_rows(const uint16_t* q, const uint16_t* const* rows, int64_t D) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + d);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], qv, (__m512bh)_mm512_loadu_si512(rows[i] + d));
  }
  return sum16(acc);
}

// The cache's view for one work item: rows of Hkv heads of D bf16, BS rows a block, blocks by the
// sequence's table; the item takes KV heads [g0, g0 + ng), each with G query heads.
struct Rows {
  const uint16_t* cache;
  const int64_t* table;
  int64_t BS, Hkv, D, g0, ng, G;
  const uint16_t* block(int64_t i) const { return cache + (table[i] * BS * Hkv + g0) * D; }
  int64_t stride() const { return Hkv * D; }
};

// Block i of r's rows (none past the context) asked for over `steps` calls of ahead.step().
static inline void start(pagoda_prefetch::Ahead& ahead, const Rows& r, int64_t i, int64_t S, int64_t steps) {
  if (i * r.BS >= S) return ahead.none();
  ahead.start(r.block(i), std::min(r.BS, S - i * r.BS), r.ng * r.D * 2, r.stride() * 2, steps);
}

// scores[h * S + t] = (q_h . k_t) * scale for the item's query heads h (qh[h]: head h's D values), t < S.
// The V rows' first block is asked for during the last K block.
static inline void qk(const uint16_t* const* qh, const Rows& k, const Rows& v, int64_t S, float scale, float* scores) {
  const int64_t stride = k.stride(), D = k.D;
  const __m512 vscale = _mm512_set1_ps(scale);
  pagoda_prefetch::Ahead ahead;
  for (int64_t bi = 0; bi * k.BS < S; ++bi) {
    const int64_t nb = std::min(k.BS, S - bi * k.BS);
    const int64_t steps = (nb + 15) / 16 * k.ng * k.G;
    if ((bi + 1) * k.BS < S) start(ahead, k, bi + 1, S, steps);
    else start(ahead, v, 0, S, steps);
    for (int64_t gi = 0; gi < k.ng; ++gi) {
      const uint16_t* base = k.block(bi) + gi * D;
      for (int64_t j0 = 0; j0 < nb; j0 += 16) {
        const int64_t n = std::min<int64_t>(16, nb - j0);
        const uint16_t* rows[16];
        for (int64_t i = 0; i < 16; ++i) rows[i] = token_of(i) < n ? base + (j0 + token_of(i)) * stride : kZeroRow;
        const __mmask16 keep = static_cast<__mmask16>((1u << n) - 1);
        for (int64_t h = gi * k.G; h < (gi + 1) * k.G; ++h) {
          ahead.step();
          const __m512 dots = n == 16 ? dots16(qh[h], base + j0 * stride, stride, D) : dots_rows(qh[h], rows, D);
          _mm512_mask_storeu_ps(scores + h * S + bi * k.BS + j0, keep, _mm512_mul_ps(dots, vscale));
        }
      }
    }
  }
}

// acc[(h0 + h) * D + d0 + 16 z] += sum_j p[(h0 + h) * S + j] * v_j[d0 + 16 z] over the n rows of one
// block (`rows`: the first row's columns of the heads' KV head), for HN heads and NZ vectors of 16.
template <int HN, int NZ>
static inline void pv_part(const float* p, int64_t S, const uint16_t* rows, int64_t stride, int64_t n, int64_t h0,
                           int64_t D, int64_t d0, float* acc, pagoda_prefetch::Ahead& ahead) {
  __m512 a[HN][NZ];
#pragma GCC unroll 4
  for (int h = 0; h < HN; ++h)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) a[h][z] = _mm512_loadu_ps(acc + (h0 + h) * D + d0 + 16 * z);
  for (int64_t j = 0; j < n; ++j) {
    ahead.step();
    __m512 x[NZ];
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) x[z] = pagoda_bf16::from_bf16(pagoda_bf16::load16(rows + j * stride + d0 + 16 * z));
#pragma GCC unroll 4
    for (int h = 0; h < HN; ++h) {
      const __m512 w = _mm512_set1_ps(p[(h0 + h) * S + j]);
#pragma GCC unroll 4
      for (int z = 0; z < NZ; ++z) a[h][z] = _mm512_fmadd_ps(w, x[z], a[h][z]);
    }
  }
#pragma GCC unroll 4
  for (int h = 0; h < HN; ++h)
#pragma GCC unroll 4
    for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc + (h0 + h) * D + d0 + 16 * z, a[h][z]);
}

template <int NZ>
static inline void pv_heads(const float* p, int64_t S, const uint16_t* rows, int64_t stride, int64_t n, int64_t h0,
                            int64_t h1, int64_t D, int64_t d0, float* acc, pagoda_prefetch::Ahead& ahead) {
  for (; h0 < h1; h0 += 4) {
    switch (std::min<int64_t>(4, h1 - h0)) {
      case 4: pv_part<4, NZ>(p, S, rows, stride, n, h0, D, d0, acc, ahead); break;
      case 3: pv_part<3, NZ>(p, S, rows, stride, n, h0, D, d0, acc, ahead); break;
      case 2: pv_part<2, NZ>(p, S, rows, stride, n, h0, D, d0, acc, ahead); break;
      default: pv_part<1, NZ>(p, S, rows, stride, n, h0, D, d0, acc, ahead); break;
    }
  }
}

// acc[h * D + d] = sum_t p[h * S + t] * v_t[d] for the item's query heads h, block by block (the
// float32 sums in token order); acc is overwritten. The last V block asks for the first K block of
// the thread's next item (`next_k` over `next_S` tokens; none when next_S is 0), whose q.k would
// otherwise begin by waiting on memory.
static inline void pv(const float* p, const Rows& v, int64_t S, float* acc, const Rows& next_k, int64_t next_S) {
  const int64_t D = v.D;
  std::fill(acc, acc + v.ng * v.G * D, 0.f);
  pagoda_prefetch::Ahead ahead;
  const int64_t calls = v.ng * ((D + 63) / 64) * ((v.G + 3) / 4);  // pv_part calls a block
  for (int64_t bi = 0; bi * v.BS < S; ++bi) {
    const int64_t nb = std::min(v.BS, S - bi * v.BS);
    if ((bi + 1) * v.BS < S) start(ahead, v, bi + 1, S, calls * nb);
    else start(ahead, next_k, 0, next_S, calls * nb);
    const float* pb = p + bi * v.BS;
    for (int64_t gi = 0; gi < v.ng; ++gi) {
      const uint16_t* rows = v.block(bi) + gi * D;
      int64_t d0 = 0;
      for (; d0 + 64 <= D; d0 += 64) pv_heads<4>(pb, S, rows, v.stride(), nb, gi * v.G, (gi + 1) * v.G, D, d0, acc, ahead);
      if (d0 < D) pv_heads<2>(pb, S, rows, v.stride(), nb, gi * v.G, (gi + 1) * v.G, D, d0, acc, ahead);  // a last 32
    }
  }
}

// paged_decode.cpp's decode_kernel for a bf16 model over a bf16 cache, with the same work items:
// heads_kv KV heads (all, or one) of a sequence each.
inline void decode(const uint16_t* q, int64_t qs0, int64_t qs1, const uint16_t* kc, const uint16_t* vc, const int64_t* bt,
                   const int64_t* lens, c10::BFloat16* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                   int64_t max_blocks, float scale, int64_t heads_kv) {
  const int64_t G = Hq / Hkv, items_per_seq = Hkv / heads_kv, nh = heads_kv * G;
  const auto tokens = [&](int64_t idx) { return pagoda_split::decode_item_cost(lens, idx, items_per_seq); };
  pagoda_split::balanced_for(B * items_per_seq, tokens, [&](const pagoda_split::Queue& queue) {
    std::vector<float> acc(nh * D), inv(nh), scores;
    std::vector<const uint16_t*> qh(nh);
    // Item idx: sequence idx / items_per_seq, its K rows from KV head (idx % items_per_seq) * heads_kv.
    const auto k_rows = [&](int64_t idx) {
      return Rows{kc, bt + idx / items_per_seq * max_blocks, BS, Hkv, D, (idx % items_per_seq) * heads_kv, heads_kv, G};
    };
    for (int64_t idx; (idx = queue.take()) >= 0;) {
      const Rows k = k_rows(idx), v{vc, k.table, BS, Hkv, D, k.g0, heads_kv, G};
      const int64_t b = idx / items_per_seq, hk0 = k.g0, S = lens[b];
      const int64_t next = queue.peek();  // if any, the last V block asks for its first K block
      scores.resize(nh * S);
      for (int64_t h = 0; h < nh; ++h) qh[h] = q + b * qs0 + (hk0 * G + h) * qs1;
      qk(qh.data(), k, v, S, scale, scores.data());
      for (int64_t h = 0; h < nh; ++h) {
        float* sh = &scores[h * S];
        inv[h] = 1.f / pagoda::exp_minus_max_(sh, S, pagoda::max_f32(sh, S, -std::numeric_limits<float>::infinity()));
      }
      pv(scores.data(), v, S, acc.data(), k_rows(next >= 0 ? next : idx), next >= 0 ? lens[next / items_per_seq] : 0);
      for (int64_t h = 0; h < nh; ++h)
        for (int64_t d = 0; d < D; ++d)
          out[(b * Hq + hk0 * G + h) * D + d] = static_cast<c10::BFloat16>(acc[h * D + d] * inv[h]);
    }
  });
}

}  // namespace pagoda_decode16
#endif
