// Dense bf16 linears with AVX512-BF16: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]), accumulated in
// float32 and rounded to bf16 once, for any number of rows; and the same over int8 weights with a
// float scale per output column (`--quantization int8`), widened to bf16 in cache.
//
// Why our own: the grouped MoE kernel's micro-kernel (bf16_tile.h) measured faster than oneDNN's
// packed bf16 GEMM on a 2-core AVX512-BF16 EPYC at every row count of a step (SmolLM2's MLP: 0.48
// against 0.59 ms at 64 rows, 0.99 against 1.03 at 128; docs/perf-notes.md), and it needs no
// primitive per row count, so rows are not padded to buckets.
//
// Work: tasks of (64 output columns, a chunk of rows), each thread taking one contiguous range of
// them (a whole column block's chunks in a row, and neighbouring blocks, so each thread streams one
// run of memory). A task streams its columns' packed weights ([K/2][4][16][2], one contiguous range)
// once per pass of up to 6 rows; a chunk of one pass prefetches them non-temporal (read once a
// step), a longer chunk into every level, as its later passes read them again from L2, and those
// later passes ask for the thread's next column block's weights, so that its first pass does not
// wait on memory (a decode step of 64 rows through SmolLM2's linears: 0.85-0.96x the time of
// dynamically handed-out tasks without it; docs/perf-notes.md "2026-12-06"). Narrow weights (few
// column blocks) are split by rows too, so that every thread has work.
//
// SiLU-and-multiply in the epilogue (gemm_bf16_silu): an MLP's gate_up weight packed with each task
// holding 32 gate columns and the same 32 up columns (exec/cpu_linear.py pair_gate_up), so that a task
// rounds both sums to bf16, as gemm_bf16 stores them, and writes silu(gate) * up as layer_ops'
// silu_and_mul computes it from those values (its table, one rounding of the product): the same bits,
// without writing the [gate | up] rows and reading them back (~2 % of the CPU-offline run).
//
// int8: a task first widens its columns' int8 weights (the same layout, one byte each) to bf16 in a
// per-thread buffer (exact: |q| <= 127), then runs the bf16 micro-kernel over it and multiplies each
// column's float32 sum by its scale. The products are exact, so this is the float32 matmul of the
// activations with q, scaled: no rounding of q * scale to bf16 as a dequantized weight would have.
#include <torch/extension.h>

#include <omp.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "amx_blocks.h"
#include "balanced_for.h"
#include "bf16_tile.h"
#include "block_tile.h"
#include "silu_bf16.h"

