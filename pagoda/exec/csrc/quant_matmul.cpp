// Matmuls over weights kept quantized: GGUF blocks (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) and int8
// rows with a per-output-channel scale, read straight from their packed bytes.
//
// Few rows (decode, small batches): each output row's blocks are dequantized into a buffer that
// never leaves L1 and multiplied into every activation row at once (fp32 FMAs), so the weights are
// read from memory once per step in their quantized size. Many rows (prefill): a tile of weight rows
// is dequantized to the activations' dtype and handed to torch's GEMM, so the dequantization is paid
// once per tile for all rows.
//
// The block formats and their arithmetic are ggml's (and gguf-py's `gguf.quants.dequantize`): the
// scalar code below is that arithmetic written out; the AVX-512 and AVX2 versions of the hot types
// compute the same values (one FMA where gguf-py rounds a multiply and an add: within fp32 rounding).
// Which one runs is chosen at run time from the CPU (`__builtin_cpu_supports`), or forced with
// `set_isa` (tests run every path on one machine).
#include <torch/extension.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <omp.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <string>

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

enum Isa : int { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

int detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return AVX512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return AVX2;
  return SCALAR;
}

int g_isa = detect_isa();

#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")))
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

// ---- AVX-512: the 32-weight blocks as two vectors of 16 -------------------------------------------

TARGET_AVX512 inline void dequant_avx512(int t, const uint8_t* b, float* y) {
  switch (t) {
    case Q8_0: {
      const __m512 d = _mm512_set1_ps(half_at(b));
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 2));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 18));
      _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0))));
      _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1))));
      return;
    }
    case Q4_0:
    case Q4_1: {
      const bool has_min = t == Q4_1;
      const __m512 d = _mm512_set1_ps(half_at(b));
      const uint8_t* qs = b + (has_min ? 4 : 2);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(0xF);
      const __m128i lo = _mm_and_si128(q, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      __m512 vlo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
      __m512 vhi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
      if (has_min) {
        const __m512 m = _mm512_set1_ps(half_at(b + 2));
        _mm512_store_ps(y, _mm512_fmadd_ps(d, vlo, m));
        _mm512_store_ps(y + 16, _mm512_fmadd_ps(d, vhi, m));
      } else {
        const __m512 eight = _mm512_set1_ps(8.0f);
        _mm512_store_ps(y, _mm512_mul_ps(d, _mm512_sub_ps(vlo, eight)));
        _mm512_store_ps(y + 16, _mm512_mul_ps(d, _mm512_sub_ps(vhi, eight)));
      }
      return;
    }
    case I8: {
      const __m128i q0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
      const __m128i q1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16));
      _mm512_store_ps(y, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)));
      _mm512_store_ps(y + 16, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)));
      return;
    }
    default:
      dequant_scalar(t, b, y);
  }
}

// out[m * ldo + n] = sum_k x[m * K + k] * w[n, k] (times scale[n]) for rows n in [n0, n1).
template <int MM>
TARGET_AVX512 void rows_avx512(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                               int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    __m512 acc0[MM], acc1[MM];
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = _mm512_setzero_ps();
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
      dequant_avx512(t, blk, buf);
      for (int j = 0; j < L.elems; j += 32) {
        const __m512 w0 = _mm512_load_ps(buf + j), w1 = _mm512_load_ps(buf + j + 16);
        for (int m = 0; m < MM; m++) {
          const float* xr = x + m * K + k + j;
          acc0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xr), acc0[m]);
          acc1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xr + 16), acc1[m]);
        }
      }
    }
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc0[m], acc1[m])) * s;
  }
}

// ---- AVX2: the 32-weight blocks as four vectors of 8 ----------------------------------------------

TARGET_AVX2 inline void dequant_avx2(int t, const uint8_t* b, float* y) {
  switch (t) {
    case Q8_0:
    case I8: {
      const float dv = t == Q8_0 ? half_at(b) : 1.0f;
      const __m256 d = _mm256_set1_ps(dv);
      const uint8_t* q = b + (t == Q8_0 ? 2 : 0);
      for (int i = 0; i < 32; i += 8) {
        const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + i));
        _mm256_store_ps(y + i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))));
      }
      return;
    }
    case Q4_0:
    case Q4_1: {
      const bool has_min = t == Q4_1;
      const __m256 d = _mm256_set1_ps(half_at(b));
      const __m256 m = has_min ? _mm256_set1_ps(half_at(b + 2)) : _mm256_set1_ps(8.0f);
      const uint8_t* qs = b + (has_min ? 4 : 2);
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i mask = _mm_set1_epi8(0xF);
      const __m128i lo = _mm_and_si128(q, mask);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int i = 0; i < 4; i++) {
        const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i]));
        _mm256_store_ps(y + 8 * i, has_min ? _mm256_fmadd_ps(d, v, m) : _mm256_mul_ps(d, _mm256_sub_ps(v, m)));
      }
      return;
    }
    default:
      dequant_scalar(t, b, y);
  }
}

