// The few-row GEMM over a GGUF file's blocks on AMX tiles, rounding as oneDNN's bf16 GEMM does.
//
// Why: where oneDNN has AMX, the bf16 linears are oneDNN's, and up to 32 rows (SmolLM2's shapes, 2
// threads) it sums each output over k in order, 32 at a time with TDPBF16PS, from zero, then rounds
// to bf16 once (above that it splits k in parts, two for K = 576, three or four for 1,536, and adds
// them). TDPBF16PS rounds inside a pair of k otherwise than VDPBF16PS (~80 % of float32 sums
// differ), so block_tile.h's kernel cannot give oneDNN's bits; this one, the same TDPBF16PS over the
// same k order, does, value for value
// (tests/exec/test_gguf_block_linears.py). A prompt's rows may then read the blocks as a decode's do: a
// position rounds alike whether its step reads the blocks or the bf16 copy.
//
// Tiles, up to 16 rows: 0-3 the sums of a task's four blocks of 16 columns (rows x 16 floats), 4 the
// rows' 32 k (rows x 32 bf16, read in place from x), 5 and 6 a block's 32 k widened (16 pairs x 16
// columns x 2: block_tile.h's widen_pair gives one tile row), written to one of four buffers in
// turn. 17-32 rows: two passes over k, each for two of the four blocks: 0-3 the sums of (the first
// 16 rows, the rest) x (the two blocks), 4 and 5 the two groups of rows, 6 and 7 the two blocks.
#pragma once

#include <sys/syscall.h>
#include <algorithm>
#include <unistd.h>

#include "block_tile.h"