namespace {

using namespace pagoda_bf16;
using Opt = std::optional<torch::Tensor>;
constexpr int kCols = kNB * kBlock;  // output columns per task
// Rows [r0, r1) of x against one task's packed weights w (k wide), written to y's columns
// [col0, col0 + 64) that lie below n, each column's sum times scale[col] (if given) plus bias[col].
// `cached`: w was just written (a widened panel), so never prefetch it non-temporal. `next`: the
// weights of the task this thread runs next, if another column block, asked for by the later passes.
// `silu`: the task's columns are 32 gate then 32 up columns, and it writes silu(gate) * up to y's
// columns [col0, col0 + 32) below n (no scale or bias).
void run_task(const uint16_t* x, int64_t ldx, const uint16_t* w, int64_t k, int64_t r0, int64_t r1, int64_t col0,
              int64_t n, const float* scale, const float* bias, uint16_t* y, int64_t ldy, bool cached = false,
              const uint16_t* next = nullptr, const float* silu = nullptr) {
  float c[kMR][kCols];
  const bool stream = !cached && r1 - r0 <= kMR;
  Ahead ahead;
  if (next != nullptr) ahead.start(next, k * kCols * static_cast<int64_t>(sizeof(uint16_t)));
  for (int64_t r = r0, rows; r < r1; r += rows) {
    rows = pass_rows(r1 - r);
    const uint16_t* a[kMR];
    for (int i = 0; i < rows; ++i) a[i] = x + (r + i) * ldx;
    if (stream) tile_rows<true>(static_cast<int>(rows), a, w, k, c);
    else tile_rows<false>(static_cast<int>(rows), a, w, k, c, r > r0 && next != nullptr ? &ahead : nullptr);
    const int64_t cols = std::min<int64_t>(silu ? kCols / 2 : kCols, n - col0);
    for (int i = 0; i < rows; ++i) {
      if (silu) store_silu_row(c[i], c[i] + kCols / 2, cols, silu, y + (r + i) * ldy + col0);
      else store_row(c[i], cols, scale ? scale + col0 : nullptr, bias ? bias + col0 : nullptr, y + (r + i) * ldy + col0);
    }
  }
}

// Every task of the plan for x [M, K] against w (packed bf16) into y [M, n]: each thread its
// contiguous range, then the back of another's. The plan's tasks are alike in cost (and their count
// a multiple of the threads where it can be), so the ranges are equal. `silu`: w's tasks are gate/up
// pairs, each writing 32 columns (run_task).
void run_tasks(const torch::Tensor& x, const torch::Tensor& w, const float* bias, torch::Tensor& y, const float* silu) {
  const int64_t m = x.size(0), k = x.size(1), n = y.size(1), cols = silu ? kCols / 2 : kCols;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int threads = at::get_num_threads();
  const Plan p = plan(m, w.size(0), threads);
  pagoda_split::Ranges ranges = pagoda_split::Ranges::even(p.tasks, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t th = omp_get_thread_num();
    for (int64_t t; (t = ranges.take(th)) >= 0;) {
      const int64_t j = t / p.chunks, r0 = (t % p.chunks) * p.chunk, tn = ranges.peek(th);
      const uint16_t* next = tn >= 0 && tn / p.chunks != j ? wp + tn / p.chunks * k * kCols : nullptr;
      run_task(xp, x.stride(0), wp + j * k * kCols, k, r0, std::min(m, r0 + p.chunk), j * cols, n, nullptr, bias, yp,
               n, false, next, silu);
    }
  }
}

// w's int8 [K/2][64][2] task range widened to bf16 bits in `out` (K * 64 values).
void widen(const int8_t* w, int64_t k, uint16_t* out) {
  const int64_t n = k * kCols;
  int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  for (; i + 32 <= n; i += 32) {
    const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i));
    const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + i + 16));
    const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(hi)),
                                           _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lo)));
    _mm512_storeu_si512(out + i, (__m512i)v);
  }
#endif
  for (; i < n; ++i) out[i] = bf16(static_cast<float>(w[i])).x;
}

void check(const torch::Tensor& x, const torch::Tensor& w, int64_t n, at::ScalarType wtype) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "gemm_bf16: x [M, K] bf16, rows contiguous");
  TORCH_CHECK(w.dim() == 5 && w.scalar_type() == wtype && w.is_contiguous() && w.size(2) == kNB && w.size(3) == kBlock &&
              w.size(4) == 2, "gemm_bf16: w packed [N/64, K/2, 4, 16, 2]");
  TORCH_CHECK(w.size(1) * 2 == x.size(1), "gemm_bf16: x has ", x.size(1), " columns, w ", w.size(1) * 2);
  TORCH_CHECK(n > 0 && n <= w.size(0) * kCols && n > (w.size(0) - 1) * kCols, "gemm_bf16: n does not match w");
}

