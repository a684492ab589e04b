// silu(g) for every bf16 g, as a table of 65,536 floats indexed by g's bits: the bf16 results
// bf16(g / (1 + e)) with e = exp(-g) rounded once to float (from a double exp) and the sum and
// division in float, which is what torch's F.silu computes for a bf16 tensor (model/csrc/layer_ops.cpp
// says how that was checked). Two kernels read it: layer_ops' SiLU-and-multiply and the bf16 GEMM's
// SiLU epilogue (exec/csrc/gemm_bf16.cpp), which so give the same bits.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace pagoda {

// f rounded to bf16 (to nearest even, NaN to 0x7FC0, as c10::BFloat16 rounds), as a float.
inline float round_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t bits = ((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded) << 16;
  float r;
  std::memcpy(&r, &bits, 4);
  return r;
}

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
      t[b] = round_to_bf16(x / (1.f + ef));
    }
    return t;
  }();
  return table.data();
}

}  // namespace pagoda
