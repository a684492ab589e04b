// silu(g) for every bf16 g, as a table of 65,536 floats indexed by g's bits: the bf16 results
// bf16(g / (1 + e)) with e = exp(-g) rounded once to float (from a double exp) and the sum and
// division in float, which is what torch's F.silu computes for a bf16 tensor (model/csrc/layer_ops.cpp
// says how that was checked). layer_ops' SiLU-and-multiply reads it, and so do the epilogues of the
// bf16 GEMM (exec/csrc/gemm_bf16.cpp) and the grouped MoE kernel (exec/csrc/moe_experts.cpp), which
// so give the same bits. silu_mul_row is the row of SiLU-and-multiply over bf16 bits that layer_ops
// and the GEMM's few-rows path over GGUF blocks both run.
#pragma once

#include <c10/util/BFloat16.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pagoda {

// Built once, on first use.
inline const float* silu_bf16_table() {
  static const std::vector<float> table = [] {
    std::vector<float> t(1 << 16);
    for (uint32_t b = 0; b < (1u << 16); ++b) {
      const uint32_t bits = b << 16;
      float x;
      std::memcpy(&x, &bits, 4);
      const double e = std::exp(-static_cast<double>(x));
      // Past float's range exp(-g) is inf (and silu -0, or NaN at g = -inf, as in float math).
      const float ef = e > std::numeric_limits<float>::max() ? std::numeric_limits<float>::infinity()
                                                              : static_cast<float>(e);
      t[b] = static_cast<float>(c10::BFloat16(x / (1.f + ef)));  // to nearest even, NaN to 0x7FC0
    }
    return t;
  }();
  return table.data();
}

// f rounded to bf16 bits, to nearest even, a NaN to 0x7FC0: c10's conversion, inline and with a
// select in place of a branch, so that the loops calling it vectorise.
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
}

// dst[j] = bf16(silu(gate[j]) * up[j]) for j < n, over bf16 bits: the table's silu times up in
// float, one rounding of the product (GCC vectorises the loop, the table read as a gather).
inline void silu_mul_row(const uint16_t* gate, const uint16_t* up, int64_t n, const float* table, uint16_t* dst) {
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t ub = static_cast<uint32_t>(up[j]) << 16;
    float u;
    std::memcpy(&u, &ub, 4);
    dst[j] = bf16_bits(table[gate[j]] * u);
  }
}

}  // namespace pagoda