// The few rows of x against the same weights kept in GGUF blocks (block_tile.h), q [ceil(N/64), K/32,
// block_bytes]: one task a column block, each thread a contiguous range of them, then the back of
// another's (balanced_for.h's Ranges). `amx`: on AMX tiles (amx_blocks.h: oneDNN's bits up to
// kAmxRowsMax rows; up to kAmxManyRowsMax in whole groups of 32 rows, read from x itself where its
// rows are such groups, else from a zero-padded copy), else as our GEMM sums (up to kBlockRowsMax).
// `silu` (b empty): q holds [gate | up], n their columns, and y [M, n / 2] takes silu(gate) * up:
// task t sums gate's column block t and up's t + n / 128 (n / 2 a multiple of kCols), rounds both
// rows to bf16 as y would hold them, and multiplies them as silu_and_mul does (the same bits as the
// two calls, without a [M, n] round trip through memory or a parallel region of its own).
void gemm_blocks(const torch::Tensor& x_in, const torch::Tensor& q, const std::vector<float>& b, int64_t n,
                 torch::Tensor& y, bool amx = false, const float* silu = nullptr) {
  const int64_t m = x_in.size(0), k = x_in.size(1), stride = q.size(1) * q.size(2);
  TORCH_CHECK(!silu || (b.empty() && n % (2 * kCols) == 0), "gemm_blocks: SiLU takes whole gate/up tasks, no bias");
  const int64_t tasks = silu ? n / 2 / kCols : q.size(0), ldy = y.size(1);
  const bool many = amx && m > kAmxRowsMax;
  const int64_t padded = many ? (m + 2 * kTileRows - 1) / (2 * kTileRows) * (2 * kTileRows) : m;
  torch::Tensor x = x_in;
  // The tiles read whole 32-row groups k apart: a copy only where x has a partial group or strided rows.
  if (many && (padded != m || x_in.stride(0) != k)) {
    x = torch::zeros({padded, k}, x_in.options());
    x.narrow(0, 0, m).copy_(x_in);
  }
  const int bits = block_bits(q.size(2));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const uint8_t* qp = q.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  // Each thread its contiguous range, then the back of another's (balanced_for.h): a thread held up
  // (the server's API process on its core) costs the step its lost time once, not twice.
  pagoda_split::Ranges ranges = pagoda_split::Ranges::even(tasks, threads);
#pragma omp parallel num_threads(threads)
  {
    const int64_t th = omp_get_thread_num();
    // Sums for gate (or the one linear) and up (silu); not zeroed: every kernel stores all its rows'.
    alignas(64) float few[2][kAmxRowsMax][kCols];
    std::unique_ptr<float[]> more(many ? new float[(silu ? 2 : 1) * padded * kCols] : nullptr);
    auto* c = many ? reinterpret_cast<float(*)[kCols]>(more.get()) : few[0];
    auto* c_up = many ? c + padded : few[1];
    const uint16_t* a[kBlockRowsMax];
    for (int i = 0; i < m && !amx; ++i) a[i] = xp + i * x.stride(0);
    const auto sum_task = [&](int64_t t, float (*out)[kCols]) {
      const uint8_t* w = qp + t * stride;
      if (many && bits == 4) amx_tile_blocks_many<4>(xp, k, padded, w, k, out);
      else if (many) amx_tile_blocks_many<8>(xp, k, padded, w, k, out);
      else if (amx && m > kTileRows) {
        if (bits == 4) amx_tile_blocks_two<4>(xp, x.stride(0), w, k, out);
        else amx_tile_blocks_two<8>(xp, x.stride(0), w, k, out);
      } else if (amx && bits == 4) amx_tile_blocks<4>(xp, x.stride(0), w, k, out);
      else if (amx) amx_tile_blocks<8>(xp, x.stride(0), w, k, out);
      else if (bits == 4) tile_blocks_rows<4>(static_cast<int>(m), a, w, k, out);
      else tile_blocks_rows<8>(static_cast<int>(m), a, w, k, out);
    };
    const float* bias = b.empty() ? nullptr : b.data();
    if (amx) amx_configure(static_cast<int>(std::min<int64_t>(m, kAmxRowsMax + 1)));
    for (int64_t t; (t = ranges.take(th)) >= 0;) {
      sum_task(t, c);
      if (silu) {
        sum_task(t + tasks, c_up);
        for (int i = 0; i < m; ++i) store_silu_row(c[i], c_up[i], kCols, silu, yp + i * ldy + t * kCols);
        continue;
      }
      const int64_t cols = std::min<int64_t>(kCols, n - t * kCols);
      for (int i = 0; i < m; ++i) store_row(c[i], cols, nullptr, bias ? bias + t * kCols : nullptr, yp + i * ldy + t * kCols);
    }
    if (amx) amx_release();
  }
}

// The most rows gemm_bf16_blocks takes on AMX tiles (oneDNN's bits), or 0 where it cannot use them.
int64_t amx_block_rows() { return kBuiltWithAmx && amx_permitted() ? kAmxRowsMax : 0; }

// x as the block GEMM takes it: bf16 rows, contiguous within, at most the rows its path serves.
void check_block_rows(const torch::Tensor& x, bool tiles) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, "gemm_bf16: x [M, K] bf16, rows contiguous");
  TORCH_CHECK(!tiles || amx_block_rows() > 0, "gemm_bf16: built without AMX tiles, or not let use them");
  const int64_t rows = tiles ? kAmxManyRowsMax : kBlockRowsMax;
  TORCH_CHECK(x.size(0) <= rows && built_with_avx512_bf16(), "gemm_bf16: blocks serve at most ", rows,
              " rows, with AVX512-BF16");
}

