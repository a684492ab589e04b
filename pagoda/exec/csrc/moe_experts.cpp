// The routed experts of one MoE layer in one call, bf16 with AVX512-BF16: the (token, expert) pairs
// grouped by expert, gate-up with SiLU-and-multiply, down, the routing weights and the sum back to
// the tokens (pagoda/model/fused_moe.py describes the computation; this is its CPU experts_kernel).
//
// Why one call: a decode step of 32 tokens, top-2 of 8 experts, gives each expert ~8 rows. Per expert
// and projection oneDNN's packed GEMM (blocked for many rows) ran well below the memory's rate at so
// few rows, and the ~25 small torch ops around the 16 calls added their own cost. Here each
// projection is one OpenMP region over (expert, 64 output columns) tasks, handed out dynamically, so
// both cores stream weights even when one expert has 2 rows and another 14, and every weight byte is
// read from memory once per step: an expert's rows up to 12 go in one pass over each half of a task
// (bf16_tile.h tile_rows_halves), so that its weights stream while the arithmetic goes on.
//
// Weights are packed once (GroupedExperts in exec/cpu_grouped_moe.py) into blocks of 16 output
// columns, [K/2][16][2] each: one 64-byte load is 16 columns x one pair of k, the operand of one
// vdpbf16ps against a broadcast pair of an activation row. A task's four blocks lie in two halves of
// two blocks, [2][K/2][2][16][2], each half one contiguous range. w13's halves are a task's 32 gate
// columns and the same 32 of up, so a task applies SiLU-and-multiply itself.
//
// Rounding follows the modules' path (fused_moe.fused_experts with the layer ops): gate-up rounds to
// bf16, silu(gate) is the layer ops' table of bf16(g / (1 + exp(-g))), its product with up rounds
// once; down rounds to bf16, is weighed in float32 and rounds again; a token's contributions add in
// bf16 in expert order, as index_add_ adds them. The float32 dot products sum in another order than
// oneDNN's, so a value may differ from the modules' by a bf16 step.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <omp.h>
#include <c10/util/BFloat16.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <algorithm>
#include <map>
#include <string>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_tile.h"
#include "silu_bf16.h"

namespace {

using namespace pagoda_bf16;

}  // namespace