TARGET_AVX2 inline float hsum_avx2(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <int MM>
TARGET_AVX2 void rows_avx2(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K,
                           int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    __m256 acc0[MM], acc1[MM];
    for (int m = 0; m < MM; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    const uint8_t* blk = w + n * row_bytes;
    for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
      dequant_avx2(t, blk, buf);
      for (int j = 0; j < L.elems; j += 16) {
        const __m256 w0 = _mm256_load_ps(buf + j), w1 = _mm256_load_ps(buf + j + 8);
        for (int m = 0; m < MM; m++) {
          const float* xr = x + m * K + k + j;
          acc0[m] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xr), acc0[m]);
          acc1[m] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xr + 8), acc1[m]);
        }
      }
    }
    const float s = scale ? scale[n] : 1.0f;
    for (int m = 0; m < MM; m++) out[m * ldo + n] = hsum_avx2(_mm256_add_ps(acc0[m], acc1[m])) * s;
  }
}

// ---- scalar: any CPU ------------------------------------------------------------------------------

void rows_scalar(int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K, int64_t n0,
                 int64_t n1, float* out, int64_t ldo, const float* scale) {
  const Layout L = layout(t);
  float buf[256];
  for (int64_t n = n0; n < n1; n++) {
    const uint8_t* row = w + n * row_bytes;
    for (int64_t m = 0; m < M; m++) {
      float acc = 0.0f;
      const uint8_t* blk = row;
      for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
        dequant_scalar(t, blk, buf);
        for (int j = 0; j < L.elems; j++) acc += buf[j] * x[m * K + k + j];
      }
      out[m * ldo + n] = acc * (scale ? scale[n] : 1.0f);
    }
  }
}

template <int MM>
void rows_for(int isa, int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t K, int64_t n0,
              int64_t n1, float* out, int64_t ldo, const float* scale) {
  if (isa == AVX512)
    rows_avx512<MM>(t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  else if (isa == AVX2)
    rows_avx2<MM>(t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  else
    rows_scalar(t, w, row_bytes, x, MM, K, n0, n1, out, ldo, scale);
}

constexpr int kMaxFusedRows = 8;

void rows_any(int isa, int t, const uint8_t* w, int64_t row_bytes, const float* x, int64_t M, int64_t K,
              int64_t n0, int64_t n1, float* out, int64_t ldo, const float* scale) {
  switch (M) {
    case 1: return rows_for<1>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 2: return rows_for<2>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 3: return rows_for<3>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 4: return rows_for<4>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 5: return rows_for<5>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 6: return rows_for<6>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 7: return rows_for<7>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
    case 8: return rows_for<8>(isa, t, w, row_bytes, x, K, n0, n1, out, ldo, scale);
  }
  TORCH_CHECK(false, "quant_matmul: at most ", kMaxFusedRows, " rows per fused call");
}

void dequant_block(int isa, int t, const uint8_t* b, float* y) {
  if (isa == AVX512)
    dequant_avx512(t, b, y);
  else if (isa == AVX2)
    dequant_avx2(t, b, y);
  else
    dequant_scalar(t, b, y);
}

void check_weight(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale) {
  const Layout L = layout(t);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kUInt8 && w.is_contiguous(),
              "quant_matmul: weight must be a contiguous uint8 [rows, bytes per row] tensor");
  TORCH_CHECK(K % L.elems == 0 && w.size(1) == K / L.elems * L.bytes, "quant_matmul: a row of ", K,
              " weights takes ", K / L.elems * L.bytes, " bytes of this type, the weight has ", w.size(1));
  if (scale) {
    TORCH_CHECK(scale->scalar_type() == torch::kFloat32 && scale->is_contiguous() && scale->numel() == w.size(0),
                "quant_matmul: scale must be a contiguous float32 tensor with one value per row");
  }
}

void dequant_row(int isa, int t, const uint8_t* blk, int64_t K, float f, float* y) {
  const Layout L = layout(t);
  alignas(64) float buf[256];
  for (int64_t k = 0; k < K; k += L.elems, blk += L.bytes) {
    dequant_block(isa, t, blk, buf);
    for (int j = 0; j < L.elems; j++) y[k + j] = buf[j] * f;
  }
}

// Rows [start, start + count) of the weight, dequantized to float32: [count, K].
torch::Tensor dequantize_rows(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale,
                              int64_t start, int64_t count) {
  check_weight(w, t, K, scale);
  TORCH_CHECK(start >= 0 && count >= 0 && start + count <= w.size(0), "dequantize_rows: rows out of range");
  auto out = torch::empty({count, K}, torch::kFloat32);
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int isa = g_isa;
#pragma omp parallel for schedule(static) if (count * K > 16384)
  for (int64_t r = 0; r < count; r++)
    dequant_row(isa, t, base + (start + r) * row_bytes, K, s ? s[start + r] : 1.0f, o + r * K);
  return out;
}

// Embedding rows picked by id, dequantized to float32: [ids.numel(), K].
torch::Tensor gather_rows(const torch::Tensor& w, int64_t t, int64_t K, const c10::optional<torch::Tensor>& scale,
                          const torch::Tensor& ids) {
  check_weight(w, t, K, scale);
  auto idx = ids.to(torch::kInt64).contiguous();
  const int64_t n = idx.numel();
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; i++)
    TORCH_CHECK(id[i] >= 0 && id[i] < w.size(0), "gather_rows: id ", id[i], " out of range");
  auto out = torch::empty({n, K}, torch::kFloat32);
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  const int isa = g_isa;
#pragma omp parallel for schedule(static) if (n * K > 16384)
  for (int64_t i = 0; i < n; i++) dequant_row(isa, t, base + id[i] * row_bytes, K, s ? s[id[i]] : 1.0f, o + i * K);
  return out;
}

