// Prefill attention's two GEMMs on AMX tiles (prefill_attention.cpp), where the CPU has them: the
// scores of 16 stacked query rows against a key block's 64 keys, and p.v of 16 rows' bf16
// probabilities against a block's values, each as TDPBF16PS over the very layouts the vdpbf16ps
// operands use (prefill_bf16.h): K as [D/2][64] pairs of dimensions and V as [BK/2][4][16][2] are
// B tiles as they lie, 256 bytes a row. On a 2-core Xeon with AMX, torch's flash attention ran 2-3x
// faster than the vdpbf16ps kernel at 272-2,048 tokens (docs/perf-notes.md, 2026-12-06 "AMX").
//
// What a position's output depends on is unchanged: a tile row's sums are that row's alone, so a
// score is its query's and key's, a row's p.v sums only its probabilities (0 past the keys it sees,
// which add nothing: 0 * a finite value), and key blocks start at key 0 whatever the chunk. The
// bits differ from the vdpbf16ps kernel's (TDPBF16PS rounds inside a pair of products otherwise), as
// the two instruction sets' GEMMs differ. p.v takes 32 keys an instruction, so a block whose values
// hold a non-finite value some rows must not see goes to the tiles only up to a multiple of 32 keys
// (gemm_keys); the caller adds the rest key by key.
#pragma once

#include "amx_blocks.h"
#include "prefill_bf16.h"