void check_blocks(const torch::Tensor& x, const torch::Tensor& q, int64_t n) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.is_contiguous() && block_bits(q.size(2)) != 0,
              "gemm_bf16: blocks [N/64, K/32, ", block_bytes(4), " or ", block_bytes(8), "] uint8");
  TORCH_CHECK(q.size(1) * kBlockK == x.size(1) && q.size(0) * kCols >= n && n > (q.size(0) - 1) * kCols,
              "gemm_bf16: blocks do not match x and n");
}

}  // namespace

// Whether blocks q (block_tile.h) widen to the bf16 weights w (packed as gemm_bf16 takes them), value
// for value: the check before a copy in blocks is used (exec/cpu_linear.py).
bool blocks_widen_to(const torch::Tensor& q, const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 5 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), "blocks_widen_to: w packed bf16");
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kByte && q.is_contiguous(), "blocks_widen_to: q uint8 blocks");
  const int64_t tasks = q.size(0), k = w.size(1) * 2;
  const int bits = block_bits(q.size(2));
  if (bits == 0 || tasks != w.size(0) || q.size(1) * kBlockK != k || !built_with_avx512_bf16()) return false;
  const uint8_t* qp = q.data_ptr<uint8_t>();
  const auto* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  bool same = true;
#pragma omp parallel for reduction(&& : same)
  for (int64_t t = 0; t < tasks; ++t) {
    const uint8_t* tq = qp + t * q.size(1) * q.size(2);
    same = same && (bits == 4 ? task_widens_to<4>(tq, wp + t * k * kCols, k) : task_widens_to<8>(tq, wp + t * k * kCols, k));
  }
  return same;
}

// x [M, K] bf16 (rows may be strided), w packed [ceil(N/64), K/2, 4, 16, 2] bf16, bias [N] or None.
// q: the same weights in GGUF blocks (block_tile.h), which serve up to kBlockRowsMax rows.
torch::Tensor gemm_bf16(const torch::Tensor& x, const torch::Tensor& w, const Opt& bias, int64_t n,
                        const Opt& q) {
  check(x, w, n, at::kBFloat16);
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> b = column_floats(bias, n, "gemm_bf16", "bias");
  if (q.has_value() && m <= kBlockRowsMax && built_with_avx512_bf16()) {
    check_blocks(x, *q, n);
    gemm_blocks(x, *q, b, n, y);
    return y;
  }
  run_tasks(x, w, b.empty() ? nullptr : b.data(), y, nullptr);
  return y;
}

// x [M, K] bf16 against weights kept in GGUF blocks q alone: where oneDNN has AMX, the bf16 linears
// are oneDNN's, and a few of their rows read the blocks (exec/cpu_linear.py). `tiles`: on AMX tiles,
// rounding as oneDNN does up to amx_block_rows() rows, and up to kAmxManyRowsMax summing k in order
// (as oneDNN does for 16 rows); else as our GEMM does, up to kBlockRowsMax.
torch::Tensor gemm_bf16_blocks(const torch::Tensor& x, const torch::Tensor& q, const Opt& bias, int64_t n,
                               bool tiles) {
  check_block_rows(x, tiles);
  check_blocks(x, q, n);
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0) gemm_blocks(x, q, column_floats(bias, n, "gemm_bf16", "bias"), n, y, tiles);
  return y;
}

// silu(x w_gate^T) * (x w_up^T) [M, n] in bf16 over [gate | up] weights in GGUF blocks q (n a multiple
// of 64): what gemm_bf16_blocks(x, q, None, 2n, tiles) then silu_and_mul give, in one pass.
torch::Tensor gemm_bf16_blocks_silu(const torch::Tensor& x, const torch::Tensor& q, int64_t n, bool tiles) {
  check_block_rows(x, tiles);
  TORCH_CHECK(n > 0 && n % kCols == 0, "gemm_bf16_blocks_silu: n must be a multiple of ", kCols);
  check_blocks(x, q, 2 * n);
  auto y = torch::empty({x.size(0), n}, x.options());
  if (x.size(0) > 0) gemm_blocks(x, q, {}, 2 * n, y, tiles, pagoda::silu_bf16_table());
  return y;
}