// x [T, H] bf16; ids [T, k] int64 (global expert ids); weights [T, k] float32; w13 the packed gate-up
// [E, I/32, 2, H/2, 2, 16, 2] and w2 the packed down [E, H/64, 2, I/2, 2, 16, 2] of this rank's experts
// [expert_start, expert_start + E). Returns [T, H] bf16; pairs routed to other ranks' experts add nothing.
torch::Tensor moe_experts_bf16(const torch::Tensor& x, const torch::Tensor& ids, const torch::Tensor& weights,
                               const torch::Tensor& w13, const torch::Tensor& w2, int64_t expert_start) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "moe_experts: x [T, H] bf16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong && ids.is_contiguous(),
              "moe_experts: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes() && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "moe_experts: weights [T, k] float32");
  TORCH_CHECK(w13.dim() == 7 && w2.dim() == 7 && w13.is_contiguous() && w2.is_contiguous() && w13.size(2) == 2 &&
              w2.size(2) == 2 && w13.size(4) * 2 == kNB && w2.size(4) * 2 == kNB, "moe_experts: packed weights");
  const int64_t T = x.size(0), H = x.size(1), top_k = ids.size(1), E = w13.size(0);
  const int64_t I = w13.size(1) * kBlock * kNB / 2;
  TORCH_CHECK(w13.size(3) * 2 == H && w2.size(0) == E && w2.size(1) * kBlock * kNB == H && w2.size(3) * 2 == I,
              "moe_experts: packed weights do not match x");

  // The pairs of local experts, grouped by expert in pair order (a stable sort by expert).
  const int64_t* idp = ids.data_ptr<int64_t>();
  std::vector<int64_t> start(E + 1, 0);
  for (int64_t p = 0; p < T * top_k; ++p) {
    const int64_t e = idp[p] - expert_start;
    if (e >= 0 && e < E) ++start[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  const int64_t rows = start[E];
  std::vector<int64_t> pair_of(rows), fill(start.begin(), start.end() - 1);
  std::vector<int64_t> row_of(T * top_k, -1);  // each pair's row, -1 for other ranks' experts
  for (int64_t p = 0; p < T * top_k; ++p) {
    const int64_t e = idp[p] - expert_start;
    if (e >= 0 && e < E) {
      pair_of[fill[e]] = p;
      row_of[p] = fill[e]++;
    }
  }
  auto out = torch::zeros({T, H}, x.options());
  if (rows == 0) return out;
  std::vector<int64_t> active;
  for (int64_t e = 0; e < E; ++e)
    if (start[e + 1] > start[e]) active.push_back(e);

  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* w13p = reinterpret_cast<const uint16_t*>(w13.data_ptr<at::BFloat16>());
  const auto* w2p = reinterpret_cast<const uint16_t*>(w2.data_ptr<at::BFloat16>());
  const float* wp = weights.data_ptr<float>();
  std::vector<uint16_t> act(rows * I);  // silu(gate) * up per row, bf16 bits
  std::vector<uint16_t> down(rows * H);  // weight * down per row, bf16 bits
  const float* silu = pagoda::silu_bf16_table();
  const int threads = at::get_num_threads();

  // gate-up, SiLU-and-multiply: a task is one expert's 32 act columns (gate and up blocks 2g, 2g + 1).
  const int64_t groups13 = I / (kBlock * kNB / 2);
  const int64_t tasks13 = static_cast<int64_t>(active.size()) * groups13;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks13; ++task) {
    const int64_t e = active[task / groups13], g = task % groups13;
    const uint16_t* w = w13p + e * 2 * I * H + g * kNB * kBlock * H;
    float c[kMRHalves][kNB * kBlock];
    for (int64_t r0 = start[e], n; r0 < start[e + 1]; r0 += n) {
      n = pass_rows(start[e + 1] - r0, kMRHalves);
      const uint16_t* a[kMRHalves];
      for (int m = 0; m < n; ++m) a[m] = xp + (pair_of[r0 + m] / top_k) * H;
      tile_rows_halves(static_cast<int>(n), a, w, H, c);
      for (int m = 0; m < n; ++m) store_silu_row(c[m], c[m] + kNB * kBlock / 2, 2 * kBlock, silu, act.data() + (r0 + m) * I + g * 2 * kBlock);
    }
  }

  // down, weighed: a task is one expert's 64 output columns.
  const int64_t groups2 = H / (kBlock * kNB);
  const int64_t tasks2 = static_cast<int64_t>(active.size()) * groups2;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (int64_t task = 0; task < tasks2; ++task) {
    const int64_t e = active[task / groups2], g = task % groups2;
    const uint16_t* w = w2p + e * H * I + g * kNB * kBlock * I;
    float c[kMRHalves][kNB * kBlock];
    for (int64_t r0 = start[e], n; r0 < start[e + 1]; r0 += n) {
      n = pass_rows(start[e + 1] - r0, kMRHalves);
      const uint16_t* a[kMRHalves];
      for (int m = 0; m < n; ++m) a[m] = act.data() + (r0 + m) * I;
      tile_rows_halves(static_cast<int>(n), a, w, I, c);
      for (int m = 0; m < n; ++m) {
        const float scale = wp[pair_of[r0 + m]];
        uint16_t* dst = down.data() + (r0 + m) * H + g * kNB * kBlock;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        for (int i = 0; i < kNB * kBlock; i += 16)
          store16(dst + i, to_bf16(_mm512_mul_ps(round16(_mm512_loadu_ps(c[m] + i)), _mm512_set1_ps(scale))));
#else
        for (int i = 0; i < kNB * kBlock; ++i) dst[i] = bf16(round_bf16(c[m][i]) * scale).x;
#endif
      }
    }
  }

  // Each token's contributions, added in bf16 in expert order (its pairs' rows ascend with the expert).
  auto* op = reinterpret_cast<bf16*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> mine;
    for (int64_t t = t0; t < t1; ++t) {
      mine.clear();
      for (int64_t j = 0; j < top_k; ++j)
        if (row_of[t * top_k + j] >= 0) mine.push_back(row_of[t * top_k + j]);
      std::sort(mine.begin(), mine.end());
      bf16* o = op + t * H;
      for (int64_t r : mine) {
        const uint16_t* src = down.data() + r * H;
        int64_t i = 0;
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        auto* ob = reinterpret_cast<uint16_t*>(o);
        for (; i + 16 <= H; i += 16)
          store16(ob + i, to_bf16(_mm512_add_ps(from_bf16(load16(ob + i)), from_bf16(load16(src + i)))));
#endif
        for (; i < H; ++i) o[i] = bf16(static_cast<float>(o[i]) + to_float(src[i]));
      }
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("moe_experts_bf16", &moe_experts_bf16);
  m.def("has_avx512_bf16", &pagoda_bf16::built_with_avx512_bf16);
  // For the fused decode step (exec/csrc/fused_decode.cpp), which calls it from C++.
  m.def("_addresses", [] {
    return std::map<std::string, int64_t>{{"moe_experts_bf16", reinterpret_cast<int64_t>(&moe_experts_bf16)}};
  });
}
