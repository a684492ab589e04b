// The GGUF block formats quant_matmul.cpp reads (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K, and int8 rows
// with a per-row scale): their sizes and their dequantization written out as scalar code, which is
// ggml's arithmetic (and gguf-py's `gguf.quants.dequantize`) and the reference for every faster path.
#pragma once

#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

namespace {

// ggml's type ids; I8 is int8 rows whose scale is given per row.
enum QType : int { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, I8 = 24 };

struct Layout {
  int elems;  // weights per block
  int bytes;  // bytes per block
};

Layout layout(int64_t t) {
  switch (t) {
    case Q4_0: return {32, 18};
    case Q4_1: return {32, 20};
    case Q8_0: return {32, 34};
    case Q4_K: return {256, 144};
    case Q5_K: return {256, 176};
    case Q6_K: return {256, 210};
    case I8: return {32, 32};
  }
  TORCH_CHECK(false, "quant_matmul: unsupported quantization type id ", t);
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// Q4_K and Q5_K pack eight 6-bit scales and eight 6-bit mins into 12 bytes.
inline void scale_min_k4(int j, const uint8_t* q, float* sc, float* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

void dequant_scalar(int t, const uint8_t* b, float* y) {
  switch (t) {
    case Q8_0: {
      const float d = half_at(b);
      const int8_t* q = reinterpret_cast<const int8_t*>(b + 2);
      for (int i = 0; i < 32; i++) y[i] = d * q[i];
      return;
    }
    case Q4_0: {
      const float d = half_at(b);
      const uint8_t* q = b + 2;
      for (int i = 0; i < 16; i++) {
        y[i] = d * ((q[i] & 0xF) - 8);
        y[i + 16] = d * ((q[i] >> 4) - 8);
      }
      return;
    }
    case Q4_1: {
      const float d = half_at(b), m = half_at(b + 2);
      const uint8_t* q = b + 4;
      for (int i = 0; i < 16; i++) {
        y[i] = d * (q[i] & 0xF) + m;
        y[i + 16] = d * (q[i] >> 4) + m;
      }
      return;
    }
    case I8: {
      for (int i = 0; i < 32; i++) y[i] = static_cast<int8_t>(b[i]);
      return;
    }
    case Q4_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* q = b + 16;
      for (int j = 0, is = 0; j < 256; j += 64, is += 2, q += 32) {
        float sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * sc, m2 = dmin * mn;
        for (int l = 0; l < 32; l++) y[j + l] = d1 * (q[l] & 0xF) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * (q[l] >> 4) - m2;
      }
      return;
    }
    case Q5_K: {
      const float d = half_at(b), dmin = half_at(b + 2);
      const uint8_t* scales = b + 4;
      const uint8_t* qh = b + 16;
      const uint8_t* ql = b + 48;
      uint8_t u1 = 1, u2 = 2;
      for (int j = 0, is = 0; j < 256; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
        float sc, mn;
        scale_min_k4(is, scales, &sc, &mn);
        const float d1 = d * sc, m1 = dmin * mn;
        scale_min_k4(is + 1, scales, &sc, &mn);
        const float d2 = d * sc, m2 = dmin * mn;
        for (int l = 0; l < 32; l++) y[j + l] = d1 * ((ql[l] & 0xF) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++) y[j + 32 + l] = d2 * ((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
      }
      return;
    }
    case Q6_K: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_at(b + 208);
      for (int n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8) {
        for (int l = 0; l < 32; l++) {
          const int is = l / 16;
          const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
          const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
          const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
          const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
          y[n + l] = d * sc[is + 0] * q1;
          y[n + l + 32] = d * sc[is + 2] * q2;
          y[n + l + 64] = d * sc[is + 4] * q3;
          y[n + l + 96] = d * sc[is + 6] * q4;
        }
      }
      return;
    }
  }
}

}  // namespace