// silu(x w_gate^T) * (x w_up^T) [M, n] in bf16, as gemm_bf16 then silu_and_mul give it; w packed
// [ceil(n/32), K/2, 4, 16, 2] from the paired gate_up rows (exec/cpu_linear.py pair_gate_up). q: the
// unpaired [gate | up] weights in GGUF blocks, which serve up to kBlockRowsMax rows as in gemm_bf16.
torch::Tensor gemm_bf16_silu(const torch::Tensor& x, const torch::Tensor& w, int64_t n, const Opt& q) {
  check(x, w, w.size(0) * kCols, at::kBFloat16);
  TORCH_CHECK(n > 0 && (n + kCols / 2 - 1) / (kCols / 2) == w.size(0), "gemm_bf16_silu: n does not match w");
  const int64_t m = x.size(0);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const float* table = pagoda::silu_bf16_table();
  if (q.has_value() && m <= kBlockRowsMax && built_with_avx512_bf16()) {
    check_blocks(x, *q, 2 * n);
    torch::Tensor gate_up = torch::empty({m, 2 * n}, x.options());
    gemm_blocks(x, *q, {}, 2 * n, gate_up);
    const auto* gp = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
    auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
    for (int64_t i = 0; i < m; ++i) pagoda::silu_mul_row(gp + i * 2 * n, gp + i * 2 * n + n, n, table, yp + i * n);
    return y;
  }
  run_tasks(x, w, nullptr, y, table);
  return y;
}

// The same over int8 weights (w int8 in gemm_bf16's layout) with scale [N] float32 per output column.
torch::Tensor gemm_i8_bf16(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& scale, const Opt& bias,
                           int64_t n) {
  check(x, w, n, at::kChar);
  const int64_t m = x.size(0), k = x.size(1), blocks = w.size(0);
  auto y = torch::empty({m, n}, x.options());
  if (m == 0) return y;
  const std::vector<float> s = column_floats(scale, n, "gemm_bf16", "scale");
  const std::vector<float> b = column_floats(bias, n, "gemm_bf16", "bias");
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const int8_t* wp = w.data_ptr<int8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int threads = at::get_num_threads();
  const Plan p = plan(m, blocks, threads);
#pragma omp parallel num_threads(threads)
  {
    std::vector<uint16_t> panel(k * kCols);
    int64_t widened = -1;  // the column block in `panel`: a thread's next task is often the same block's next chunk
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < p.tasks; ++t) {
      const int64_t j = t / p.chunks, r0 = (t % p.chunks) * p.chunk;
      if (j != widened) widen(wp + j * k * kCols, k, panel.data());
      widened = j;
      run_task(xp, x.stride(0), panel.data(), k, r0, std::min(m, r0 + p.chunk), j * kCols, n, s.data(),
               b.empty() ? nullptr : b.data(), yp, n, true);
    }
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gemm_bf16", &gemm_bf16, py::arg("x"), py::arg("w"), py::arg("bias"), py::arg("n"),
        py::arg("q") = py::none());
  m.def("gemm_bf16_silu", &gemm_bf16_silu, py::arg("x"), py::arg("w"), py::arg("n"), py::arg("q") = py::none());
  m.def("gemm_i8_bf16", &gemm_i8_bf16, py::arg("x"), py::arg("w"), py::arg("scale"), py::arg("bias"), py::arg("n"));
  m.def("gemm_bf16_blocks", &gemm_bf16_blocks, py::arg("x"), py::arg("q"), py::arg("bias"), py::arg("n"),
        py::arg("tiles") = false);
  m.def("gemm_bf16_blocks_silu", &gemm_bf16_blocks_silu, py::arg("x"), py::arg("q"), py::arg("n"),
        py::arg("tiles") = false);
  m.def("blocks_widen_to", &blocks_widen_to, py::arg("q"), py::arg("w"));
  m.attr("BLOCK_ROWS_MAX") = kBlockRowsMax;
  m.def("amx_block_rows", &amx_block_rows);
  m.attr("AMX_ROWS_MAX") = kAmxManyRowsMax;
  m.def("has_avx512_bf16", &pagoda_bf16::built_with_avx512_bf16);
  // For the fused decode step (exec/csrc/fused_decode.cpp), which calls it from C++.
  m.def("_addresses", [] {
    return std::map<std::string, int64_t>{{"gemm_bf16", reinterpret_cast<int64_t>(&gemm_bf16)},
                                          {"gemm_i8_bf16", reinterpret_cast<int64_t>(&gemm_i8_bf16)},
                                          {"gemm_bf16_silu", reinterpret_cast<int64_t>(&gemm_bf16_silu)},
                                          {"gemm_bf16_blocks", reinterpret_cast<int64_t>(&gemm_bf16_blocks)},
                                          {"gemm_bf16_blocks_silu", reinterpret_cast<int64_t>(&gemm_bf16_blocks_silu)}};
  });
}