// x [M, K] float32 -> [M, N] float32 through the fused path (M <= kMaxFusedRows).
torch::Tensor fused_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t,
                           const c10::optional<torch::Tensor>& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32, "quant_matmul: x must be float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, t, K, scale);
  TORCH_CHECK(M <= kMaxFusedRows, "quant_matmul: at most ", kMaxFusedRows, " rows per fused call");
  auto xc = x.contiguous();
  auto out = torch::empty({M, N}, torch::kFloat32);
  if (M == 0 || N == 0) return out;
  const uint8_t* base = w.data_ptr<uint8_t>();
  const int64_t row_bytes = w.size(1);
  const float* xs = xc.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const float* s = scale ? scale->data_ptr<float>() : nullptr;
  const int isa = g_isa;
  // Chunks of 16 rows: few enough per thread to balance, many enough to amortise the loop.
  const int64_t chunks = (N + 15) / 16;
#pragma omp parallel for schedule(static) if (N * K > 32768)
  for (int64_t c = 0; c < chunks; c++) {
    const int64_t n0 = c * 16, n1 = std::min<int64_t>(N, n0 + 16);
    rows_any(isa, t, base, row_bytes, xs, M, K, n0, n1, o, N, s);
  }
  return out;
}

// x [M, K] (float32 or bfloat16) -> [M, N] in x's dtype: fused for few rows, else tiles of weight
// rows dequantized to x's dtype and multiplied by torch's GEMM.
torch::Tensor quant_matmul(const torch::Tensor& x, const torch::Tensor& w, int64_t t,
                           const c10::optional<torch::Tensor>& scale, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2, "quant_matmul: x must be [M, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  check_weight(w, t, K, scale);
  if (M <= kMaxFusedRows) {
    auto out = fused_matmul(x.to(torch::kFloat32), w, t, scale);
    return x.scalar_type() == torch::kFloat32 ? out : out.to(x.scalar_type());
  }
  auto out_t = torch::empty({N, M}, x.options());
  auto xt = x.t();
  for (int64_t n0 = 0; n0 < N; n0 += tile_rows) {
    const int64_t rows = std::min(tile_rows, N - n0);
    auto tile = dequantize_rows(w, t, K, scale, n0, rows);
    if (x.scalar_type() != torch::kFloat32) tile = tile.to(x.scalar_type());
    auto dst = out_t.narrow(0, n0, rows);
    at::mm_out(dst, tile, xt);
  }
  return out_t.t().contiguous();
}

void set_isa(const std::string& name) {
  if (name == "auto") g_isa = detect_isa();
  else if (name == "avx512") {
    TORCH_CHECK(detect_isa() >= AVX512, "this CPU lacks AVX-512");
    g_isa = AVX512;
  } else if (name == "avx2") {
    TORCH_CHECK(detect_isa() >= AVX2, "this CPU lacks AVX2");
    g_isa = AVX2;
  } else if (name == "scalar") g_isa = SCALAR;
  else TORCH_CHECK(false, "set_isa: auto, avx512, avx2 or scalar; got ", name);
}

std::string isa() { return g_isa == AVX512 ? "avx512" : g_isa == AVX2 ? "avx2" : "scalar"; }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quant_matmul", &quant_matmul, "x @ dequantize(w).T over quantized rows");
  m.def("fused_matmul", &fused_matmul, "the few-rows path of quant_matmul (float32)");
  m.def("dequantize_rows", &dequantize_rows, "rows [start, start + count) of w as float32");
  m.def("gather_rows", &gather_rows, "the rows `ids` of w as float32 (embedding lookup)");
  m.def("set_isa", &set_isa, "force the instruction set: auto, avx512, avx2 or scalar");
  m.def("isa", &isa, "the instruction set in use");
  // Entry points for the fused decode step (exec/csrc/fused_decode.cpp), which calls them from C++.
  m.def("_addresses", [] { return std::map<std::string, int64_t>{{"quant_matmul", reinterpret_cast<int64_t>(&quant_matmul)}}; });
}