namespace pagoda_prefill {

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr int64_t kTile = pagoda_bf16::kTileRows;

// Tiles 0-3 += tile 4 (16 rows of 32 bf16) times the four B tiles of 16 columns at b, b + 32, b +
// 64, b + 96 (rows `stride` bytes apart), loaded into tiles 5 and 6 by turns.
inline void add_four_blocks(const uint16_t* b, int64_t stride) {
  _tile_loadd(5, b, stride);
  _tile_dpbf16ps(0, 4, 5);
  _tile_loadd(6, b + 32, stride);
  _tile_dpbf16ps(1, 4, 6);
  _tile_loadd(5, b + 64, stride);
  _tile_dpbf16ps(2, 4, 5);
  _tile_loadd(6, b + 96, stride);
  _tile_dpbf16ps(3, 4, 6);
}

// Scores as Bf16Scores gives them, on tiles: the queries copied into rows D apart (a tile reads rows
// one stride apart; the stacked heads' rows are not), 16 rows a pass, 0-3 the sums of the block's
// four groups of 16 keys, 4 the queries' 32 dimensions, 5 and 6 the keys' by turns. A thread's
// tiles are configured for its Scores' lifetime (one per thread and call of the kernel).
struct AmxScores {
  using Packed = uint16_t;
  std::vector<uint16_t> q_;  // [rows rounded up to 16][D]; rows past the item's hold stale or zero values
  alignas(64) float last_[kTile][BK];  // a last pass of fewer than 16 rows
  AmxScores(int64_t M, int64_t D) : q_((M + kTile - 1) / kTile * kTile * D, 0) { pagoda_bf16::amx_configure_full(); }
  ~AmxScores() { pagoda_bf16::amx_release(); }
  AmxScores(const AmxScores&) = delete;
  AmxScores& operator=(const AmxScores&) = delete;
  void load_q(int64_t r, const uint16_t* src, int64_t D, float) { std::memcpy(&q_[r * D], src, D * sizeof(uint16_t)); }
  static void pack_k(const uint16_t* kp, int64_t ks, int64_t nk, int64_t D, uint16_t* dst) {
    Bf16Scores::pack_k(kp, ks, nk, D, dst);
  }
  void scores(int64_t rows, int64_t, int64_t D, const uint16_t* kt, float* Sc) {
    constexpr int64_t kRow = BK * sizeof(float);
    pagoda_bf16::memory_barrier();  // the queries and packed keys, written before the tile loads
    for (int64_t r = 0; r < rows; r += kTile) {
      pagoda_bf16::zero_sums();
      for (int64_t s = 0; s < D / 32; ++s) {
        _tile_loadd(4, &q_[r * D + 32 * s], D * 2);
        add_four_blocks(kt + 16 * s * BK * 2, BK * 4);  // pairs 16s.., a row of BK pairs
      }
      float* out = rows - r >= kTile ? Sc + r * BK : last_[0];
      pagoda_bf16::store_sums(out, kRow);
      pagoda_bf16::memory_barrier();
      if (out == last_[0]) std::memcpy(Sc + r * BK, last_[0], (rows - r) * kRow);
    }
  }
  static float scale_max(float* s, int64_t n, float scale, float init) { return Bf16Scores::scale_max(s, n, scale, init); }
};

// Values packed as Bf16Values packs them; p.v on tiles: 16 rows of probabilities (rounded to bf16
// as there) a pass, 0-3 the sums of a task's four groups of 16 columns, 4 the rows' 32 keys, 5 and 6
// the values by turns; then the rows' corrections as Bf16Values applies them.
struct AmxValues : Bf16Values {
  std::vector<char> finite_;  // [heads][nkb]: whether a block's values are all finite
  AmxValues(int64_t heads, int64_t S, int64_t D_, int64_t nkb_) : Bf16Values(heads, S, D_, nkb_), finite_(heads * nkb_) {}
  bool pack(int64_t h, int64_t kb, const uint16_t* src, int64_t ks, int64_t nk) {
    return finite_[h * nkb + kb] = Bf16Values::pack(h, kb, src, ks, nk);
  }
  static int64_t gemm_keys(int64_t all_see) { return all_see & ~int64_t{31}; }
  struct Scratch {
    std::vector<uint16_t> pb;  // [rows rounded up to 16][BK]
    alignas(64) float c[kTile][kCols];
    alignas(64) uint16_t tail[16][kCols][2];  // a last 32 keys' values, 0 past the keys taken
  };
  // The B operand for keys [j, j + 32) of task t: the packed values as they lie, or where the block
  // holds a non-finite value and `keys` ends inside those 32, a copy that is 0 from `keys` on (a
  // probability of 0 would not keep such a value out: 0 * inf is NaN).
  const uint16_t* values_from(int64_t h, int64_t kb, int64_t t, int64_t j, int64_t keys, Scratch& scratch) const {
    const uint16_t* b = task(h, kb, t) + j * kCols;
    if (j + 32 <= keys || finite_[h * nkb + kb]) return b;
    for (int64_t p = 0; p < 16; ++p)
      for (int64_t c = 0; c < kCols; ++c)
        for (int64_t e = 0; e < 2; ++e) scratch.tail[p][c][e] = j + 2 * p + e < keys ? b[(p * kCols + c) * 2 + e] : 0;
    pagoda_bf16::memory_barrier();  // the copy, written before its tile load
    return scratch.tail[0][0];
  }
  void accumulate(int64_t h, int64_t kb, const float* P, int64_t rows, int64_t keys, const float* corr, float* O,
                  Scratch& scratch) const {
    if (keys == 0) return correct(O, corr, rows, D);
    std::vector<uint16_t>& pb = scratch.pb;
    pb.resize((rows + kTile - 1) / kTile * kTile * BK);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < BK; j += 16) {
        const __m512 p = _mm512_maskz_loadu_ps(pagoda_bf16::first_lanes(keys - j), P + r * BK + j);  // 0 past `keys`
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(&pb[r * BK + j]), (__m256i)_mm512_cvtneps_pbh(p));
      }
    pagoda_bf16::memory_barrier();
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t cols = std::min(kCols, D - t * kCols);
      for (int64_t r = 0; r < rows; r += kTile) {
        pagoda_bf16::zero_sums();
        for (int64_t j = 0; j < keys; j += 32) {
          _tile_loadd(4, &pb[r * BK + j], BK * 2);
          add_four_blocks(values_from(h, kb, t, j, keys, scratch), kCols * 4);  // key pairs j/2.., 64 columns' a row
        }
        auto* c = scratch.c;
        pagoda_bf16::store_sums(c[0], kCols * 4);
        pagoda_bf16::memory_barrier();
        for (int64_t i = 0; i < std::min(kTile, rows - r); ++i) add_corrected(O + (r + i) * D + t * kCols, corr[r + i], c[i], cols);
      }
    }
  }
};
#endif

}  // namespace pagoda_prefill