namespace pagoda_bf16 {

// Rows at most: two tiles' (oneDNN sums in order up to 32 rows of SmolLM2's shapes; from 33 it
// splits k, docs/perf-notes.md, 2026-12-07 "AMX tiles").
constexpr int kAmxRowsMax = 32;
// Rows at most on tiles at all (amx_tile_blocks_many; a step of decodes, which may round otherwise).
constexpr int kAmxManyRowsMax = 256;
constexpr int kTileRows = 16;

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
constexpr bool kBuiltWithAmx = true;

// Linux hands out the tiles' state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA), once.
inline bool amx_permitted() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles for `rows` rows of x (more than kAmxRowsMax: amx_tile_blocks_many's, every
// tile 16 rows of 64 bytes).
inline void amx_configure(int rows) {
  TileConfig cfg;
  const int first = std::min(rows, kTileRows), rest = rows - first;
  if (rows > kAmxRowsMax) {
    for (int t = 0; t < 8; ++t) cfg.rows[t] = kTileRows, cfg.colsb[t] = 64;
  } else if (rest == 0) {
    for (int t = 0; t < 5; ++t) cfg.rows[t] = static_cast<uint8_t>(rows), cfg.colsb[t] = 64;
    for (int t = 5; t < 7; ++t) cfg.rows[t] = kBlockK / 2, cfg.colsb[t] = 64;
  } else {
    for (int t : {0, 1, 4}) cfg.rows[t] = static_cast<uint8_t>(first);
    for (int t : {2, 3, 5}) cfg.rows[t] = static_cast<uint8_t>(rest);
    for (int t : {6, 7}) cfg.rows[t] = kBlockK / 2;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// GCC's tile loads and stores are asm statements that do not say they touch memory: without this
// barrier the compiler may drop or move the buffer's stores before a load, or c's reads before a store.
inline void memory_barrier() { asm volatile("" ::: "memory"); }

inline void zero_sums() {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
}

// Tiles 0-3 stored side by side, kBlock columns each, into rows of out `stride` bytes apart.
inline void store_sums(float* out, int64_t stride) {
  _tile_stored(0, out, stride);
  _tile_stored(1, out + kBlock, stride);
  _tile_stored(2, out + 2 * kBlock, stride);
  _tile_stored(3, out + 3 * kBlock, stride);
}

// Block j of a k-block's 16 columns, widened into a B tile's 16 rows.
template <int Bits>
inline void widen_tile(const uint8_t* blk, int j, uint16_t (*tile)[2 * kBlock]) {
  constexpr int64_t kPair = kNB * kBlock * Bits / 4;
  const PairScales scales = block_scales(blk, j);
  const uint8_t* q = blk + kHeader;
  for (int p = 0; p < kBlockK / 2; ++p) _mm512_store_si512(tile[p], (__m512i)widen_pair<Bits>(q + p * kPair, j, scales));
  memory_barrier();
}

// c[m][col] = sum_k a[m][k] * w(k, col), m < the configured rows, over one task's blocks w (k a
// multiple of 32); a's rows lda elements apart. The values are read once: prefetched into L2, as
// tile_blocks does.
template <int Bits>
void amx_tile_blocks(const uint16_t* a, int64_t lda, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  alignas(64) uint16_t tiles[4][kBlockK / 2][2 * kBlock];
  zero_sums();
  for (int64_t b = 0; b < k / kBlockK; ++b) {
    const uint8_t* blk = w + b * block_bytes(Bits);
    for (int64_t line = 0; line < block_bytes(Bits); line += 64)
      _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + line, _MM_HINT_T1);
    memory_barrier();  // x's rows, written before the call
    _tile_loadd(4, a + b * kBlockK, lda * 2);
    // A tile's number is an immediate: the four blocks written out, B in tiles 5 and 6 by turns.
    widen_tile<Bits>(blk, 0, tiles[0]);
    _tile_loadd(5, tiles[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    widen_tile<Bits>(blk, 1, tiles[1]);
    _tile_loadd(6, tiles[1], 64);
    _tile_dpbf16ps(1, 4, 6);
    widen_tile<Bits>(blk, 2, tiles[2]);
    _tile_loadd(5, tiles[2], 64);
    _tile_dpbf16ps(2, 4, 5);
    widen_tile<Bits>(blk, 3, tiles[3]);
    _tile_loadd(6, tiles[3], 64);
    _tile_dpbf16ps(3, 4, 6);
  }
  store_sums(c[0], kNB * kBlock * sizeof(float));
  memory_barrier();
}

// The same for 17-32 rows (amx_configure's second layout): a pass over k for each half of the
// task's blocks, each block widened once.
template <int Bits>
void amx_tile_blocks_two(const uint16_t* a, int64_t lda, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  alignas(64) uint16_t tiles[2][kBlockK / 2][2 * kBlock];
  constexpr int64_t kStride = kNB * kBlock * sizeof(float);
  for (int j = 0; j < kNB; j += 2) {
    zero_sums();
    for (int64_t b = 0; b < k / kBlockK; ++b) {
      const uint8_t* blk = w + b * block_bytes(Bits);
      for (int64_t line = 0; line < block_bytes(Bits) && j == 0; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + line, _MM_HINT_T1);
      memory_barrier();
      _tile_loadd(4, a + b * kBlockK, lda * 2);
      _tile_loadd(5, a + kTileRows * lda + b * kBlockK, lda * 2);
      widen_tile<Bits>(blk, j, tiles[0]);
      _tile_loadd(6, tiles[0], 64);
      widen_tile<Bits>(blk, j + 1, tiles[1]);
      _tile_loadd(7, tiles[1], 64);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, c[0] + j * kBlock, kStride);
    _tile_stored(1, c[0] + (j + 1) * kBlock, kStride);
    _tile_stored(2, c[kTileRows] + j * kBlock, kStride);
    _tile_stored(3, c[kTileRows] + (j + 1) * kBlock, kStride);
  }
  memory_barrier();
}

// The same for any rows, padded to a multiple of 32 (a's rows past the caller's are zeros; c has as
// many rows): k in chunks of kManyChunk blocks, each chunk's blocks widened once into a buffer on
// the stack, then a pass over the chunk per (32 rows, two blocks) as in amx_tile_blocks_two, the sums
// kept in c between chunks (a float32 store and load is exact: the sums are those of one pass). k in
// order from zero, so a row's sums are those of the kernels above; oneDNN splits k from 33 rows, so
// these rows round otherwise than oneDNN's (a step of decodes may: exec/cpu_linear.py, block_rows).
// At 17-32 rows amx_tile_blocks_two stays: ~20 % faster than this one there (30 layers, cold).
// 6 blocks' tiles (24 KB) stay in L1 beside x's columns and the sums; 2, 4 and 6 measured alike.
constexpr int64_t kManyChunk = 6;
template <int Bits>
void amx_tile_blocks_many(const uint16_t* a, int64_t lda, int64_t rows, const uint8_t* w, int64_t k, float (*c)[kNB * kBlock]) {
  alignas(64) uint16_t tiles[kManyChunk][kNB][kBlockK / 2][2 * kBlock];
  constexpr int64_t kStride = kNB * kBlock * sizeof(float);
  const int64_t kblocks = k / kBlockK;
  for (int64_t b0 = 0; b0 < kblocks; b0 += kManyChunk) {
    const int64_t chunk = std::min(kManyChunk, kblocks - b0);
    for (int64_t b = 0; b < chunk; ++b) {
      const uint8_t* blk = w + (b0 + b) * block_bytes(Bits);
      for (int64_t line = 0; line < block_bytes(Bits); line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(blk) + kPrefetch + line, _MM_HINT_T1);
      for (int j = 0; j < kNB; ++j) widen_tile<Bits>(blk, j, tiles[b][j]);
    }
    memory_barrier();  // x's rows, the widened tiles and the sums so far, written before their loads
    for (int64_t r = 0; r < rows; r += 2 * kTileRows) {
      const uint16_t* a0 = a + r * lda + b0 * kBlockK;
      for (int j = 0; j < kNB; j += 2) {
        if (b0 == 0) {
          zero_sums();
        } else {
          _tile_loadd(0, c[r] + j * kBlock, kStride);
          _tile_loadd(1, c[r] + (j + 1) * kBlock, kStride);
          _tile_loadd(2, c[r + kTileRows] + j * kBlock, kStride);
          _tile_loadd(3, c[r + kTileRows] + (j + 1) * kBlock, kStride);
        }
        for (int64_t b = 0; b < chunk; ++b) {
          _tile_loadd(4, a0 + b * kBlockK, lda * 2);
          _tile_loadd(5, a0 + kTileRows * lda + b * kBlockK, lda * 2);
          _tile_loadd(6, tiles[b][j], 64);
          _tile_loadd(7, tiles[b][j + 1], 64);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[r] + j * kBlock, kStride);
        _tile_stored(1, c[r] + (j + 1) * kBlock, kStride);
        _tile_stored(2, c[r + kTileRows] + j * kBlock, kStride);
        _tile_stored(3, c[r + kTileRows] + (j + 1) * kBlock, kStride);
      }
    }
    memory_barrier();
  }
}

// Every tile 16 rows of 64 bytes (prefill_amx.h).
inline void amx_configure_full() { amx_configure(kAmxRowsMax + 1); }

inline void amx_release() { _tile_release(); }
#else
constexpr bool kBuiltWithAmx = false;
inline bool amx_permitted() { return false; }
inline void amx_configure(int) {}
inline void amx_configure_full() {}
template <int Bits>
void amx_tile_blocks(const uint16_t*, int64_t, const uint8_t*, int64_t, float (*)[kNB * kBlock]) {
  TORCH_CHECK(false, "amx_tile_blocks: built without AMX");
}
template <int Bits>
void amx_tile_blocks_two(const uint16_t*, int64_t, const uint8_t*, int64_t, float (*)[kNB * kBlock]) {
  TORCH_CHECK(false, "amx_tile_blocks: built without AMX");
}
template <int Bits>
void amx_tile_blocks_many(const uint16_t*, int64_t, int64_t, const uint8_t*, int64_t, float (*)[kNB * kBlock]) {
  TORCH_CHECK(false, "amx_tile_blocks: built without AMX");
}
inline void amx_release() {}
#endif

}  // namespace pagoda_bf16
